"""ZeRO-3's collective launches per step, counted in one process as rank 0 of DP=8 on torch's fake process group.

A small Qwen3 (transformers' Qwen3ForCausalLM: 4 layers, q/k norms, untied head) trains two
steps at stage 3 as rank 0 of an 8-rank world (``tests/fake_world.py``). Every collective that
reaches ``torch.distributed`` is counted by the wrapper below, so the count is what the runtime
and DeepSpeed's coordinator issue, not a formula: a collective outside a coalescing block is one
launch; a coalescing block (torch's ``_coalescing_manager``, one NCCL group) is one launch
whatever it holds, and the operations inside it are counted as operations. The fake backend
delivers nothing, so the wrapper zeroes what a rank receives (the run stays finite).

Four runs, counted in the third step (the coordinator's trace recorded and checked in the first two):

- per piece (gloo's default, forced here): one broadcast per piece per fetch, one reduce per item;
- grouped: one launch per
  module fetch, one per gradient bucket, one refresh of the persistent parameters after the step;
  DeepSpeed's default ``stage3_param_persistence_threshold`` (1e5) makes the norms persistent, and
  they are checked never to be fetched in forward or backward;
- padded: the same launches as one all-gather / reduce-scatter each, the padding counted.
- priced (the default on backends other than gloo, the fake one included): the same launches,
  each one operation: a single piece's broadcast or reduce, else what the cost model prices lower
  of an all-reduce and a padded collective.

The counts are printed (docs/NOTES.md has them) and checked against the plan: launches per
step in the grouped and padded runs are the module fetches plus the buckets plus two in the
step (the norm all-reduce and the refresh), and at most half of the per-piece run's.
One spawned process, about 11 s here (four engines, three steps each).
"""

from __future__ import annotations

import contextlib
import functools
from collections import Counter

from distributed import run_ranks

RANK, WORLD = 0, 8
QWEN3 = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, tie_word_embeddings=False, use_cache=False,
             attn_implementation="eager", max_position_embeddings=64)
BUCKET = 20_000  # elements: the model's ~0.17 M gradient elements go in about ten buckets
# DeepSpeed's default (1e5 elements) against a Qwen3-8B's shapes keeps exactly the norms resident
# (4096 and 128 elements; the smallest matrix has 4M); on this model's shapes 1000 does the same.
PERSISTENCE_THRESHOLD = 1000
# Steps 0 and 1 record and check DeepSpeed's module trace (its own broadcasts among them); step 2 is
# the steady state that is counted.
STEPS, M = 3, 2
MICRO_BATCH, SEQ = 2, 12
WRAPPED = ("broadcast", "reduce", "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
           "reduce_scatter_tensor", "all_to_all_single", "all_reduce_coalesced", "_all_gather_base",
           "_reduce_scatter_base", "all_gather_single", "reduce_scatter_single")
# The same collective under another name: DeepSpeed's backend keeps torch's functions from before the
# wrapping, and those call the single-tensor forms, which are wrapped.
ALIASES = {"_all_gather_base": "all_gather_into_tensor", "all_gather_single": "all_gather_into_tensor",
           "_reduce_scatter_base": "reduce_scatter_tensor", "reduce_scatter_single": "reduce_scatter_tensor"}


class LaunchCounter:
    """Counts launches, operations and payload bytes of every torch.distributed collective, by phase."""

    def __init__(self) -> None:
        self.phase = "setup"
        self.launches: Counter = Counter()
        self.ops: Counter = Counter()  # (phase, kind)
        self.bytes: Counter = Counter()
        self.targets: dict[str, set] = {}  # phase -> storages that broadcasts wrote into
        self._depth = 0
        self._grouped_ops = None

    def collective(self, kind: str, arguments: dict) -> None:
        self.ops[self.phase, kind] += 1
        tensors = [v for v in arguments.values() if hasattr(v, "untyped_storage")]
        self.bytes[self.phase] += max(t.numel() * t.element_size() for t in tensors) if tensors else 0
        if kind == "broadcast":
            self.targets.setdefault(self.phase, set()).add(arguments["tensor"].untyped_storage().data_ptr())
        if self._grouped_ops is not None:
            self._grouped_ops += 1
        else:
            self.launches[self.phase] += 1

    @contextlib.contextmanager
    def group(self):
        self._grouped_ops = 0
        try:
            yield
        finally:
            if self._grouped_ops:
                self.launches[self.phase] += 1
            self._grouped_ops = None


def _receive_zeros(kind: str, arguments: dict) -> None:
    """What a rank receives, as zeros (the fake backend leaves buffers as they were: uninitialised)."""
    import torch.distributed as tdist

    if kind == "broadcast" and arguments.get("src") != tdist.get_rank():
        arguments["tensor"].zero_()
    for key in ("output_tensor", "output"):
        if key in arguments and hasattr(arguments[key], "zero_"):
            arguments[key].zero_()
    for key in ("tensor_list", "output_tensor_list"):
        for t in arguments.get(key) or []:
            t.zero_()


@contextlib.contextmanager
def counting(counter: LaunchCounter):
    import inspect

    import torch.distributed as tdist
    import torch.distributed.distributed_c10d as c10d

    saved = []

    def patch(owner, name, value):
        saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, value)

    for name in WRAPPED:
        if not hasattr(c10d, name):
            continue
        original = getattr(c10d, name)
        signature = inspect.signature(original)

        @functools.wraps(original)
        def wrapped(*args, _original=original, _name=name, _signature=signature, **kwargs):
            if counter._depth:  # one collective calling another inside torch: counted once
                return _original(*args, **kwargs)
            arguments = dict(_signature.bind(*args, **kwargs).arguments)
            counter.collective(ALIASES.get(_name, _name), arguments)
            counter._depth += 1
            try:
                result = _original(*args, **kwargs)
            finally:
                counter._depth -= 1
            _receive_zeros(ALIASES.get(_name, _name), arguments)
            return result

        for owner in (tdist, c10d):
            if getattr(owner, name, None) is original:
                patch(owner, name, wrapped)
    original_manager = c10d._coalescing_manager

    @contextlib.contextmanager
    def coalescing_manager(*args, **kwargs):
        with counter.group(), original_manager(*args, **kwargs) as manager:
            yield manager

    patch(c10d, "_coalescing_manager", coalescing_manager)
    try:
        yield counter
    finally:
        for owner, name, value in reversed(saved):
            setattr(owner, name, value)


def _tokens(step: int) -> "torch.Tensor":
    import torch
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, QWEN3["vocab_size"], (MICRO_BATCH, SEQ), generator=g)


def _count_run(collectives: str) -> dict:
    import deepspeed
    import torch
    import torch.nn.functional as F
    from transformers import Qwen3Config, Qwen3ForCausalLM

    import ds_canzona  # noqa: F401  (registers the engine hook)
    import ds_canzona.zero.stage3 as stage3
    from ds_canzona.zero.stage3_comm import PER_PIECE, PRICED, zero3_collectives

    torch.manual_seed(0)
    model = Qwen3ForCausalLM(Qwen3Config(**QWEN3))
    model.train()
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
              "train_batch_size": MICRO_BATCH * WORLD, "gradient_clipping": 1.0, "steps_per_print": 10_000,
              "zero_optimization": {"stage": 3, "reduce_bucket_size": BUCKET,
                                    "stage3_param_persistence_threshold": PERSISTENCE_THRESHOLD,
                                    # No prefetch: the coordinator fetches module by module, as a model
                                    # whose layers exceed the prefetch bucket (5e7 elements) does.
                                    "stage3_prefetch_bucket_size": 0},
              "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003}},
              "canzona": {"log_plan": False,
                          "collectives": "default" if collectives in (PER_PIECE, PRICED) else collectives}}
    # gloo's per-piece default, forced on the fake backend for the "before" count.
    chosen = (lambda choice, group: PER_PIECE) if collectives == PER_PIECE else zero3_collectives
    stage3.zero3_collectives, original = chosen, stage3.zero3_collectives
    counter = LaunchCounter()
    try:
        with counting(counter):
            engine, *_ = deepspeed.initialize(model=model, config=config, model_parameters=model.parameters())
            zero = engine.optimizer
            for step in range(STEPS):
                counter.phase = f"forward_backward {step}"
                batch = _tokens(step)
                logits = engine(input_ids=batch[:, :-1]).logits
                loss = F.cross_entropy(logits.reshape(-1, QWEN3["vocab_size"]).float(), batch[:, 1:].reshape(-1))
                engine.backward(loss)
                persistent = [p for p in zero.params if p.ds_persist]
                resident = all(p.ds_status.name == "AVAILABLE" for p in persistent)
                counter.phase = f"step {step}"
                engine.step()
            counter.phase = "after"
            persistent_storages = {p.data.untyped_storage().data_ptr() for p in persistent}
            result = {
                "mode": zero.collectives,
                "launches": dict(counter.launches),
                "ops": {f"{phase}: {kind}": n for (phase, kind), n in counter.ops.items()},
                "bytes": dict(counter.bytes),
                "n_params": len(zero.params),
                "n_items": len(zero.plan.specs),
                "n_pieces": sum(len(items) for items in zero.plan.tensor_items()),
                "persistent": len(persistent),
                "persistent_resident_in_backward": resident,
                "fetched_persistent": bool(persistent_storages & counter.targets.get(f"forward_backward {M}", set())),
                "buckets": _buckets(zero),
                "overflow": bool(zero.overflow),
            }
            engine.destroy()
    finally:
        stage3.zero3_collectives = original
    return result


def _buckets(zero) -> int:
    buckets, held = 0, 0
    for i in reversed(range(len(zero.params))):
        held += zero.params[i].ds_numel
        if held >= zero.reduce_bucket_numel:
            buckets, held = buckets + 1, 0
    return buckets + (held > 0)


def launch_counts(rank: int, world_size: int) -> dict:
    from fake_world import fake_world

    with fake_world(RANK, WORLD):
        return {mode: _count_run(mode) for mode in ("per_piece", "grouped", "padded", "priced")}


def _table(counts: dict) -> str:
    lines = ["mode       fwd+bwd launches  step launches  fwd+bwd ops  bytes fwd+bwd  bytes step"]
    for mode, run in counts.items():
        lines.append(f"{mode:10} {run['launches'].get(f'forward_backward {M}', 0):16} "
                     f"{run['launches'].get(f'step {M}', 0):14} "
                     f"{sum(n for k, n in run['ops'].items() if k.startswith(f'forward_backward {M}')):12} "
                     f"{run['bytes'].get(f'forward_backward {M}', 0):14} {run['bytes'].get(f'step {M}', 0):11}")
    return "\n".join(lines)


def test_launches_per_step_per_piece_grouped_padded_and_priced_at_dp8():
    (counts,) = run_ranks(launch_counts, 1, timeout=900)
    print("\n" + _table(counts))
    before, grouped, padded, priced = counts["per_piece"], counts["grouped"], counts["padded"], counts["priced"]
    for mode, run in counts.items():
        assert run["mode"] == mode and not run["overflow"], (mode, run["mode"])
    # Before: a broadcast per piece per fetch (forward and backward fetch every tensor once at least),
    # a reduce per item, and the step's one norm all-reduce.
    assert before["persistent"] == 0
    assert before["ops"][f"forward_backward {M}: reduce"] == before["n_items"]
    assert before["ops"][f"forward_backward {M}: broadcast"] >= before["n_pieces"]
    assert before["launches"][f"step {M}"] == 1 and before["ops"][f"step {M}: all_reduce"] == 1
    # After: the norms (DeepSpeed's 1e5-element threshold) stay resident and are never fetched.
    for run in (grouped, padded):
        assert run["persistent"] > 0 and run["persistent_resident_in_backward"] and not run["fetched_persistent"]
    assert grouped["ops"][f"forward_backward {M}: reduce"] == grouped["n_items"]  # the same reduces, in buckets
    assert padded["ops"][f"forward_backward {M}: reduce_scatter_tensor"] == padded["buckets"]
    fetches = padded["ops"][f"forward_backward {M}: all_gather_into_tensor"]  # one per module fetch
    assert grouped["launches"][f"forward_backward {M}"] == fetches + grouped["buckets"]
    assert padded["launches"][f"forward_backward {M}"] == fetches + padded["buckets"]
    # The step: the norm all-reduce and one refresh of every persistent parameter.
    assert grouped["launches"][f"step {M}"] == 2 and padded["launches"][f"step {M}"] == 2
    assert padded["ops"][f"step {M}: all_gather_into_tensor"] == 1
    # Counted together: at most half the per-piece launches (measured: 40 against 95). Each Linear here
    # is its own module, so a module fetch is one matrix: the saving is the persistent norms and the
    # buckets; with DeepSpeed's prefetch several modules come in one fetch, one launch.
    total = {mode: run["launches"][f"forward_backward {M}"] + run["launches"][f"step {M}"]
             for mode, run in counts.items()}
    assert 2 * total["grouped"] <= total["per_piece"], total
    assert total["padded"] == total["grouped"], total
    # The grouped launches move exactly the per-piece bytes less the persistent norms' fetches; the
    # padded ones pay for the padding (a module fetch of one matrix is padded to every rank).
    assert grouped["bytes"][f"forward_backward {M}"] < before["bytes"][f"forward_backward {M}"]
    assert padded["bytes"][f"forward_backward {M}"] > grouped["bytes"][f"forward_backward {M}"]
    # Priced (the default off gloo): the grouped launches, each ONE operation (a single piece's broadcast or
    # reduce, else an all-reduce or a padded collective), so the count does not grow with the pieces.
    for phase in (f"forward_backward {M}", f"step {M}"):
        operations = sum(n for key, n in priced["ops"].items() if key.startswith(f"{phase}: "))
        assert operations == priced["launches"][phase] == grouped["launches"][phase], (phase, priced["ops"])
    assert priced["persistent"] == grouped["persistent"] and not priced["fetched_persistent"]
    grouped_operations = sum(n for key, n in grouped["ops"].items() if key.startswith(f"forward_backward {M}: "))
    assert grouped_operations > priced["launches"][f"forward_backward {M}"]
