"""``bench collectives`` counts what the runtimes issue, checked against counts taken from the runtimes' own plans.

One spawned process (rank 0 of a fake world of 8 ranks, about 30 s here) builds, on the tiny Qwen3
config, ds_canzona's ZeRO-2 engine and DeepSpeed's own ZeRO-2 Muon engine, first with real tensors
and then under FakeTensorMode, and records the collectives of steps 2 and 3 of each.

What each count must be is derived from the engine, not from the recorder:

- ds_canzona: per bucket of its plan one reduce-scatter launch, in the form the runtime chose for
  the bucket (``collective_forms``): grouped, one ``reduce`` per non-empty segment of the bucket's
  cuts inside one coalesced launch, carrying the bucket's bytes; padded, one
  ``reduce_scatter_tensor`` over P slots of the largest segment; per gather group
  (``gather_groups``) one launch per all-gather form its buckets take: the grouped buckets'
  ``broadcast`` per non-empty segment, the padded buckets' ``all_gather_into_tensor``; plus the one
  all-reduce of the per-item squared norms;
- DeepSpeed: one all-gather per parameter group of its flat bf16 buffers (``bit16_groups_flat``),
  carrying those buffers; its gradients are all-reduced, each once, so the all-reduces above a few
  bytes carry the model's gradients in bf16.

The fake-tensor run must record exactly what the real one does, call for call, and step 3 exactly
what step 2 did (the counted step is a steady state).
"""

from __future__ import annotations

from pathlib import Path

from distributed import run_ranks

WORLD = 8
TINY = str(Path(__file__).resolve().parents[1] / "examples" / "configs" / "qwen3-tiny.json")
BUCKET_NUMEL = 4000  # a few buckets on the tiny model


def _expected_canzona(engine) -> dict:
    """Per kind of call: (calls, launches, NCCL operations, payload bytes), from the plan's cuts and forms."""
    zero = engine.optimizer
    expected: dict[str, list[int]] = {}

    def add(kind, calls, ops, payload):
        row = expected.setdefault(kind, [0, 0, 0, 0])
        row[0] += calls
        row[1] += 1  # one launch: a grouped form's calls go out as one coalesced block
        row[2] += ops
        row[3] += payload

    def sizes(b):
        cuts = zero.layout.bucket_cuts[b]
        return [cuts[r + 1] - cuts[r] for r in range(WORLD)]

    for b in range(len(zero.plan.buckets)):
        nonempty = sum(1 for size in sizes(b) if size)
        if zero.collective_forms.reduce_scatter[b] == "grouped":
            add("reduce", nonempty, nonempty, sum(sizes(b)) * 2)  # bf16 gradients
        else:
            add("reduce_scatter_tensor", 1, 1, WORLD * max(sizes(b)) * 2)
    # The all-gathers: per gather group one launch per form its buckets take.
    for group in zero.gather_groups:
        grouped = [b for b in group if zero.collective_forms.all_gather[b] == "grouped"]
        padded = [b for b in group if zero.collective_forms.all_gather[b] == "padded"]
        if grouped:
            nonempty = sum(1 for b in grouped for size in sizes(b) if size)
            add("broadcast", nonempty, nonempty, sum(sum(sizes(b)) for b in grouped) * 2)  # bf16 parameters
        if padded:
            add("all_gather_into_tensor", len(padded), len(padded), sum(WORLD * max(sizes(b)) for b in padded) * 2)
    return {kind: tuple(row) for kind, row in expected.items()}


def _gather_launches(engine) -> int:
    from ds_canzona.plan.gather_groups import all_gather_launches

    zero = engine.optimizer
    return all_gather_launches(zero.gather_groups, zero.collective_forms.all_gather, WORLD)


def _expected_deepspeed(engine) -> dict:
    flats = engine.optimizer.bit16_groups_flat
    gradients = sum(p.numel() for p in engine.module.parameters() if p.requires_grad) * 2
    return {"all_gather_into_tensor": (len(flats), len(flats), sum(f.numel() * f.element_size() for f in flats)),
            "gradient_all_reduce_payload": gradients}


def _signature(calls) -> list[tuple]:
    return [(c.kind, c.group_size, c.launches, c.p2p_ops, c.payload, c.sent) for c in calls]


def count_both(rank: int, world_size: int) -> dict:
    import ds_canzona  # noqa: F401  (installs the engine hook)
    from ds_canzona.bench.collective_log import CollectiveLog
    from ds_canzona.bench.collectives import build_engine, count_steps, summarise
    from ds_canzona.bench.fake_engine import fake_tensors
    from ds_canzona.bench.fake_world import fake_world

    log = CollectiveLog().install()
    out = {}
    with fake_world(0, WORLD):
        for system in ("canzona", "deepspeed"):
            for fake in (False, True):
                with fake_tensors(enabled=fake):
                    engine = build_engine(system, 2, WORLD, {"hf_config": TINY}, bucket_numel=BUCKET_NUMEL)
                    steps = count_steps(engine, log, stage=2, steps=3)
                    expected = (_expected_canzona if system == "canzona" else _expected_deepspeed)(engine)
                    numel = sum(p.numel() for p in engine.module.parameters())
                    summary = summarise(steps[0][0], stage=2, model_numel=numel, param_bytes=2, comm_bytes=2,
                                        stated_padding=0)
                    engine.destroy()
                out[(system, fake)] = {"steps": [_signature(calls) for calls, _ in steps], "expected": expected,
                                       "summary": summary,
                                       "buckets": len(engine.optimizer.plan.buckets) if system == "canzona" else None,
                                       "gather_launches": _gather_launches(engine) if system == "canzona" else None,
                                       "norm_sized": [c.payload for c in steps[0][0] if c.kind == "all_reduce"]}
    return out


def test_counts_match_the_plans_and_fake_tensors_match_real_ones():
    [out] = run_ranks(count_both, 1, env={"TORCHDYNAMO_DISABLE": "1"}, timeout=600)

    for system in ("canzona", "deepspeed"):
        real, fake = out[(system, False)], out[(system, True)]
        assert real["steps"][0] == real["steps"][1], f"{system}: step 3 differs from step 2"
        assert fake["steps"] == real["steps"], f"{system}: FakeTensorMode recorded other collectives"

    canzona = out[("canzona", False)]
    kinds = canzona["summary"]["by_kind"]
    expected = canzona["expected"]
    for kind, (calls, launches, ops, payload) in expected.items():
        got = kinds[kind]
        assert (got["calls"], got["launches"], got["p2p_ops"], got["payload"]) == (calls, launches, ops, payload), kind
    assert kinds["all_reduce"]["calls"] == 1  # the per-item squared norms
    assert set(kinds) == set(expected) | {"all_reduce"}
    assert canzona["summary"]["launches"] == canzona["buckets"] + canzona["gather_launches"] + 1
    if set(expected) == {"reduce", "broadcast"}:
        assert canzona["summary"]["padding"] == 0  # uneven segments, no padded form: no padding

    deepspeed = out[("deepspeed", False)]
    kinds = deepspeed["summary"]["by_kind"]
    calls, ops, payload = deepspeed["expected"]["all_gather_into_tensor"]
    gather = kinds["all_gather_into_tensor"]
    assert (gather["calls"], gather["p2p_ops"], gather["payload"]) == (calls, ops, payload)
    # The norm and overflow all-reduces are a few bytes; the rest are the gradients, each once.
    gradients = sum(size for size in deepspeed["norm_sized"] if size > 16)
    assert gradients == deepspeed["expected"]["gradient_all_reduce_payload"]
