"""The parent side of ``python -m ds_canzona.bench step``: aggregate the ranks' records, print the tables.

``_aggregate`` turns the per-rank records of one DP size into ``CaseResult`` cells (the slowest
rank of each step, medians over steps); ``report`` prints every table of a payload and
``plot_step`` draws it; ``merge_payloads`` joins the JSON of several runs.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .step_systems import BENCH_OPTIMIZERS, COLLECTIVE_NAMES, SYSTEMS, ModelShape
from .step_zero3 import memory_summary, memory_table, zero3_checks, zero3_table

# The optimizers timed per step (medians) that run Newton-Schulz every step.
MUON_FAMILY = ("muon", "normuon", "adamuon")


@dataclass(kw_only=True)
class CaseResult:
    """One (system, optimizer, DP) cell, aggregated over ranks and timed steps."""

    system: str
    label: str
    optimizer: str
    dp: int
    stage: int
    steps: int
    iteration_s: float
    fwd_bwd_s: float
    step_s: float
    iteration_mean_s: float
    ns_runs_total: int
    ns_runs_max_rank: int
    comm_calls: dict[str, float]
    comm_payload_bytes: dict[str, float]
    comm_input_bytes: dict[str, float]
    comm_wire_bytes: dict[str, float]
    matrix_state_bytes_max: int
    matrix_state_bytes_total: int
    adamw_state_bytes_max: int
    fp32_master_bytes_max: int
    final_loss: float
    max_rss_mb: float
    per_rank_iteration_s: list[float] = field(default_factory=list)
    fwd_bwd_mean_s: float | None = None
    step_mean_s: float | None = None
    samples_iteration_s: list[float] = field(default_factory=list)
    # Per category of step_zero3.memory_summary: {"max": bytes, "avg": bytes, "per_rank": [...]}.
    memory: dict[str, dict[str, Any]] | None = None


def _aggregate(dp: int, per_rank: list[dict[str, Any]]) -> tuple[list[CaseResult], list[dict[str, Any]]]:
    """The measured cells, and the cells whose engine was refused ({system, optimizer, dp, error})."""
    cases: dict[tuple[str, str], list[list[dict[str, Any]]]] = {}
    unavailable: dict[tuple[str, str], str] = {}
    for rank_results in per_rank:
        for item in rank_results["cases"]:
            if "unavailable" in item:
                unavailable.setdefault((item["system"], item["optimizer"]), item["unavailable"])
                continue
            cases.setdefault((item["system"], item["optimizer"]), [[] for _ in range(dp)])[item["rank"]].append(item)
    out = []
    for (key, optimizer), ranks in cases.items():
        system = SYSTEMS[key]
        # Pool the rounds: step i of round k on every rank is one sample.
        samples: list[list[dict[str, Any]]] = []  # [sample][rank]
        for round_index in range(len(ranks[0])):
            for step_index in range(len(ranks[0][round_index]["records"])):
                samples.append([ranks[r][round_index]["records"][step_index] for r in range(dp)])

        def slowest(phase: str) -> list[float]:
            return [max(rec[phase] for rec in sample) for sample in samples]

        rank0 = [sample[0]["comm"] for sample in samples]

        def mean_counter(field_name: str) -> dict[str, float]:
            kinds = sorted({k for c in rank0 for k in c[field_name]})
            return {k: statistics.fmean(c[field_name].get(k, 0) for c in rank0) for k in kinds}

        states = [ranks[r][-1]["state"] for r in range(dp)]
        out.append(CaseResult(
            system=key, label=system.label, optimizer=optimizer, dp=dp, stage=system.stage, steps=len(samples),
            iteration_s=statistics.median(slowest("iteration")), fwd_bwd_s=statistics.median(slowest("fwd_bwd")),
            step_s=statistics.median(slowest("step")), iteration_mean_s=statistics.fmean(slowest("iteration")),
            fwd_bwd_mean_s=statistics.fmean(slowest("fwd_bwd")), step_mean_s=statistics.fmean(slowest("step")),
            samples_iteration_s=slowest("iteration"),
            ns_runs_total=max(sum(rec["ns_runs"] for rec in sample) for sample in samples),
            ns_runs_max_rank=max(rec["ns_runs"] for sample in samples for rec in sample),
            comm_calls=mean_counter("calls"), comm_payload_bytes=mean_counter("payload"),
            comm_input_bytes=mean_counter("input"), comm_wire_bytes=mean_counter("wire"),
            matrix_state_bytes_max=max(s["matrix"] for s in states),
            matrix_state_bytes_total=sum(s["matrix"] for s in states),
            adamw_state_bytes_max=max(s["adamw"] for s in states),
            fp32_master_bytes_max=max(s["fp32_master"] for s in states),
            final_loss=ranks[0][-1]["losses"][-1],
            max_rss_mb=max(ranks[r][-1]["max_rss_mb"] for r in range(dp)),
            per_rank_iteration_s=[statistics.median(rec["iteration"] for item in ranks[r] for rec in item["records"])
                                  for r in range(dp)],
            memory=memory_summary([ranks[r][-1]["memory"] for r in range(dp)]),
        ))
    refused = [{"system": key, "label": SYSTEMS[key].label, "optimizer": optimizer, "dp": dp, "error": error}
               for (key, optimizer), error in unavailable.items()]
    return out, refused


def _reference(result: CaseResult, results: Sequence[CaseResult]) -> CaseResult | None:
    """The ds_canzona row a row is compared with: same stage, or ZeRO-1 for the ZeRO-0 schemes."""
    stage = result.stage if result.stage in (1, 2, 3) else 1
    for other in results:
        if other.system == f"canzona-z{stage}" and other.optimizer == result.optimizer and other.dp == result.dp:
            return other
    return None


def _mb(value: float) -> str:
    return f"{value / 2**20:.1f}"


def step_table(results: Sequence[CaseResult], optimizer: str, dp: int, *, amortised: bool = False) -> str:
    rows = [r for r in results if r.optimizer == optimizer and r.dp == dp]
    if not rows:
        return ""
    unit = "s (mean)" if amortised else "s"
    lines = [
        f"| system | iteration {unit} | fwd-bwd {unit} | step {unit} | iteration / ds_canzona's "
        "| NS runs/step (all ranks / busiest) "
        "| comm MB/step: payload / wire per rank | matrix-opt state MB/rank (max) | state / ds_canzona's "
        "| AdamW state MB/rank |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        ref = _reference(r, results)
        iteration = r.iteration_mean_s if amortised else r.iteration_s
        fwd_bwd = r.fwd_bwd_mean_s if amortised and r.fwd_bwd_mean_s is not None else r.fwd_bwd_s
        step = r.step_mean_s if amortised and r.step_mean_s is not None else r.step_s
        ref_iteration = (ref.iteration_mean_s if amortised else ref.iteration_s) if ref else None
        ratio = (f"{iteration / ref_iteration:.2f}x (vs Z{ref.stage})" if ref and ref is not r
                 else "1.00x" if ref else "-")
        state_ratio = (f"{r.matrix_state_bytes_max / ref.matrix_state_bytes_max:.2f}x"
                       if ref and ref.matrix_state_bytes_max else "")
        ns = f"{r.ns_runs_total} / {r.ns_runs_max_rank}" if optimizer in MUON_FAMILY else "-"
        lines.append(
            f"| {r.label} | {iteration:.3f} | {fwd_bwd:.3f} | {step:.3f} | {ratio} | {ns} "
            f"| {_mb(sum(r.comm_payload_bytes.values()))} / {_mb(sum(r.comm_wire_bytes.values()))} "
            f"| {_mb(r.matrix_state_bytes_max)} | {state_ratio} | {_mb(r.adamw_state_bytes_max)} |")
    return "\n".join(lines)


def comm_table(results: Sequence[CaseResult], optimizer: str, dp: int) -> str:
    rows = [r for r in results if r.optimizer == optimizer and r.dp == dp]
    kinds = sorted({k for r in rows for k in r.comm_calls})
    if not kinds:
        return ""
    lines = ["| system | " + " | ".join(f"{k}: calls, MB" for k in kinds) + " |",
             "|---|" + "---:|" * len(kinds)]
    for r in rows:
        cells = [f"{r.comm_calls.get(k, 0):.0f}, {_mb(r.comm_payload_bytes.get(k, 0))}" for k in kinds]
        lines.append(f"| {r.label} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def checks(results: Sequence[CaseResult]) -> list[str]:
    """The done-means comparisons, as lines of text (benchmarks never fail on time)."""
    lines = []
    by = {(r.system, r.optimizer, r.dp): r for r in results}
    for dp in sorted({r.dp for r in results}):
        ours = [by.get((f"canzona-z{s}", "muon", dp)) for s in (1, 2)]
        for stage, mine in zip((1, 2), ours):
            if mine is None:
                continue
            for key in (f"deepspeed-z{stage}", f"deepspeed-z{stage}-ar"):
                other = by.get((key, "muon", dp))
                if other is None:
                    continue
                speed = other.iteration_s / mine.iteration_s
                memory = (mine.matrix_state_bytes_max / other.matrix_state_bytes_max
                          if other.matrix_state_bytes_max else 0.0)
                lines.append(f"DP={dp} {mine.label} vs {other.label}: {speed:.2f}x faster per iteration "
                             f"({'ok' if speed >= 1.0 else 'SLOWER'}); NS runs {mine.ns_runs_total} vs "
                             f"{other.ns_runs_total}; Muon state {memory:.2f} of DeepSpeed's (busiest rank), "
                             f"{mine.matrix_state_bytes_total / max(1, other.matrix_state_bytes_total):.2f} in total")
        sync = by.get(("synchronous", "muon", dp))
        best = [r for r in ours if r is not None]
        if sync is not None and best:
            fastest = min(best, key=lambda r: r.iteration_s)
            lines.append(f"DP={dp} {fastest.label} vs synchronous: {sync.iteration_s / fastest.iteration_s:.2f}x faster"
                         + (" (target at DP=2: >= 1.25x)" if dp == 2 else ""))
        sync = by.get(("synchronous", "shampoo", dp))
        best = [by.get((f"canzona-z{s}", "shampoo", dp)) for s in (1, 2)]
        best = [r for r in best if r is not None]
        if sync is not None and best:
            fastest = min(best, key=lambda r: r.iteration_mean_s)
            lines.append(f"DP={dp} Shampoo: {fastest.label} vs synchronous: "
                         f"{sync.iteration_mean_s / fastest.iteration_mean_s:.2f}x faster "
                         "(mean over a preconditioner period)")
    return lines


def _deepspeed_emulated_runs(shape: ModelShape, dp: int) -> int:
    """NS runs per step DeepSpeed's equal partitions imply for this model (a cross-check of the count)."""
    from ds_canzona.plan import qwen3_specs
    from .baselines import deepspeed_muon_loads

    specs = qwen3_specs(shape.qwen3_config())
    _, runs = deepspeed_muon_loads(specs, [1.0] * len(specs), dp)
    return runs


def merge_payloads(payloads: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """One payload from the JSON of several runs (say one per DP size), for one report and one plot."""
    merged = dict(payloads[0])
    merged["command"] = [p.get("command") for p in payloads]
    merged["results"] = [r for p in payloads for r in p["results"]]
    # A cell refused in one run and measured in another (a later runtime) is the measured one.
    measured = {(r["system"], r["optimizer"], r["dp"]) for r in merged["results"]}
    merged["unavailable"] = [u for p in payloads for u in p.get("unavailable", [])
                             if (u["system"], u["optimizer"], u["dp"]) not in measured]
    merged["collectives"] = {dp: c for p in payloads for dp, c in p.get("collectives", {}).items()}
    results = [CaseResult(**r) for r in merged["results"]]
    merged["checks"] = checks(results) + zero3_checks(results, merged["unavailable"])
    return merged


def report(payload: dict[str, Any]) -> None:
    results = [CaseResult(**r) for r in payload["results"]]
    shape = ModelShape(**payload["model"])
    info, settings = payload["machine"], payload["settings"]
    dps = sorted({r.dp for r in results})
    optimizers = [o for o in BENCH_OPTIMIZERS if any(r.optimizer == o for r in results)]
    print(f"Model: {shape.describe()}.")
    print(f"Machine: {info['cpu']}, {info['cores']} cores; torch {info['torch']}, deepspeed {info['deepspeed']}, "
          f"transformers {info['transformers']}; gloo, one thread per rank.")
    print(f"Newton-Schulz: {settings['ns_method']}, fp32, 5 steps, everywhere. Muon: medians over "
          f"{settings['steps']} timed steps x {settings['rounds']} round(s) after {settings['warmup']} warm-up; "
          f"Shampoo: means over {settings['shampoo_steps']} timed steps; slowest rank per step.")
    for optimizer in optimizers:
        for dp in dps:
            table = step_table(results, optimizer, dp, amortised=optimizer == "shampoo")
            if not table:
                continue
            title = (BENCH_OPTIMIZERS[optimizer][0] if optimizer in MUON_FAMILY
                     else "Shampoo (mean over one preconditioner period)")
            extra = (f"; DeepSpeed's equal partitions imply {_deepspeed_emulated_runs(shape, dp)} NS runs"
                     if optimizer == "muon" else "")
            print(f"\n{title}, DP={dp}{extra}:\n")
            print(table)
    collectives = payload.get("collectives", {})
    if collectives:
        print("\nThe collectives alone on this machine (a buffer the size of the model, fp32; median seconds):\n")
        print("| DP | MB | " + " | ".join(COLLECTIVE_NAMES) + " | load average before / after |")
        print("|---:|---:|" + "---:|" * len(COLLECTIVE_NAMES) + "---|")
        for dp, c in sorted(collectives.items(), key=lambda item: int(item[0])):
            cells = " | ".join(f"{c['seconds'][n]:.3f}" for n in COLLECTIVE_NAMES)
            print(f"| {dp} | {c['bytes'] / 2**20:.1f} | {cells}"
                  + f" | {c['load_average_before']:.1f} / {c['load_average_after']:.1f} |")
    for dp in dps:
        table = comm_table(results, "muon", dp)
        if table:
            print(f"\nCollectives per step, Muon, DP={dp} (calls, payload MB):\n")
            print(table)
    unavailable = payload.get("unavailable", [])
    labels = {key: system.label for key, system in SYSTEMS.items()}
    for dp in sorted({*dps, *(u["dp"] for u in unavailable)}):
        table = zero3_table(results, unavailable, dp, labels)
        if table:
            print(f"\nZeRO-3, Muon, DP={dp}: time and payload MB per step, by collective:\n")
            print(table)
    for optimizer in optimizers:
        for dp in dps:
            table = memory_table(results, dp, list(SYSTEMS), optimizer)
            if table:
                print(f"\nMemory per rank, {optimizer.capitalize()}, DP={dp} (MB, max / average over ranks; "
                      "held between steps, and the peak of a step):\n")
                print(table)
    print()
    for line in checks(results) + zero3_checks(results, unavailable):
        print(line)


def plot_step(payload: dict[str, Any], path: str) -> None:
    """Iteration time per system, grouped by DP, one panel per optimizer."""
    from ...plan.report import _pyplot

    pyplot = _pyplot()
    results = [CaseResult(**r) for r in payload["results"]]
    optimizers = [o for o in BENCH_OPTIMIZERS if any(r.optimizer == o for r in results)]
    figure, axes = pyplot.subplots(1, len(optimizers), figsize=(6.5 * len(optimizers), 3.6), squeeze=False)
    for axis, optimizer in zip(axes[0], optimizers):
        rows = [r for r in results if r.optimizer == optimizer]
        dps = sorted({r.dp for r in rows})
        keys = [k for k in SYSTEMS if any(r.system == k for r in rows)]
        width = 0.8 / len(keys)
        for index, key in enumerate(keys):
            values = []
            for dp in dps:
                cell = [r for r in rows if r.system == key and r.dp == dp]
                values.append((cell[0].iteration_mean_s if optimizer == "shampoo" else cell[0].iteration_s)
                              if cell else 0.0)
            hatch = "" if key.startswith("canzona") else ("//" if key.startswith("deepspeed") else "..")
            axis.bar([d + (index - (len(keys) - 1) / 2) * width for d in range(len(dps))], values, width,
                     label=SYSTEMS[key].label, hatch=hatch)
        axis.set_xticks(range(len(dps)), [f"DP={dp}" for dp in dps])
        axis.set_ylabel("iteration, s" + (" (mean)" if optimizer == "shampoo" else " (median)"))
        axis.set_title(f"{optimizer.capitalize()}: one training iteration, slowest rank", fontsize=9)
        axis.legend(fontsize=6)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    pyplot.close(figure)
