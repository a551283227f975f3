"""The GPU session's second phase: engine steps on one device, and Newton-Schulz kernel timings.

``run_engines``: ``deepspeed.initialize`` on a one-rank process group (NCCL on a GPU, gloo in the
dry run), ZeRO stages 1, 2 and 3 x Muon, Shampoo and SOAP, bf16, a Qwen3-0.6B-shaped model built
from its config (``ds_canzona/data/qwen3/qwen3-0.6b.json``; random weights, no download) on one
random token batch repeated every step, so a working optimizer makes the loss fall. Each step is
timed per phase (forward, backward, ``engine.step()``) with the accelerator synchronised between
phases. The first ``warmup`` steps are left out of the medians (Triton compiles, allocations,
Shampoo's first inverse roots; every step's times are kept too). One more step, after the timed
ones, counts the host synchronisations of each phase (``gpu.syncs``) outside those waits: the
dispatch-mode counter costs Python time per op, so it never runs in a timed step. A case fails
when it raises or its loss is not finite; each case is its own try/except. Cases left when the
time budget is spent
are listed as skipped, not run; the order (``CASE_ORDER``) puts every stage and every optimizer in
the first three, then the two variants that reach code only a GPU run exercises for real:
``offload`` (ZeRO-2 Muon with ``offload_optimizer`` on pinned host memory: the copy stream, its
events and the non-blocking copies) and ``reentrant`` (ZeRO-3 Muon under HuggingFace's reentrant
gradient checkpointing with one ``down_proj`` weight shared by every layer: it gets a gradient in
each layer's nested backward, summed as they come, across streams on a GPU). Every case sets ``canzona.comm_timeout_s``, which each group ds_canzona makes takes.

``time_newton_schulz``: Muon's ``orthogonalize`` at the model's matrix shapes, ``ns_method`` gram
(fp16) and standard (bf16) as Muon's CUDA defaults, with the kernels backend ``triton`` against
``torch``; medians of synchronised wall-clock runs after a warm-up, and the two results' errors
against a float64 run of the same iteration (a row fails when Triton's exceeds ``NS_BOUND`` for
its dtype, and on a GPU also when it is more than 1.5x torch's plus one unit roundoff).
"""

from __future__ import annotations

import gc
import json
import math
import os
import socket
import statistics
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from importlib import resources
from typing import Any

import torch

from .syncs import HOST_COUNTER_AVAILABLE, SyncCount

__all__ = ["EngineSettings", "model_config", "run_engines", "time_newton_schulz"]

FULL_LAYERS = 28  # ds_canzona/data/qwen3/qwen3-0.6b.json's num_hidden_layers
NS_K_TORCH = 1.5  # as validate.K_TORCH
NS_UNIT_ROUNDOFF = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
# The absolute bound on the orthogonalised matrix against float64, the one the CPU tests state for
# Muon's iteration in that dtype (tests/test_optim_muon.py's BF16_VS_EXACT; fp16: its roundoff
# 4.9e-4 amplified about 10x by the iteration, 4x margin). It is the verdict everywhere; the
# torch yardstick is judged on a GPU only (validate's docstring says why not on the CPU).
NS_BOUND = {torch.float16: 2e-2, torch.bfloat16: 8e-2}
STAGES = (1, 2, 3)
OPTIMIZERS = ("muon", "shampoo", "soap")
# A Latin square: the first three cases already cover every stage and every optimizer, so a time
# budget that runs out skips repeats, not a whole stage or optimizer.
_LATIN = tuple((STAGES[(i + k) % 3], OPTIMIZERS[i], "") for k in range(3) for i in range(3))
VARIANTS = {"offload": (2, "muon"), "reentrant": (3, "muon")}
CASE_ORDER = _LATIN[:3] + tuple((stage, optimizer, variant) for variant, (stage, optimizer) in VARIANTS.items()) \
    + _LATIN[3:]
COMM_TIMEOUT_S = 300.0  # a hung collective fails the case within the phase's limit, not at 10 minutes
PHASES = ("forward", "backward", "step")

# The dry run's model: the 0.6B config with every size cut down (2 layers, GQA kept).
_DRY_OVERRIDES = {"hidden_size": 64, "intermediate_size": 96, "num_attention_heads": 4, "num_key_value_heads": 2,
                  "head_dim": 16, "vocab_size": 320, "bos_token_id": 318, "eos_token_id": 319}


@dataclass(frozen=True, kw_only=True)
class EngineSettings:
    """What the engine phase runs; ``for_run(dry=...)`` gives the GPU and the dry-run defaults."""

    dry: bool
    layers: int
    micro_batch: int
    seq: int
    warmup: int
    steps: int
    budget_s: float

    @classmethod
    def for_run(cls, *, dry: bool, layers: int | None = None, budget_s: float | None = None) -> EngineSettings:
        if dry:
            return cls(dry=True, layers=layers or 2, micro_batch=2, seq=16, warmup=1, steps=1,
                       budget_s=budget_s or 120.0)
        return cls(dry=False, layers=layers or FULL_LAYERS, micro_batch=4, seq=512, warmup=2, steps=3,
                   budget_s=budget_s or 180.0)


def model_config(settings: EngineSettings) -> dict[str, Any]:
    """The Qwen3-0.6B config (tied embeddings, vocab 151936), cut down for the dry run, ``layers`` deep."""
    text = resources.files("ds_canzona").joinpath("data/qwen3/qwen3-0.6b.json").read_text(encoding="utf-8")
    config = json.loads(text)
    for key in ("architectures", "torch_dtype", "transformers_version"):
        config.pop(key, None)
    config.update(num_hidden_layers=settings.layers, max_window_layers=settings.layers, use_cache=False)
    if settings.dry:
        config.update(_DRY_OVERRIDES)
    return config


def _optimizer_section(optimizer: str) -> dict[str, Any]:
    # Shampoo: the first inverse roots (eigh) at step 2, inside the warm-up, and none after it, so
    # the timed steps are steady ones. SOAP: sides up to 1024 get a basis (the model's 2048/3072
    # sides stay unrotated), which keeps its first step's eigendecompositions to seconds.
    if optimizer == "muon":
        return {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-3, "momentum": 0.95, "ns_method": "gram"}}
    if optimizer == "shampoo":
        return {"type": "Shampoo", "params": {"lr": 3e-3, "adam_lr": 3e-3, "start_preconditioning_step": 2,
                                              "precondition_frequency": 1000, "max_preconditioner_dim": 1024}}
    return {"type": "SOAP", "params": {"lr": 3e-3, "adam_lr": 3e-3, "max_precond_dim": 1024,
                                       "precondition_frequency": 10}}


def ds_config(stage: int, optimizer: str, settings: EngineSettings, variant: str = "") -> dict[str, Any]:
    """A DeepSpeed config with the ``canzona`` section (what ``import ds_canzona`` acts on)."""
    config = {
        "train_micro_batch_size_per_gpu": settings.micro_batch,
        "gradient_accumulation_steps": 1,
        "gradient_clipping": 1.0,
        "steps_per_print": 10**9,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": stage, "reduce_bucket_size": 50_000_000, "allgather_bucket_size": 50_000_000,
                              "overlap_comm": False, "contiguous_gradients": True},
        "optimizer": _optimizer_section(optimizer),
        "canzona": {"enabled": True, "kernels": "default", "log_plan": False, "comm_timeout_s": COMM_TIMEOUT_S},
    }
    if variant == "offload":
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    elif variant not in ("", "reentrant"):
        raise ValueError(f"unknown engine case variant {variant!r} (one of {', '.join(VARIANTS)})")
    return config


def init_one_rank(dist_backend: str) -> int:
    """A one-rank process group, with the environment DeepSpeed's launcher would set; its port."""
    import deepspeed

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    deepspeed.init_distributed(dist_backend=dist_backend, verbose=False)
    return port


def close_one_rank(port: int) -> None:
    """Tear the group down (gloo's threads left to interpreter exit can abort it) and, on the CPU,
    remove the shared-memory buffer DeepSpeed's CPU accelerator maps per rank and never unlinks."""
    import deepspeed.comm as dist
    from deepspeed.accelerator import get_accelerator

    from ..standins._ranks import remove_shm_buffers

    if dist.is_initialized():
        dist.destroy_process_group()
    if get_accelerator().device_name() == "cpu":
        remove_shm_buffers("127.0.0.1", port, 1)


def _build_model(settings: EngineSettings, device: torch.device):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(**model_config(settings))
    config._attn_implementation = "sdpa"
    with device:  # initialised where it trains: a 0.6B model's init is seconds on the CPU
        return Qwen3ForCausalLM(config)


def _train_step(engine, tokens: torch.Tensor, synchronize: Callable[[], None], *, count_syncs: bool,
                on_cuda: bool) -> dict[str, Any]:
    """One training step, each phase timed between synchronisations, or each phase's host syncs counted."""
    record: dict[str, Any] = {"syncs": {}, "sites": {}} if count_syncs else {}
    synchronize()
    holder: dict[str, Any] = {}
    actions = {
        "forward": lambda: holder.update(loss=engine(input_ids=tokens, labels=tokens).loss),
        "backward": lambda: engine.backward(holder["loss"]),
        "step": engine.step,
    }
    for phase in PHASES:
        started = time.perf_counter()
        if count_syncs:
            with SyncCount(cuda=on_cuda) as count:
                actions[phase]()
            record["syncs"][phase] = {"host": count.host, "cuda": count.cuda}
            record["sites"][phase] = dict(count.sites)
        else:
            actions[phase]()
        synchronize()
        record[f"{phase}_s"] = time.perf_counter() - started
    record["loss"] = float(holder["loss"].detach().float())
    return record


def run_engine_case(stage: int, optimizer: str, settings: EngineSettings, variant: str = "") -> dict[str, Any]:
    """Build one engine, train it ``warmup + steps`` steps and one counted step; the summary row."""
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    import ds_canzona  # noqa: F401  (registers the engine hook that reads the canzona section)

    accelerator = get_accelerator()
    device = torch.device(accelerator.current_device_name())
    on_cuda = device.type == "cuda"
    started = time.perf_counter()
    model = _build_model(settings, device)
    if variant == "reentrant":
        # One down_proj weight shared by every layer: under reentrant checkpointing each layer's
        # nested backward gives it a gradient, so it arrives once per layer (the tied embedding
        # does not: it is used outside the checkpointed segments).
        shared = model.model.layers[0].mlp.down_proj.weight
        for layer in model.model.layers[1:]:
            layer.mlp.down_proj.weight = shared
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    engine = None
    try:
        engine, *_ = deepspeed.initialize(model=model, config=ds_config(stage, optimizer, settings, variant))
        build_s = time.perf_counter() - started
        vocab = model.config.vocab_size
        tokens = torch.randint(0, vocab, (settings.micro_batch, settings.seq),
                               generator=torch.Generator().manual_seed(stage * 10 + len(optimizer))).to(device)
        if on_cuda:
            accelerator.reset_peak_memory_stats()
        records = [_train_step(engine, tokens, accelerator.synchronize, count_syncs=False, on_cuda=on_cuda)
                   for _ in range(settings.warmup + settings.steps)]
        records.append(_train_step(engine, tokens, accelerator.synchronize, count_syncs=True, on_cuda=on_cuda))
        peak = accelerator.max_memory_allocated() if on_cuda else None
        # ZeRO-3's runtime stops reducing a tensor on its first gradient once one has arrived twice
        # in a backward (reentrant checkpointing): the sign that the two-gradient path ran.
        # (Stages 1 and 2 use the flag for more: it is not read there.)
        early = getattr(engine.optimizer, "early_launch", None) if stage == 3 else None
    finally:  # also after a failure: the next case needs the memory
        if engine is not None and hasattr(engine, "destroy"):
            engine.destroy()
        del engine, model
        gc.collect()
        if on_cuda:
            accelerator.empty_cache()
    row = _summarise(stage, optimizer, settings, records, build_s, peak, variant)
    row["gradient_arrived_twice"] = None if early is None else not early
    return row


def _summarise(stage: int, optimizer: str, settings: EngineSettings, records: list[dict[str, Any]], build_s: float,
               peak_bytes: int | None, variant: str = "") -> dict[str, Any]:
    timed, counted = records[settings.warmup:-1], records[-1]
    losses = [r["loss"] for r in records]
    row: dict[str, Any] = {"stage": stage, "optimizer": optimizer, "variant": variant, "build_s": build_s,
                           "losses": losses, "peak_memory_gib": None if peak_bytes is None else peak_bytes / 2**30}
    for phase in PHASES:
        row[f"{phase}_ms"] = statistics.median(r[f"{phase}_s"] for r in timed) * 1e3
        # Every step's: the warm-up (compilation, Shampoo's first inverse roots), the timed ones and
        # last the counted one (slowed by the counting).
        row[f"{phase}_ms_each"] = [r[f"{phase}_s"] * 1e3 for r in records]
    for counter in ("host", "cuda"):  # None: that counter is not available here
        by_phase = {p: counted["syncs"][p][counter] for p in PHASES}
        counted_here = None not in by_phase.values()
        row[f"{counter}_syncs_per_step"] = sum(by_phase.values()) if counted_here else None
        row[f"{counter}_syncs_by_phase"] = by_phase if counted_here else None
    row["sync_sites"] = counted["sites"]
    row["loss_finite"] = all(math.isfinite(v) for v in losses)
    row["loss_fell"] = bool(row["loss_finite"] and losses[-1] < losses[0])
    row["passed"] = row["loss_finite"]
    row["reason"] = "" if row["loss_finite"] else f"loss not finite: {losses}"
    return row


def run_engines(settings: EngineSettings, *, dist_backend: str, cases: list[tuple[int, str, str]] | None = None,
                report: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Every (stage, optimizer) case in turn, each in its own try/except, within ``settings.budget_s``."""
    from transformers import Qwen3ForCausalLM  # noqa: F401  (imported before the first build is timed)

    port = init_one_rank(dist_backend)
    if not HOST_COUNTER_AVAILABLE:
        print("host-sync counter not available (ds_canzona.bench.standins.host_syncs): host syncs counted by CUDA only",
              flush=True)
    deadline = time.monotonic() + settings.budget_s
    rows = []
    try:
        for stage, optimizer, variant in cases or CASE_ORDER:
            if time.monotonic() > deadline:
                row = {"stage": stage, "optimizer": optimizer, "variant": variant, "skipped": True, "passed": True,
                       "reason": f"not run: the engine phase's budget of {settings.budget_s:.0f} s is spent"}
            else:
                try:
                    row = run_engine_case(stage, optimizer, settings, variant)
                except Exception as error:  # recorded, and the next case runs
                    row = {"stage": stage, "optimizer": optimizer, "variant": variant, "passed": False,
                           "reason": f"{type(error).__name__}: {' '.join(str(error).split())[:500]}",
                           "traceback": traceback.format_exc().strip().splitlines()[-8:]}
            rows.append(row)
            if report is not None:
                report(row)
    finally:
        close_one_rank(port)
    return rows


def format_engine_row(row: dict[str, Any]) -> str:
    head = f"ZeRO-{row['stage']} {row['optimizer']:<8} {row.get('variant') or '':<9}"
    if row.get("skipped"):
        return f"SKIP {head} {row['reason']}"
    if "forward_ms" not in row:
        return f"FAIL {head} {row['reason']}"
    syncs = " ".join(f"{c} {row[f'{c}_syncs_per_step']}" for c in ("host", "cuda")
                     if row[f"{c}_syncs_per_step"] is not None) or "not counted"
    losses = " -> ".join(f"{v:.3f}" for v in (row["losses"][0], row["losses"][-1]))
    verdict = "ok  " if row["passed"] else "FAIL"
    text = (f"{verdict} {head} fwd {row['forward_ms']:8.1f} ms  bwd {row['backward_ms']:8.1f} ms  "
            f"step {row['step_ms']:8.1f} ms  syncs/step: {syncs}  loss {losses}"
            f"{' (fell)' if row['loss_fell'] else ' (did not fall)'}  build {row['build_s']:.1f} s")
    if row["peak_memory_gib"] is not None:
        text += f"  peak {row['peak_memory_gib']:.1f} GiB"
    return text


# --------------------------------------------------------------------------- Newton-Schulz timings


def matrix_shapes(settings: EngineSettings) -> list[tuple[str, int, int]]:
    """(name, rows, cols) of the model's distinct Muon matrices (q/k/v/o, gate/up, down); in the
    dry run only the first wide and the first tall one (the interpreter takes seconds per run)."""
    c = model_config(settings)
    hidden, heads, kv, head_dim, inter = (c["hidden_size"], c["num_attention_heads"], c["num_key_value_heads"],
                                          c["head_dim"], c["intermediate_size"])
    shapes = [("q_proj", heads * head_dim, hidden), ("k_proj/v_proj", kv * head_dim, hidden),
              ("o_proj", hidden, heads * head_dim), ("gate_proj/up_proj", inter, hidden), ("down_proj", hidden, inter)]
    seen, out = set(), []
    for name, rows, cols in shapes:
        if (rows, cols) not in seen:
            seen.add((rows, cols))
            out.append((name, rows, cols))
    if settings.dry:
        out = [next(s for s in out if s[1] < s[2]), next(s for s in out if s[1] > s[2])]
    return out


def time_newton_schulz(settings: EngineSettings, *, device: str, repeats: int,
                       report: Callable[[dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
    """Muon's orthogonalize with the Triton kernels and with torch, per shape and method."""
    import ds_canzona.kernels as K
    from ds_canzona.optim.newton_schulz import orthogonalize

    on_cuda = device.startswith("cuda")

    def synchronize() -> None:
        if on_cuda:  # no DeepSpeed needed for this phase: torch's own wait
            torch.cuda.synchronize()

    def median_ms(fn: Callable[[], torch.Tensor]) -> tuple[float, torch.Tensor]:
        """The median over ``repeats`` timed runs after one warm-up (compilation, allocation), and the last result."""
        fn()
        synchronize()
        samples = []
        for _ in range(repeats):
            started = time.perf_counter()
            out = fn()
            synchronize()
            samples.append((time.perf_counter() - started) * 1e3)
        return statistics.median(samples), out

    rows = []
    previous = K.get_backend()
    generator = torch.Generator().manual_seed(0)
    try:
        for name, m, n in matrix_shapes(settings):
            g = torch.randn(m, n, generator=generator).to(device)
            for method, dtype in (("gram", torch.float16), ("standard", torch.bfloat16)):
                row: dict[str, Any] = {"matrix": name, "m": m, "n": n, "method": method, "dtype": str(dtype)[6:]}
                try:
                    K.set_backend("torch")  # float64: the reference, whatever the last row left selected
                    exact = orthogonalize(g.double(), method=method, dtype=torch.float64)
                    for backend in ("triton", "torch"):
                        K.set_backend(backend)
                        row[f"{backend}_ms"], out = median_ms(lambda: orthogonalize(g, method=method, dtype=dtype))
                        row[f"{backend}_err"] = float((out.double() - exact).norm() / exact.norm())
                    row["speedup"] = row["torch_ms"] / row["triton_ms"]
                    # Both run the same iteration in the same dtype; the kernels only round
                    # differently (the fused step less), so no worse than torch beyond the yardstick's
                    # factor, plus one unit roundoff of the dtype for five steps' worth of reordering.
                    problems = []
                    if not row["triton_err"] <= NS_BOUND[dtype]:
                        problems.append(f"triton's error {row['triton_err']:.3g} > the bound {NS_BOUND[dtype]:g}")
                    limit = NS_K_TORCH * row["torch_err"] + NS_UNIT_ROUNDOFF[dtype]
                    if device != "cpu" and not row["triton_err"] <= limit:
                        problems.append(f"triton's error {row['triton_err']:.3g} > {NS_K_TORCH:g} x torch's "
                                        f"{row['torch_err']:.3g} + u")
                    row["passed"] = not problems
                    if problems:
                        row["reason"] = "; ".join(problems)
                except Exception as error:  # recorded, and the next shape runs
                    row.update(passed=False, reason=f"{type(error).__name__}: {' '.join(str(error).split())[:500]}")
                rows.append(row)
                if report is not None:
                    report(row)
    finally:
        K.set_backend(previous)
    return rows


def format_ns_row(row: dict[str, Any]) -> str:
    head = f"{row['matrix']:<18} {row['m']:>5} x {row['n']:<5} {row['method']:<8} {row['dtype']:<8}"
    if "speedup" not in row:  # it raised
        return f"FAIL {head} {row['reason']}"
    verdict = "ok  " if row["passed"] else "MISS"
    return (f"{verdict} {head} triton {row['triton_ms']:9.3f} ms  torch {row['torch_ms']:9.3f} ms  "
            f"x{row['speedup']:5.2f}  err vs fp64: triton {row['triton_err']:.2e} torch {row['torch_err']:.2e}")

