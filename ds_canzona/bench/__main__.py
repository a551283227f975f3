"""``python -m ds_canzona.bench <command> ...``: the benchmark dispatcher.

Each command's module is imported only when that command runs, so a benchmark that needs torch
or a GPU costs nothing to the others. Adding one is one line in ``COMMANDS``:
name -> (target, one-line help), where the target is ``"module"`` for a module with a
``main(argv) -> int``, or ``"module:ATTRIBUTE"`` for a :class:`ds_canzona.cli.Command`.
"""

import sys

from ..cli import dispatch

COMMANDS: dict[str, tuple[str, str]] = {
    "balance": ("ds_canzona.bench.benchmarks.balance:BALANCE", "DP load balance on the shipped Qwen3 configs, vs LPT"),
    "plan-speed": ("ds_canzona.bench.benchmarks.balance:PLAN_SPEED", "time the planner on 10,000 tensors at DP=1024"),
    "plan-bounds": ("ds_canzona.bench.benchmarks.plan_bounds:PLAN_BOUNDS", "the default plan on unshipped shapes vs a lower bound on memory"),
    "stack-pieces": ("ds_canzona.bench.benchmarks.stack_pieces:STACK_PIECES", "MoE expert stacks planned whole vs in pieces of whole experts"),
    "kernels": ("ds_canzona.bench.benchmarks.kernels", "Triton kernels against torch and cuBLAS (GPU)"),
    "step": ("ds_canzona.bench.benchmarks.step:STEP", "real training steps on gloo ranks against DeepSpeed's Muon"),
    "step-offload": ("ds_canzona.bench.benchmarks.step_offload:STEP_OFFLOAD", "optimizer offload: ds_canzona vs DeepSpeed's offloaded Muon"),
    "tp-step": ("ds_canzona.bench.benchmarks.tp_step:TP_STEP", "optimizer steps under AutoTP: micro-groups vs synchronous vs DeepSpeed"),
    "makespan": ("ds_canzona.bench.benchmarks.makespan:MAKESPAN", "optimizer-step makespan at DP 16-128, real per-tensor compute"),
    "zero3-memory": ("ds_canzona.bench.benchmarks.memory3:ZERO3_MEMORY", "memory per rank at ZeRO-3 vs DeepSpeed's ZeRO-3 Muon"),
    "gpu-check": ("ds_canzona.bench.gpu.check:GPU_CHECK", "the GPU session's phases: kernels vs float64, engine steps, NS timings"),
    "collectives": ("ds_canzona.bench.benchmarks.collectives:COLLECTIVES", "collective launches, NCCL ops, bytes per step at DP 8-1024 (fake world)"),
    "calibrate": ("ds_canzona.bench.benchmarks.calibrate:CALIBRATE", "measure this device's machine balance for the roofline cost"),
}

if __name__ == "__main__":
    sys.exit(dispatch("python -m ds_canzona.bench", COMMANDS))
