"""Check three reported bugs of DeepSpeed's own ZeRO-3 Muon on the installed DeepSpeed (facts for the docs).

    PYTHONPATH=$PWD python scripts/deepspeed_zero3_muon_bugs.py      # 2 gloo ranks on the CPU, ~1 minute

Issue 13 lists them for DeepSpeed 0.19.x:

1. gradient accumulation changes the result (DeepSpeed #8443): Muon ran once per micro-batch, so
   the momentum advanced ``gradient_accumulation_steps`` times per step on partial gradients;
2. a matrix larger than ``reduce_bucket_size`` got plain SGD: Muon ran only on the
   contiguous-bucket reduce path, which such a matrix skips;
3. under ``deepspeed.zero.Init`` every matrix got AdamW (DeepSpeed #8438): the Muon/AdamW split
   read ``param.shape``, which is 1-D for a partitioned parameter.

Each is checked by training the same model on the same data (DP=2, ZeRO-3, DeepSpeed's Muon,
``reduce_scatter: false``) two ways that must agree when the bug is absent, and reporting the
difference of the parameters after a few steps relative to how far training moved them:

1. micro-batch 4 with GA 1 against micro-batch 2 with GA 2 (the same 4 samples per rank and step);
2. ``reduce_bucket_size`` 10^6 against 1,000 (below the 4,096-element matrices); the small-bucket
   run is also compared with the plain SGD update, which the bug would give;
3. a model built normally against one built under ``zero.Init`` (the same initial weights), and
   the ``use_muon`` flags DeepSpeed set.

A relative difference at rounding level (1e-6 here) means the bug is not there; a bug shows as a
difference of order 1 (0.1 or more). The script only prints; nothing depends on DeepSpeed staying
buggy.
"""

from __future__ import annotations

import sys
from typing import Any

STEPS = 3
WIDTH = 64  # 4,096-element matrices
SAMPLES = 4  # per rank and optimizer step
LR = 0.02


def _model():
    import torch

    # Matrices of one shape: DeepSpeed 0.19.0's ZeRO-3 Muon fails on a round of mixed shapes.
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH))


def _config(*, micro_batch: int, accumulation: int, bucket: int, world_size: int) -> dict[str, Any]:
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "train_batch_size": micro_batch * accumulation * world_size, "steps_per_print": 10**9,
            "optimizer": {"type": "Muon", "params": {"lr": LR, "momentum": 0.95, "weight_decay": 0.0,
                                                     "adam_lr": 1e-3}},
            "zero_optimization": {"stage": 3, "reduce_scatter": False, "reduce_bucket_size": bucket,
                                  "stage3_param_persistence_threshold": 0}}


def _batches(rank: int):
    import torch

    generator = torch.Generator().manual_seed(100 + rank)
    return [(torch.randn(SAMPLES, WIDTH, generator=generator), torch.randn(SAMPLES, WIDTH, generator=generator))
            for _ in range(STEPS)]


def _train(rank: int, world_size: int, *, micro_batch: int = SAMPLES, bucket: int = 10**6,
           zero_init: bool = False) -> tuple[dict[str, Any], dict[str, bool]]:
    import torch
    import deepspeed

    accumulation = SAMPLES // micro_batch
    config = _config(micro_batch=micro_batch, accumulation=accumulation, bucket=bucket, world_size=world_size)
    reference = _model()
    initial = {name: p.detach().clone() for name, p in reference.named_parameters()}
    if zero_init:
        with deepspeed.zero.Init(config_dict_or_path=config):
            model = _model()
        for target, source in zip(model.parameters(), reference.parameters()):
            with deepspeed.zero.GatheredParameters([target], modifier_rank=0):
                if rank == 0:
                    target.data.copy_(source.data)
    else:
        model = reference
    engine, *_ = deepspeed.initialize(model=model, config=config)
    flags = {name: bool(p.use_muon) for name, p in engine.module.named_parameters()}
    for inputs, targets in _batches(rank):
        for k in range(accumulation):
            rows = slice(k * micro_batch, (k + 1) * micro_batch)
            loss = torch.nn.functional.mse_loss(engine(inputs[rows]), targets[rows])
            engine.backward(loss)
            engine.step()
    params = list(engine.module.named_parameters())
    with deepspeed.zero.GatheredParameters([p for _, p in params]):
        final = {name: p.detach().clone() for name, p in params}
    engine.destroy()
    return {"initial": initial, "final": final}, flags


def _sgd_final(rank: int, world_size: int) -> dict[str, Any]:
    """The matrices after the same steps of plain SGD (no momentum) on the all-reduced mean gradient."""
    import torch
    import deepspeed.comm as dist

    model = _model()
    for inputs, targets in _batches(rank):
        model.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        with torch.no_grad():
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
                p -= LR * p.grad
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def _worker(rank: int, world_size: int) -> dict[str, Any]:
    import logging

    import deepspeed
    import torch
    from ds_canzona.bench.standins._instrument import force_deepspeed_ns_dtype

    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    # DeepSpeed would run Newton-Schulz in fp16 on this CPU, whose rounding, amplified by the
    # iteration, hides a difference of summation order in percent-level noise.
    force_deepspeed_ns_dtype(torch.float32)
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    runs = {"reference": _train(rank, world_size), "accumulation": _train(rank, world_size, micro_batch=2),
            "small bucket": _train(rank, world_size, bucket=1000),
            "zero.Init": _train(rank, world_size, zero_init=True)}
    return {"runs": runs, "sgd": _sgd_final(rank, world_size), "version": deepspeed.__version__}


def _relative(a: dict[str, Any], b: dict[str, Any], initial: dict[str, Any], names) -> float:
    """max over tensors of |a - b| / |b - initial| (Frobenius): 0 same, ~1 as far apart as training moved them."""
    return max(float((a[n] - b[n]).norm() / (b[n] - initial[n]).norm().clamp_min(1e-30)) for n in names)


def main() -> int:
    from ds_canzona.bench.standins._ranks import run_ranks

    result = run_ranks(_worker, 2, env={"DS_ACCELERATOR": "cpu", "TORCHDYNAMO_DISABLE": "1"})[0]
    runs, version = result["runs"], result["version"]
    (reference, flags) = runs["reference"]
    initial, final = reference["initial"], reference["final"]
    matrices = [n for n, muon in flags.items() if muon]
    everything = list(final)
    print(f"DeepSpeed {version}, ZeRO-3 Muon, DP=2, {STEPS} steps; parameters after training, relative to the "
          "distance training moved them (0: identical; order 1: different updates):\n")
    print(f"Muon-tagged (normal build): {matrices}")
    accumulation = _relative(runs["accumulation"][0]["final"], final, initial, everything)
    print(f"1. GA 2 x micro-batch 2 vs GA 1 x micro-batch 4: {accumulation:.2e} -> "
          f"{'REPRODUCED' if accumulation > 1e-2 else 'not reproduced'} (#8443)")
    small = runs["small bucket"][0]["final"]
    bucket = _relative(small, final, initial, matrices)
    big = max(matrices, key=lambda n: final[n].numel())
    sgd = _relative(small, result["sgd"], initial, [big])
    print(f"2. reduce_bucket_size 1000 (below the {final[big].numel()}-element {big}) vs 10^6: {bucket:.2e}; "
          "small-bucket "
          f"{big} vs plain SGD: {sgd:.2e} -> {'REPRODUCED' if bucket > 1e-2 else 'not reproduced'}")
    init_final, init_flags = runs["zero.Init"]
    tagged = [n for n, muon in init_flags.items() if muon]
    zero_init = _relative(init_final["final"], final, initial, everything)
    print(f"3. under zero.Init: Muon-tagged {tagged}; parameters vs normal build: {zero_init:.2e} -> "
          f"{'REPRODUCED' if tagged != matrices or zero_init > 1e-2 else 'not reproduced'} (#8438)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
