"""``bench step-offload``: optimizer offload, ds_canzona against DeepSpeed 0.19.8's offloaded Muon.

Both systems train the same small decoder-shaped model (fp32, ZeRO stage 2) on gloo ranks with
``offload_optimizer: {"device": "cpu"}``; per DP size the rows give the iteration time (median of
the timed steps, slowest rank), Newton-Schulz runs per rank per step (ds_canzona: the matrices the
rank owns; DeepSpeed: every matrix on every rank), bytes copied host<->device per rank per step
(ds_canzona's ``OptimizerOffload.counter``; DeepSpeed's copies are not instrumented, "n/c") and host
memory per rank (ds_canzona: the owned masters and state; both: the process's peak RSS).

DeepSpeed's offload builds ``DeepSpeedCPUAdam``: where its ``cpu_adam`` op does not load, its rows
say so and only ds_canzona's run. On the CPU accelerator "device" and host are the same memory:
the bytes are what a GPU would move, the times are not a GPU's.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import time
from collections.abc import Sequence
from typing import Any

from ds_canzona.cli import Command

WARMUP, STEPS = 2, 5
DIM, LAYERS, VOCAB, SEQ, MICRO_BATCH = 128, 4, 512, 64, 2


def _model():
    import torch
    from torch import nn

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(VOCAB, DIM)
            self.layers = nn.ModuleList(nn.Sequential(nn.LayerNorm(DIM), nn.Linear(DIM, 4 * DIM), nn.GELU(),
                                                      nn.Linear(4 * DIM, DIM)) for _ in range(LAYERS))
            self.lm_head = nn.Linear(DIM, VOCAB, bias=False)

        def forward(self, tokens):
            x = self.embed_tokens(tokens[:, :-1])
            for layer in self.layers:
                x = x + layer(x)
            logits = self.lm_head(x)
            return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1))

    torch.manual_seed(0)
    return Decoder()


def _config(world_size: int, canzona: bool) -> dict[str, Any]:
    config = {
        "train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_accumulation_steps": 1,
        "train_batch_size": MICRO_BATCH * world_size, "gradient_clipping": 1.0, "steps_per_print": 10**6,
        "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu", "pin_memory": True}},
        "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 3e-4, "ns_method": "gram"}},
    }
    if canzona:
        config["canzona"] = {"log_plan": False}
    return config


def _rank_main(rank: int, world_size: int, systems: list[str]) -> list[dict[str, Any]]:
    import torch

    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    from ds_canzona.bench._instrument import NewtonSchulzMeter

    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    ns = NewtonSchulzMeter().install()
    rows = []
    for system in systems:
        engine, *_ = deepspeed.initialize(model=_model(), config=_config(world_size, system == "ds_canzona"))
        times, ns_runs, moved = [], [], []
        generator = torch.Generator().manual_seed(rank)
        for step in range(WARMUP + STEPS):
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
            deepspeed.comm.barrier()
            ns.runs = 0
            start = time.perf_counter()
            engine.backward(engine(tokens))
            engine.step()
            elapsed = time.perf_counter() - start
            if step >= WARMUP:
                times.append(elapsed)
                ns_runs.append(ns.runs)
                offload = getattr(engine.optimizer, "offload", None)
                if offload is not None:
                    moved.append(offload.counter.step_bytes)
        offload = getattr(engine.optimizer, "offload", None)
        rows.append({"system": system, "time_s": statistics.median(times), "ns_runs": max(ns_runs),
                     "bytes": max(moved) if moved else None,
                     "host_state_bytes": offload.host_bytes if offload is not None else None,
                     "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024})
        engine.destroy()
    return rows


def _deepspeed_offload_loads() -> str | None:
    """None where DeepSpeed's cpu_adam op loads; otherwise why not."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # the builder raises whatever its compiler raised
        return f"{type(error).__name__}: {error}"
    return None


def run(args: argparse.Namespace) -> int:
    from ds_canzona.bench._ranks import run_ranks

    systems = ["ds_canzona"]
    why_not = None if args.no_deepspeed else _deepspeed_offload_loads()
    if not args.no_deepspeed and why_not is None:
        systems.append("deepspeed")
    print(f"bench step-offload: ZeRO-2, fp32, offload_optimizer cpu; {LAYERS} layers of {DIM}x{4 * DIM}, "
          f"vocab {VOCAB}; median of {STEPS} steps after {WARMUP}, slowest rank")
    if why_not is not None:
        print(f"DeepSpeed's offloaded Muon not run: its cpu_adam op does not load ({why_not[:200]})")
    print("| DP | system | iteration s | NS runs / rank / step | bytes host<->device / rank / step | "
          "host state bytes / rank | peak RSS MB / rank |")
    print("|---|---|---|---|---|---|---|")
    for dp in args.dp:
        per_rank = run_ranks(_rank_main, dp, systems, timeout=1800)
        for k, system in enumerate(systems):
            rows = [ranks[k] for ranks in per_rank]
            moved = [r["bytes"] for r in rows if r["bytes"] is not None]
            host = [r["host_state_bytes"] for r in rows if r["host_state_bytes"] is not None]
            print(f"| {dp} | {system} | {max(r['time_s'] for r in rows):.4f} | {max(r['ns_runs'] for r in rows)} | "
                  f"{max(moved) if moved else 'n/c'} | {max(host) if host else 'n/c'} | "
                  f"{max(r['peak_rss_mb'] for r in rows):.0f} |")
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 3, 4], help="data-parallel sizes (default 2 3 4)")
    parser.add_argument("--no-deepspeed", action="store_true", help="run ds_canzona only")


STEP_OFFLOAD = Command(description="Optimizer offload on gloo ranks: ds_canzona vs DeepSpeed's offloaded Muon",
                       add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_canzona.bench step-offload")
    add_arguments(parser)
    return run(parser.parse_args(argv))
