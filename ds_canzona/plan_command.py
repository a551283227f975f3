"""``ds-canzona plan``: plan offline and report the balance as a table, JSON or a plot.

The command's arguments and its run: it loads the specs, builds the cost and memory models and
the plan, and calls the formatting in ``ds_canzona.plan.report``. It lives outside the planner
package because it is an entry point: the CLI calls the planner and its report, never the
reverse. Only the standard library is imported on the ``--shapes`` and ``--model`` paths, so the
command starts in well under a second; ``--hf-config`` brings in torch and transformers,
``--plot`` brings in matplotlib.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from .cli import Command
from .plan.collectives import COLLECTIVE_SETTINGS, BucketForms, CollectiveCosts, bucket_forms
from .plan.gather_groups import ALL_GATHER_GROUP_NAMES, all_gather_groups, step_launches
from .plan.cost import COST_MODELS, DEFAULT_MACHINE_BALANCE, CostModel, cost_model
from .plan.dp import DEFAULT_SPLIT_NUMEL, STRATEGIES, plan_dp_partitions
from .plan.experts import plan_expert_parallel
from .plan.memory import StateMemory, memory_model
from .plan.models import model_specs, shipped_models
from .plan.owners import plan_zero3_owners
from .plan.report import (COMMUNICATION_LEGEND, format_all_gather_groups, format_collective_forms, format_dp_table,
                          format_tp_groups, format_zero3_table, plot_dp)
from .plan.specs import ParamSpec, PlanError, shard_for_tp, specs_from_hf_config, specs_from_shapes_file
from .plan.tp import DEFAULT_CAPACITY_BYTES, plan_tp_micro_groups

__all__ = ["COMMAND", "add_plan_arguments", "run_plan"]

DEFAULT_BUCKET_NUMEL = 500_000_000  # DeepSpeed's default reduce_bucket_size
# Bytes per element of the model's parameters, by --dtype.
PARAM_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}


def run_plan(args: argparse.Namespace) -> int:
    for flag, value in (("--dp", args.dp), ("--tp", args.tp), ("--ep", args.ep), ("--tp-capacity-mb", args.tp_capacity_mb)):
        if value < 1:
            raise PlanError(f"Invalid {flag} {value}: must be a positive integer.")
    specs, source = _load_specs(args)
    cost = _cost_model(args)
    if args.ep > 1:
        return _run_expert_parallel(args, specs, source, cost)
    if args.stage == 3:
        return _run_zero3(args, specs, source, cost)
    if args.tp > 1:
        specs = shard_for_tp(specs, args.tp)
    plan = plan_dp_partitions(
        specs, world_size=args.dp, bucket_numel=args.bucket_numel, alpha=args.alpha, strategy=args.strategy, cost=cost,
        split_numel=args.split_numel, memory=_memory_model(args), max_state_bytes_per_rank=args.max_state_bytes,
    )
    gather_groups = all_gather_groups(len(plan.buckets), args.all_gather_groups)
    forms = _collective_forms(args, plan.buckets, gather_groups)
    tp_plan = None
    if args.tp > 1:
        tp_plan = plan_tp_micro_groups(specs, tp_size=args.tp, capacity_bytes=args.tp_capacity_mb * 2**20, cost=cost)
    if args.plot:
        plot_dp(plan, args.plot, title=f"{source}: {plan.strategy} (alpha {plan.alpha:g}), DP {plan.world_size}")
    if args.json:
        document: dict[str, Any] = plan.to_dict()
        document["digest"] = plan.digest()
        document["collectives"] = _forms_document(forms)
        document["all_gather_groups"] = {"setting": args.all_gather_groups, "groups": [list(g) for g in gather_groups],
                                         "launches_per_step": step_launches(gather_groups, forms.all_gather, args.dp)}
        if tp_plan is not None:
            document["tp"] = tp_plan.to_dict()
        json.dump(document, sys.stdout)
        sys.stdout.write("\n")
        return 0
    total = sum(spec.numel for spec in specs)
    title = f"{source}: {len(specs)} tensors, {total:,} elements"
    if args.tp > 1:
        title += f" (TP-local shards, TP {args.tp})"
    print(format_dp_table(plan, title=title))
    print(COMMUNICATION_LEGEND)
    print(format_collective_forms(forms))
    print(format_all_gather_groups(gather_groups, forms, args.all_gather_groups, args.dp))
    if tp_plan is not None:
        print()
        print(format_tp_groups(tp_plan))
    if args.plot:
        print(f"\nplot written to {args.plot}")
    return 0


def _collective_forms(args: argparse.Namespace, buckets, gather_groups) -> BucketForms:
    """The runtime's choice of bucket collectives for this plan (both in the --dtype, the default communication dtype)."""
    defaults = CollectiveCosts()
    costs = CollectiveCosts(launch_s=args.collective_launch_s or defaults.launch_s,
                            bytes_per_s=args.collective_bytes_per_s or defaults.bytes_per_s)
    element = PARAM_BYTES[args.dtype]
    return bucket_forms([bucket.cuts for bucket in buckets], reduce_scatter_bytes=element, all_gather_bytes=element,
                        backend=args.backend, setting=args.collectives, costs=costs, gather_groups=gather_groups)


def _forms_document(forms: BucketForms) -> dict[str, Any]:
    summaries = {"reduce_scatter": forms.reduce_scatter_summary, "all_gather": forms.all_gather_summary}
    return {"setting": forms.setting, "backend": forms.backend,
            **{name: {"forms": list(getattr(forms, name)), "padded": summary.padded, "grouped": summary.grouped,
                      "all_reduced": summary.all_reduced, "padding_bytes": summary.padding_bytes,
                      "second_pass_bytes": summary.second_pass_bytes, "bucket_bytes": summary.bucket_bytes,
                      "grouped_s": summary.grouped_s, "padded_s": summary.padded_s,
                      "operations": summary.operations}
               for name, summary in summaries.items()}}


def _run_expert_parallel(args: argparse.Namespace, specs: list[ParamSpec], source: str, cost: CostModel) -> int:
    """``--ep N``: the dense family over --dp ranks and one EP rank's experts over --dp / N (ZeRO-1/2)."""
    if args.stage == 3 or args.tp > 1:
        raise PlanError("--ep plans ZeRO-1/2 without tensor parallelism (ds_canzona refuses expert parallelism at "
                        "stage 3 and with AutoTP).")
    plan = plan_expert_parallel(specs, world_size=args.dp, ep_size=args.ep, bucket_numel=args.bucket_numel,
                                alpha=args.alpha, strategy=args.strategy, cost=cost, split_numel=args.split_numel,
                                memory=_memory_model(args), max_state_bytes_per_rank=args.max_state_bytes)
    if args.json:
        json.dump(plan.to_dict(), sys.stdout)
        sys.stdout.write("\n")
        return 0
    edp = plan.experts.world_size
    print(f"{source}: expert parallelism {args.ep} x expert-data parallelism {edp} = DP {args.dp}; each family "
          f"planned and balanced inside its group (world rank r: EP rank r % {args.ep}, rank r // {args.ep} of "
          "its expert-data-parallel group)")
    if plan.dense is not None:
        print()
        print(format_dp_table(plan.dense, title=f"family dense: {len(plan.dense.specs)} tensors over the {args.dp} "
                                                f"data-parallel ranks"))
    print()
    print(format_dp_table(plan.experts, title=f"family experts: EP rank 0's {len(plan.experts.specs)} expert tensors "
                                               f"over its {edp} expert-data-parallel ranks (every EP rank's plan "
                                               "has these shapes)"))
    print()
    print(f"per world rank (dense + experts): cost max/avg {plan.flops_ratio:.3f}, "
          f"state bytes max/avg {plan.state_bytes_ratio:.3f}")
    return 0


def _run_zero3(args: argparse.Namespace, specs: list[ParamSpec], source: str, cost: CostModel) -> int:
    """The ZeRO-3 owner plan (``plan_zero3_owners``): what the stage-3 runtime would place where."""
    # What the owner layout has no use for, or the runtime refuses at stage 3, is refused here too.
    for flag, given in (("--tp", args.tp > 1), ("--max-state-bytes", args.max_state_bytes is not None),
                        ("--plot", bool(args.plot))):
        if given:
            raise PlanError(f"{flag} does not apply with --stage 3 (owner placement: no buckets, AutoTP and "
                            "max_state_bytes_per_rank are refused at stage 3)")
    plan = plan_zero3_owners(specs, world_size=args.dp, cost=cost, split_numel=args.split_numel)
    if args.json:
        json.dump({**plan.to_dict(), "digest": plan.digest()}, sys.stdout)
        sys.stdout.write("\n")
        return 0
    total = sum(spec.numel for spec in specs)
    print(format_zero3_table(plan, title=f"{source}: {len(specs)} tensors, {total:,} elements"))
    return 0


def add_plan_arguments(parser: argparse.ArgumentParser) -> None:
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--shapes", metavar="FILE", help='JSON list of {"name", "shape", "matrix"} in buffer order')
    source.add_argument(
        "--hf-config", metavar="PATH", help="HuggingFace config.json (file or folder); needs torch and transformers"
    )
    source.add_argument("--model", metavar="NAME", help=f"a shipped config: {', '.join(shipped_models())}")
    parser.add_argument("--dp", type=int, default=32, metavar="R", help="data-parallel world size (default 32)")
    parser.add_argument("--ep", type=int, default=1, metavar="N",
                        help="expert-parallel size (DeepSpeed MoE): plan the experts within their expert-data-parallel "
                             "group of --dp / N ranks and the dense tensors over --dp (default 1: no expert parallelism)")
    parser.add_argument(
        "--tp", type=int, default=1, metavar="T", help="tensor-parallel size; > 1 also plans micro-groups"
    )
    parser.add_argument(
        "--alpha", type=float, default=1.0, metavar="A", help="0: even elements, 1: even cost (default 1)"
    )
    parser.add_argument(
        "--bucket-numel",
        type=_count,
        default=DEFAULT_BUCKET_NUMEL,
        metavar="N",
        help="bucket size in elements (default 5e8)",
    )
    parser.add_argument("--cost", choices=COST_MODELS, default="roofline",
                        help="cost model (default roofline, as the runtime)")
    parser.add_argument("--machine-balance", type=float, default=None, metavar="B",
                        help=f"for --cost roofline: matmul FLOPs per elementwise byte (default "
                             f"{DEFAULT_MACHINE_BALANCE['cuda']:g}, GPUs; the CPU's is {DEFAULT_MACHINE_BALANCE['cpu']:g})")
    parser.add_argument("--optimizer", choices=("muon", "normuon", "adamuon", "shampoo", "soap"), default="muon",
                        help="the matrix optimizer, for --cost roofline or flops and the memory model")
    parser.add_argument("--ns-method", choices=("gram", "standard"), default=None,
                        help="Newton-Schulz variant of Muon, NorMuon and AdaMuon")
    parser.add_argument("--dtype", choices=tuple(PARAM_BYTES), default="bf16",
                        help="the model's parameter dtype, for the memory model (default bf16: fp32 masters kept)")
    parser.add_argument("--max-state-bytes", type=_count, default=None, metavar="BYTES",
                        help="hard cap on a rank's state bytes (canzona.max_state_bytes_per_rank), bought with "
                             "step time; an error if no plan meets it")
    parser.add_argument("--stage", type=int, choices=(1, 2, 3), default=2,
                        help="ZeRO stage: 1 or 2 plan buckets (default), 3 plans owners (each item whole on one rank; "
                             "--split-numel applies, bucket and strategy options do not)")
    parser.add_argument("--strategy", choices=STRATEGIES, default="alpha_balanced")
    parser.add_argument("--split-numel", type=_split_count, default=DEFAULT_SPLIT_NUMEL, metavar="N",
                        help=f"plan non-matrix tensors above N elements in pieces of N (default {DEFAULT_SPLIT_NUMEL}, "
                             "as the runtime; 0: every tensor whole)")
    parser.add_argument(
        "--tp-capacity-mb",
        type=int,
        default=DEFAULT_CAPACITY_BYTES // 2**20,
        metavar="MB",
        help="micro-group C_max (default 512)",
    )
    parser.add_argument("--collectives", choices=COLLECTIVE_SETTINGS, default="default",
                        help="bucket collectives as canzona.collectives: the cost model's choice per bucket (default), "
                             "grouped or padded; reported with the padding bytes it costs")
    parser.add_argument("--all-gather-groups", type=_gather_groups, default="default", metavar="N",
                        help="gather groups as canzona.all_gather_groups: an int >= 1, per_bucket, or default "
                             "(2 groups); reported with the launches per step they give")
    parser.add_argument("--backend", default="nccl", metavar="NAME",
                        help="the process group's backend the choice is made for (default nccl; gloo keeps grouped)")
    parser.add_argument("--collective-launch-s", type=_positive, default=None, metavar="S",
                        help="cost model: one collective operation's latency per hop (canzona.collective_launch_s)")
    parser.add_argument("--collective-bytes-per-s", type=_positive, default=None, metavar="B",
                        help="cost model: wire bytes per second (canzona.collective_bytes_per_s)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    parser.add_argument("--plot", metavar="FILE.png", help="draw per-rank cost and memory (needs matplotlib)")


def _gather_groups(text: str) -> int | str:
    if text in ALL_GATHER_GROUP_NAMES:
        return text
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"an int >= 1 or one of {', '.join(ALL_GATHER_GROUP_NAMES)}, got {text!r}")
    if value < 1:
        raise argparse.ArgumentTypeError(f"at least 1, got {value}")
    return value


COMMAND = Command(
    description="Plan data-parallel ownership offline and report the per-rank balance.",
    add_arguments=add_plan_arguments,
    run=run_plan,
)


def _load_specs(args: argparse.Namespace) -> tuple[list[ParamSpec], str]:
    if args.shapes:
        return specs_from_shapes_file(args.shapes), args.shapes
    if args.model:
        return model_specs(args.model), args.model.lower()
    return specs_from_hf_config(args.hf_config), args.hf_config


# The optimizers whose update orthogonalises by Newton-Schulz (--ns-method applies to them).
_NEWTON_SCHULZ_OPTIMIZERS = ("muon", "normuon", "adamuon")


def _cost_model(args: argparse.Namespace) -> CostModel:
    if args.cost == "numel":
        return cost_model("numel")
    options = {"ns_method": args.ns_method} if args.ns_method and args.optimizer in _NEWTON_SCHULZ_OPTIMIZERS else {}
    if args.cost == "roofline" and args.machine_balance is not None:
        options["machine_balance"] = args.machine_balance
    elif args.machine_balance is not None:
        raise PlanError(f"--machine-balance applies to --cost roofline only, not {args.cost}.")
    return cost_model(args.cost, args.optimizer, **options)


def _memory_model(args: argparse.Namespace) -> StateMemory:
    """The runtime's memory model for --optimizer and --dtype, with the rules' default options."""
    return memory_model(args.optimizer, param_bytes=PARAM_BYTES[args.dtype])


def _split_count(text: str) -> int | None:
    """--split-numel: a positive element count, or 0 for whole tensors."""
    return None if text.strip() == "0" else _count(text)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not 0 < value < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a positive finite number, got {text}")
    return value


def _count(text: str) -> int:
    """A positive element count, written as an integer or in scientific notation (5e8)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}") from None
    if not value.is_integer() or value < 1:
        raise argparse.ArgumentTypeError(f"invalid count {text!r}: must be a positive integer")
    return int(value)
