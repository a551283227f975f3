"""Rank-side functions of the expert-parallel tests (tests/test_expert_parallel.py).

The model: a dense input projection, one ``deepspeed.moe.layer.MoE`` (top-1 gating, no dropped
tokens, so each token's expert does not depend on the batch it came in), a dense head, and an MSE
loss without the auxiliary loss. Every parameter starts from a generator seeded by its name,
experts by their global index, so a run at any EP size and the single-process reference (EP=1,
every expert local) start from the same numbers.
"""

from __future__ import annotations

import copy
import zlib

import torch
import torch.nn.functional as F
from torch import nn

DIM, HIDDEN, EXPERTS, IN, OUT = 16, 24, 4, 8, 4
MICRO_BATCH, TOKENS = 2, 6

BASE = {
    "train_micro_batch_size_per_gpu": MICRO_BATCH,
    "gradient_accumulation_steps": 1,
    "gradient_clipping": 1.0,
    "steps_per_print": 10_000,
    "zero_optimization": {"stage": 2, "reduce_bucket_size": 2000},
    "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}},
    "canzona": {"log_plan": False, "bucket_numel": 600},
}


class Expert(nn.Module):
    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, HIDDEN)
        self.down = nn.Linear(HIDDEN, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class MoEModel(nn.Module):
    def __init__(self, ep_size: int):
        super().__init__()
        from deepspeed.moe.layer import MoE

        self.inp = nn.Linear(IN, DIM)
        self.moe = MoE(hidden_size=DIM, expert=Expert(), num_experts=EXPERTS, ep_size=ep_size, k=1,
                       drop_tokens=False, use_rts=False)
        self.head = nn.Linear(DIM, OUT)

    def forward(self, batch):
        x, y = batch
        h = self.inp(x)
        out, _, _ = self.moe(h)
        return F.mse_loss(self.head(h + out), y)


def global_name(name: str, ep_rank: int, ep_size: int) -> str:
    """A parameter's name with its local expert index made global (EP rank r holds experts r*L..)."""
    marker = "deepspeed_experts."
    if marker not in name:
        return name
    head, tail = name.split(marker)
    local, rest = tail.split(".", 1)
    return f"{head}{marker}{ep_rank * (EXPERTS // ep_size) + int(local)}.{rest}"


def make_model(ep_size: int, ep_rank: int) -> MoEModel:
    model = MoEModel(ep_size)
    with torch.no_grad():
        for name, param in model.named_parameters():
            seed = zlib.crc32(global_name(name, ep_rank, ep_size).encode())
            values = torch.randn(param.shape, generator=torch.Generator().manual_seed(seed))
            param.copy_(values / max(1, param.shape[-1]) ** 0.5)
    return model


def batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 100 * micro + rank)
    return torch.randn(MICRO_BATCH, TOKENS, IN, generator=g), torch.randn(MICRO_BATCH, TOKENS, OUT, generator=g)


def config(world_size: int, *, stage: int = 2, canzona: bool = True, optimizer: dict | None = None, ga: int = 1,
           offload: bool = False, **changes) -> dict:
    cfg = copy.deepcopy(BASE)
    cfg["zero_optimization"]["stage"] = stage
    if offload:
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    cfg["gradient_accumulation_steps"] = ga
    cfg["train_batch_size"] = MICRO_BATCH * world_size * ga
    if optimizer is not None:
        cfg["optimizer"] = optimizer
    if not canzona:
        cfg.pop("canzona")
    for key, value in changes.items():
        cfg[key] = value
    return cfg


def train(rank: int, world_size: int, runs: list[dict]) -> list[dict]:
    """Each run: {"ep": EP size, "steps": n, "config": DeepSpeed config, "deepspeed_muon_fp32": bool}."""
    import deepspeed
    from deepspeed.utils import groups

    import ds_canzona  # noqa: F401  (registers the engine hook)

    deepspeed.init_distributed(dist_backend="gloo")
    results = []
    for run in runs:
        ep = run["ep"]
        if run.get("deepspeed_muon_fp32"):
            from ds_canzona.bench.standins._instrument import force_deepspeed_ns_dtype
            force_deepspeed_ns_dtype(torch.float32)  # only the distribution differs from ours
        # The rank's EP rank, as deepspeed.utils.groups lays out the expert-parallel groups.
        ep_rank = rank % ep
        model = make_model(ep, ep_rank)
        engine, *_ = deepspeed.initialize(model=model, config=run["config"])
        assert groups._get_expert_parallel_rank(f"ep_size_{ep}") == ep_rank
        captured: list[dict[str, torch.Tensor]] = []
        if run.get("capture"):  # each step's averaged gradients of what this rank owns, by global name
            zero, original_step = engine.optimizer, engine.optimizer.step

            def step_with_capture(*args, **kwargs):
                captured.append({k: v.clone() for k, v in zero.owned_gradients().items()})
                return original_step(*args, **kwargs)

            zero.step = step_with_capture
        losses = []
        for step in range(run["steps"]):
            for micro in range(engine.gradient_accumulation_steps()):
                loss = engine(batch(step, micro, rank))
                engine.backward(loss)
                engine.step()
                losses.append(float(loss.detach()))
        zero = engine.optimizer
        result = {
            "params": {global_name(n, ep_rank, ep): p.detach().clone() for n, p in engine.module.named_parameters()},
            "losses": losses,
            "ep_rank": ep_rank,
            "grads": captured,
        }
        if hasattr(zero, "families"):
            result["families"] = [(name, runtime.world_size, len(runtime.params), runtime.plan.world_size,
                                   sorted(t.name for t in runtime.owned_tensors()))
                                  for name, runtime in zip(zero.family_names, zero.families)]
            result["owned"] = sorted(t.name for t in zero.owned_tensors())
            result["state_names"] = sorted(zero.state_dict()["state"])
            result["grad_norm"] = float(zero._global_grad_norm)
            result["offloaded"] = [runtime.offload is not None for runtime in zero.families]
        results.append(result)
        engine.destroy()
    return results


def reference(optimizer: dict, *, world_size: int, steps: int, clip: float = 1.0, ga: int = 1
              ) -> dict[str, torch.Tensor]:
    """Single-process training with ``ds_canzona.optim`` on the whole model (EP=1): each step's gradient
    is the mean of the ranks' micro-batch losses' gradients, clipped by the global norm."""
    from grad_reference import whole_batch_training

    model = make_model(1, 0)
    groups_ready(model)
    return whole_batch_training(optimizer, model, lambda m, step, micro, rank: m(batch(step, micro, rank)),
                                world_size=world_size, steps=steps, ga=ga, clip=clip)


def reference_gradients(*, world_size: int) -> dict[str, torch.Tensor]:
    """The first step's gradient of the whole model (EP=1): the mean over the ranks' micro-batch losses."""
    model = make_model(1, 0)
    groups_ready(model)
    for rank in range(world_size):
        (model(batch(0, 0, rank)) / world_size).backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}


def groups_ready(model: MoEModel) -> None:
    import os

    import deepspeed
    from deepspeed.utils import groups

    os.environ.setdefault("LOCAL_SIZE", "1")
    deepspeed.init_distributed(dist_backend="gloo")
    groups._create_expert_and_data_parallel(1)
    model.moe.set_deepspeed_parallelism()


def references(rank: int, world_size: int, cases: list[dict]) -> list[dict[str, torch.Tensor]]:
    """``reference(**case)`` for each case (``reference_gradients`` for one with "gradients": true), in one
    process (spawned: the MoE layer needs a process group)."""
    return [reference_gradients(world_size=case["world_size"]) if case.get("gradients") else reference(**case)
            for case in cases]


def replay(optimizer: dict, grads: list[dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The single-process ``ds_canzona.optim`` optimizer on the whole model (global names), each step
    fed the given averaged gradients (no clipping): what the distributed step must give bit for bit."""
    from grad_reference import optimizer_class
    from ds_canzona.zero.build import translate_optimizer_params

    model = make_model(1, 0)  # EP=1: local expert names are the global ones
    named = [(n, p) for n, p in model.named_parameters()]
    name = optimizer["type"].lower()
    opt = optimizer_class(name)(named, **translate_optimizer_params(name, optimizer["params"]))
    for step_grads in grads:
        for n, p in named:
            p.grad = step_grads[n].clone()
        opt.step()
    return {n: p.detach().clone() for n, p in named}


def save_and_resume(rank: int, world_size: int, directory: str, ep_save: int, ep_loads: list[int],
                    steps_before: int, steps_after: int) -> list[dict]:
    """Train ``steps_before`` steps at EP=``ep_save``, save; then for each EP size in ``ep_loads`` build a
    fresh engine, load the checkpoint and train ``steps_after`` more steps. The parameters after each
    (global names), and the saved manifest's tensor names."""
    import os

    import deepspeed

    import ds_canzona  # noqa: F401  (registers the engine hook)
    from ds_canzona.zero.checkpoint.format import read_meta

    deepspeed.init_distributed(dist_backend="gloo")

    def engine_at(ep: int):
        engine, *_ = deepspeed.initialize(model=make_model(ep, rank % ep), config=config(world_size))
        return engine

    def steps(engine, first: int, count: int) -> None:
        for step in range(first, first + count):
            loss = engine(batch(step, 0, rank))
            engine.backward(loss)
            engine.step()

    engine = engine_at(ep_save)
    steps(engine, 0, steps_before)
    engine.save_checkpoint(directory, tag="saved")
    at_save = {global_name(n, rank % ep_save, ep_save): p.detach().clone() for n, p in engine.module.named_parameters()}
    engine.destroy()
    manifest = [t["name"] for t in read_meta(os.path.join(directory, "saved"))["tensors"]]
    results = []
    for ep in ep_loads:
        engine = engine_at(ep)
        engine.load_checkpoint(directory, tag="saved")
        loaded_steps = engine.global_steps
        steps(engine, steps_before, steps_after)
        results.append({"ep": ep, "loaded_steps": loaded_steps, "manifest": manifest, "at_save": at_save,
                        "params": {global_name(n, rank % ep, ep): p.detach().clone()
                                   for n, p in engine.module.named_parameters()}})
        engine.destroy()
    return results
