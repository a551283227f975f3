"""``bench step-offload``: optimizer offload, ds_canzona against DeepSpeed 0.19.8's offloaded Muon.

Both systems train the same small decoder-shaped model (fp32, ZeRO stage 2) on gloo ranks with
``offload_optimizer: {"device": "cpu"}``; per DP size the rows give the iteration time (median of
the timed steps, slowest rank), Newton-Schulz runs per rank per step (ds_canzona: the matrices the
rank owns; DeepSpeed: every matrix on every rank), bytes copied host<->device per rank per step
and host memory per rank (the fp32 masters and optimizer state; and the process's peak RSS).

The bytes: ds_canzona's from its offload's own counter (``OptimizerOffload.counter``: every
master and state staged to the device and back, every non-matrix gradient to the host and its new
parameter values back), the largest over the timed steps. DeepSpeed's from one more step after
the timed ones, run under ``offload_bytes.HostDeviceCopyMeter`` (every ``copy_`` between the
memory DeepSpeed keeps on the host and anything else), and cross-checked against the count read
from its code (``offload_bytes.deepspeed_zero2_step_bytes``); the JSON says whether they agree.
One-element copies (norms, flags) are not counted on either side. DeepSpeed's host memory
also holds its fp32 gradient partition and a bit16 staging copy of the partition, reported apart.

DeepSpeed's offload builds ``DeepSpeedCPUAdam``: where its ``cpu_adam`` op does not load, its rows
say so and only ds_canzona's run. On the CPU accelerator "device" and host are the same memory:
the bytes are what a GPU would move, the times are not a GPU's.
"""

from __future__ import annotations

import argparse
import json
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
    from ds_canzona.bench.standins._instrument import NewtonSchulzMeter
    from ds_canzona.bench.standins.offload_bytes import (HostDeviceCopyMeter, deepspeed_host_storages,
                                                         deepspeed_zero2_step_bytes)

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
        row = {"system": system, "time_s": statistics.median(times), "ns_runs": max(ns_runs)}
        if offload is not None:
            row.update(bytes=max(moved), to_device=offload.counter.to_device, to_host=offload.counter.to_host,
                       host_state_bytes=offload.host_bytes)
        else:
            # One more step, metered (a Python hook on every op: not timed).
            zero = engine.optimizer
            expected = deepspeed_zero2_step_bytes(zero, momentum_exists=True)
            meter = HostDeviceCopyMeter(lambda: deepspeed_host_storages(zero))
            tokens = torch.randint(0, VOCAB, (MICRO_BATCH, SEQ + 1), generator=generator)
            with meter:
                engine.backward(engine(tokens))
                engine.step()
            row.update(bytes=meter.count.total, to_device=meter.count.to_device, to_host=meter.count.to_host,
                       bytes_from_code=expected.total, bytes_agree=expected == meter.count,
                       **_deepspeed_host_bytes(zero))
        row["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        rows.append(row)
        engine.destroy()
    return rows


def _deepspeed_host_bytes(zero) -> dict[str, int]:
    """DeepSpeed's host memory on this rank: fp32 partition and optimizer state; its gradient and bit16 buffers."""
    import torch

    def nbytes(tensors) -> int:
        return sum(t.numel() * t.element_size() for t in tensors)

    masters = zero.single_partition_of_fp32_groups
    state = [v for s in zero.optimizer.state.values() for v in s.values() if torch.is_tensor(v) and v.numel() > 1]
    buffers = [m.grad for m in masters if m.grad is not None] + list(zero.param_buffer_of_bit16_for_cpu_offload_groups)
    return {"host_state_bytes": nbytes(masters) + nbytes(state), "host_buffer_bytes": nbytes(buffers)}


def _deepspeed_offload_loads() -> str | None:
    """None where DeepSpeed's cpu_adam op loads; otherwise why not."""
    try:
        from deepspeed.ops.op_builder import CPUAdamBuilder
        CPUAdamBuilder().load(verbose=False)
    except Exception as error:  # the builder raises whatever its compiler raised
        return f"{type(error).__name__}: {error}"
    return None


def run(args: argparse.Namespace) -> int:
    from ds_canzona.bench.standins._ranks import run_ranks

    systems = ["ds_canzona"]
    why_not = None if args.no_deepspeed else _deepspeed_offload_loads()
    if not args.no_deepspeed and why_not is None:
        systems.append("deepspeed")
    print(f"bench step-offload: ZeRO-2, fp32, offload_optimizer cpu; {LAYERS} layers of {DIM}x{4 * DIM}, "
          f"vocab {VOCAB}; median of {STEPS} steps after {WARMUP}, slowest rank")
    if why_not is not None:
        print(f"DeepSpeed's offloaded Muon not run: its cpu_adam op does not load ({why_not[:200]})")
    print("| DP | system | iteration s | NS runs / rank / step | bytes host<->device / rank / step "
          "(to device + to host) | host master+state bytes / rank | peak RSS MB / rank |")
    print("|---|---|---|---|---|---|---|")
    results = []
    for dp in args.dp:
        per_rank = run_ranks(_rank_main, dp, systems, timeout=1800)
        for k, system in enumerate(systems):
            rows = [ranks[k] for ranks in per_rank]
            busiest = max(rows, key=lambda r: r["bytes"])
            summary = {"dp": dp, "system": system, "time_s": max(r["time_s"] for r in rows),
                       "ns_runs": max(r["ns_runs"] for r in rows), "bytes": busiest["bytes"],
                       "to_device": busiest["to_device"], "to_host": busiest["to_host"],
                       "host_state_bytes": max(r["host_state_bytes"] for r in rows),
                       "peak_rss_mb": max(r["peak_rss_mb"] for r in rows), "ranks": rows}
            if system == "deepspeed":
                summary["bytes_agree"] = all(r["bytes_agree"] for r in rows)
            results.append(summary)
            print(f"| {dp} | {system} | {summary['time_s']:.4f} | {summary['ns_runs']} | {summary['bytes']:,} "
                  f"({summary['to_device']:,} + {summary['to_host']:,}) | {summary['host_state_bytes']:,} | "
                  f"{summary['peak_rss_mb']:.0f} |")
    disagree = [r["dp"] for r in results if r.get("bytes_agree") is False]
    if disagree:
        print(f"DeepSpeed's metered bytes differ from the count read from its code at DP {disagree} (see the JSON)")
    if args.json:
        setting = {"stage": 2, "dtype": "fp32", "layers": LAYERS, "dim": DIM, "vocab": VOCAB, "seq": SEQ,
                   "micro_batch": MICRO_BATCH, "warmup": WARMUP, "steps": STEPS,
                   "deepspeed_not_run": why_not if "deepspeed" not in systems else None}
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({**setting, "rows": results}, handle, indent=1)
    return 0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 3, 4], help="data-parallel sizes (default 2 3 4)")
    parser.add_argument("--no-deepspeed", action="store_true", help="run ds_canzona only")
    parser.add_argument("--json", metavar="FILE", help="also write every number (per rank too) as JSON")


STEP_OFFLOAD = Command(description="Optimizer offload on gloo ranks: ds_canzona vs DeepSpeed's offloaded Muon",
                       add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ds_canzona.bench step-offload")
    add_arguments(parser)
    return run(parser.parse_args(argv))
