"""``python -m ds_canzona.bench tp-step``: training steps under DeepSpeed AutoTP, three ways.

On ``--tp`` x ``--dp`` gloo ranks of this machine, a transformers Qwen3 (random weights, no
download) trains with ZeRO-1 along DP and AutoTP along TP, the systems taking turns on the same
ranks:

- ``micro-groups``: ds_canzona (``ds_canzona.zero.tp``): each sharded matrix gathered to one host
  of its TP group, micro-group by micro-group, the exchange of one behind the update of another;
- ``synchronous``: every TP rank gathers every sharded matrix (one all-gather each) and computes
  every update itself, keeping its slice (full state on every rank): the scheme micro-groups
  replace, the same numbers at T times the compute;
- ``deepspeed``: DeepSpeed 0.19.8's own ZeRO-1 Muon under AutoTP, which orthogonalises each slice
  on its own (a different, wrong update; shown for its speed only). Newton-Schulz in fp32 for all.

Printed per system: median seconds per iteration (forward, backward and step: DeepSpeed's Muon
orthogonalises inside the gradient reduction, in backward), the bytes this rank sent to other
ranks in the optimizer step's TP exchange (all-to-all or all-gather; ``deepspeed``: none) and, for micro-groups, the
overlap: the fraction of the exchange's standalone time (the same collectives run alone) that
the pipelined step does not spend blocked in ``wait()``. On gloo an asynchronous collective runs
on a background thread, so the CPUs are shared between communication and compute; on NCCL the
overlap would need device-side timing (not measured here: no GPU).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

from ...cli import Command, OneLineParser

SYSTEMS = ("micro-groups", "synchronous", "deepspeed")
MODEL = dict(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=4, head_dim=32, tie_word_embeddings=False, use_cache=False,
             attn_implementation="eager", max_position_embeddings=256)
MICRO_BATCH, SEQ = 2, 64


def _model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**MODEL)).train()


def _batch(step: int, dp_rank: int):
    import torch

    g = torch.Generator().manual_seed(1000 * step + dp_rank)
    return torch.randint(0, MODEL["vocab_size"], (MICRO_BATCH, SEQ + 1), generator=g)


def _config(system: str, tp: int, micro_group_bytes: int) -> dict:
    config = {"train_micro_batch_size_per_gpu": MICRO_BATCH, "gradient_clipping": 1.0, "steps_per_print": 10**9,
              "zero_optimization": {"stage": 1}, "tensor_parallel": {"autotp_size": tp},
              "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003}}}
    if system != "deepspeed":
        config["canzona"] = {"log_plan": False, "tp_micro_group_bytes": micro_group_bytes}
    return config


def _rank(rank: int, world_size: int, tp: int, steps: int, warmup: int, micro_group_bytes: int) -> dict:
    import torch
    import torch.nn.functional as F

    import deepspeed
    import ds_canzona  # noqa: F401  (the engine hook)
    import ds_canzona.zero.tp as tp_runtime
    from ds_canzona.bench.standins._instrument import force_deepspeed_ns_dtype

    force_deepspeed_ns_dtype(torch.float32)
    dp_rank = rank // tp
    results = {}
    micro_groups_class = tp_runtime.CanzonaTPZeroOptimizer
    synchronous_class = _synchronous_class()
    for system in SYSTEMS:
        # build.py looks the TP runtime up at deepspeed.initialize: the synchronous scheme stands in once.
        tp_runtime.CanzonaTPZeroOptimizer = synchronous_class if system == "synchronous" else micro_groups_class
        try:
            model = _model()
            engine, *_ = deepspeed.initialize(model=model, config=_config(system, tp, micro_group_bytes),
                                              model_parameters=model.parameters())
        finally:
            tp_runtime.CanzonaTPZeroOptimizer = micro_groups_class
        zero = engine.optimizer
        times, wait = [], 0.0
        for step in range(warmup + steps):
            if step == warmup and hasattr(zero, "comm"):
                zero.comm.reset()
                if hasattr(zero, "exchange"):
                    zero.exchange.wait_seconds = 0.0
            # A whole iteration: DeepSpeed's ZeRO-1/2 Muon orthogonalises while it reduces the
            # gradients (in backward), so timing engine.step alone would leave its Newton-Schulz out.
            torch.distributed.barrier()
            start = time.perf_counter()
            batch = _batch(step, dp_rank)
            logits = engine(input_ids=batch[:, :-1]).logits
            loss = F.cross_entropy(logits.reshape(-1, MODEL["vocab_size"]).float(), batch[:, 1:].reshape(-1))
            engine.backward(loss)
            engine.step()
            elapsed = time.perf_counter() - start
            if step >= warmup:
                times.append(elapsed)
        row = {"step_s": statistics.median(times), "exchange_bytes": 0, "overlap": None}
        if hasattr(zero, "comm"):
            counted = zero.comm.bytes
            row["exchange_bytes"] = (counted.get("tp_exchange_sent", 0) + counted.get("tp_all_gather", 0)) // steps
        if system == "micro-groups":
            wait = zero.exchange.wait_seconds / steps
            alone = _exchange_alone(zero, steps)
            row["overlap"] = max(0.0, 1.0 - wait / alone) if alone > 0 else None
            row["micro_groups"] = len(zero.exchange.groups)
        results[system] = row
        del engine, zero
    return results


def _exchange_alone(zero, repeats: int) -> float:
    """Seconds per step of the micro-group exchange with nothing to compute (the same collectives, alone)."""
    import torch

    slices = {j: zero.item_view(j).detach().float() for j in zero._tp_items}
    exchange = zero.exchange
    times = []
    for _ in range(repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        exchange.run(slices, lambda full: full, lambda item, values: None)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def _synchronous_class():
    """The synchronous scheme as a subclass of the micro-group runtime (built lazily: it imports torch)."""
    import torch

    import deepspeed.comm as dist

    from ds_canzona.optim import rule_for_group
    from ds_canzona.zero.owned import OwnedTensor
    from ds_canzona.zero.stage12 import CanzonaZeroOptimizer
    from ds_canzona.zero.tp import CanzonaTPZeroOptimizer

    class Synchronous(CanzonaTPZeroOptimizer):
        """Every TP rank gathers every sharded matrix its DP rank owns and updates it whole itself."""

        def _build_owned_state(self):
            owned = super()._build_owned_state()
            self._everywhere = {}
            for j in self._tp_items:
                master = self._gather_whole(j, self.item_view(j).detach().float())
                group = self.groups[self.plan.pieces[j][0]]
                self._everywhere[j] = OwnedTensor(index=j, name=self.plan.specs[j].name, master=master,
                                                  state=rule_for_group(group).init_state(master), group=group,
                                                  tensor=self.plan.pieces[j][0])
            return owned

        def _gather_whole(self, item: int, local: torch.Tensor) -> torch.Tensor:
            split = self.splits[self.plan.pieces[item][0]]
            width = max(split.local_numel(r) for r in range(self.tp_size))
            mine = torch.zeros(width, dtype=torch.float32, device=self.device)
            mine[:local.numel()] = local.reshape(-1)
            rows = [torch.empty_like(mine) for _ in range(self.tp_size)]
            self.comm.bytes["tp_all_gather"] += (self.tp_size - 1) * mine.numel() * mine.element_size()  # sent on
            dist.all_gather(rows, mine, group=self.tp_group)
            whole = torch.empty(split.logical_shape, dtype=torch.float32, device=self.device)
            for rank, row in enumerate(rows):
                split.slice_of(whole, rank).copy_(row[:split.local_numel(rank)].view(split.local_shape(rank)))
            return whole

        def _update_owned(self, grads):
            local = len(self._owned)
            CanzonaZeroOptimizer._update_owned(self, grads[:local])  # the items that are not TP-sharded matrices
            full = {j: self._gather_whole(j, g) for j, g in zip(self._tp_items, grads[local:])}
            for group in self.optimizer.param_groups:
                members = [self._everywhere[j] for j in self._tp_items if self._everywhere[j].group is group]
                if members:
                    rule_for_group(group).update_([t.master for t in members], [full[t.index] for t in members],
                                                  [t.state for t in members], lr=group["lr"], known_finite=True)
            for j in self._tp_items:
                split = self.splits[self.plan.pieces[j][0]]
                self._write_slice(j, split.slice_of(self._everywhere[j].master, self.tp_rank))

    return Synchronous


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tp", type=int, default=2, help="AutoTP size (default 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel size (default 1)")
    parser.add_argument("--steps", type=int, default=6, help="timed steps per system (default 6)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    parser.add_argument("--micro-group-mb", type=float, default=1.0,
                        help="canzona.tp_micro_group_bytes in MiB (default 1: several micro-groups on this model)")


def run(args: argparse.Namespace) -> int:
    from ..standins._ranks import run_ranks

    world = args.tp * args.dp
    results = run_ranks(_rank, world, args.tp, args.steps, args.warmup, int(args.micro_group_mb * 2**20),
                        timeout=3600)
    print(f"AutoTP TP={args.tp} x DP={args.dp}, ZeRO-1, Qwen3 {MODEL['num_hidden_layers']} layers x "
          f"{MODEL['hidden_size']}, micro-batch {MICRO_BATCH} x {SEQ}, seconds per iteration (forward, backward, "
          f"step), median of {args.steps}, slowest rank")
    print("| system | s / iteration | TP exchange bytes sent to other ranks per step (max) | overlap (rank 0) |")
    print("|---|---:|---:|---:|")
    for system in SYSTEMS:
        step = max(r[system]["step_s"] for r in results)
        moved = max(r[system]["exchange_bytes"] for r in results)
        overlap = results[0][system]["overlap"]
        label = system + (f" ({results[0][system]['micro_groups']} groups)" if system == "micro-groups" else "")
        print(f"| {label} | {step:.4f} | {moved} | {'-' if overlap is None else f'{overlap:.2f}'} |")
    return 0


TP_STEP = Command(description="Optimizer steps under DeepSpeed AutoTP: micro-groups vs synchronous vs DeepSpeed's "
                  "per-shard Muon (time, bytes, overlap).", add_arguments=add_arguments, run=run)


def main(argv: Sequence[str] | None = None) -> int:
    parser = OneLineParser(prog="python -m ds_canzona.bench tp-step", description=TP_STEP.description)
    add_arguments(parser)
    return run(parser.parse_args(argv))
