"""Stream order of the ZeRO runtimes, checked on the CPU against a stream-recording stand-in accelerator.

On the CPU every stream, event and wait is a no-op, so no ordering mistake can show in the other
tests. Here DeepSpeed's engines run with ``tests/stream_standin.py``'s accelerator, which reports
real streams and models CUDA's and NCCL's order (see that module), in one process acting as rank 0
of a 4-rank world on torch's fake process group (``tests/fake_world.py``). Every torch operation
and collective of two optimizer steps with two micro-batches each is recorded with its stream, and
the run must show no access to a tensor storage unordered with a conflicting one on another stream
or collective (every bucket, every reduce to an owner, every fetch of a shard, every micro-group
of the TP exchange), no storage freed while another stream may still use it, and no
``work.wait()`` inside backward with a compute stream current.

Cases: ZeRO stages 1, 2 and 3 at DP=4, and AutoTP at TP=2 x DP=2 (stage 2), each on one stream
and with "compile streams". torch.compile on a GPU runs backward ops on streams of its own, and
autograd runs a parameter's hooks on the stream of the op that produced its gradient; on the CPU
inductor uses no streams at all (a real compile exercises no other stream here), so that is
simulated: every other parameter's gradient is produced on a second compute stream of the
stand-in, and its hook runs there (``StreamModel.gradient_from``). Stages 2 and 3 also run with
``communication_data_type`` bf16 and a predivide factor (the conversion and division on the
reduction stream, the converted copy released). The fake backend is not gloo, so the stage-1/2
buckets take the cost model's form, grouped here (a reduce per non-empty segment in one grouped
launch, the owner's sum copied out at the wait, and a broadcast per non-empty segment); three
cases force the padded form (staged through padded buffers on the reduction stream, an in-place
all-gather), one the grouped. The parameters' all-gathers go out per gather group (the default
two; every bucket in one group in two cases), on the reduction stream after the compute stream's
writes into every bucket of the group; with one compute stream writing all of them, a wait for
fewer than all the group's buckets would not show here as a race. Stage 3
runs the collectives a backend other than gloo gets (the fake one included): priced by default
(one operation per launch: a lone piece's broadcast or reduce, else an all-reduce here), grouped
in one case and padded in one, with the small tensors persistent (refreshed on the compute stream after each
step) and gradient buckets that launch inside backward. The process is rank 0 of the world: at
DP=4 it owns some items and not others, so it is both a sender and an owner.

Three cases offload the optimizer (stages 2 and 3, page-locked and pageable host memory): the
stand-in gives host memory the host's timeline (``stream_standin``), so the copy stream's
asynchronous copies, the event the compute stream waits for, and the host's reads (the AdamW
items, and a read of every master after each step, as a checkpoint save does) are checked too.

One stage-3 case gives every third parameter two gradients per backward, each from its own
compute stream (reentrant checkpointing; the runtime sums them on the second stream and drops the
first, with ``record_stream`` on the second stream).

The control cases run the same engines with the stream order switched off (``streams_are_real``
false: the plain waits on the current stream that the runtimes did before they stated any order)
and must show violations, so the checker is shown to see the hazards this code would have; the
two-gradient control drops the first gradient without its ``record_stream`` and must show it
freed while in use; the offload controls skip the copy stream's synchronize and the wait for a
wave's event, and must show the races they open. The
first tests check the checker itself on hand-made orders.

One spawned process runs every case (about 25 s here); the checker tests run in the test process.
"""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_ranks

RANK, WORLD = 0, 4
STEPS, GA = 2, 2
NUMERICS = {"communication_data_type": "bf16", "gradient_predivide_factor": 2.0}
# Stage 3 on the fake backend (not gloo) takes the priced collectives by default (one operation per
# launch), or the grouped or padded ones where named (ds_canzona.zero.stage3_comm): the norms and
# biases (24 elements) persistent, the matrices fetched per module, gradients in buckets small
# enough that several launch inside backward.
OFFLOAD_PINNED = {"device": "cpu", "pin_memory": True}
STAGE3_PERSISTENCE_THRESHOLD = 100
STAGE3_BUCKET = 600

CASES = {
    "stage1": {"stage": 1},
    # The fake backend is not gloo: by default the cost model picks the buckets' forms, grouped here
    # (one to a few owners per bucket at DP=4); the padded form is forced where named.
    "stage1_padded_compile_streams": {"stage": 1, "compile_streams": True, "canzona": {"collectives": "padded"}},
    "stage2": {"stage": 2},
    "stage2_padded_compile_streams": {"stage": 2, "compile_streams": True, "canzona": {"collectives": "padded"}},
    "stage2_compile_streams_bf16_communication": {"stage": 2, "compile_streams": True, "config": NUMERICS},
    "stage2_padded_compile_streams_bf16_communication": {"stage": 2, "compile_streams": True, "config": NUMERICS,
                                                         "canzona": {"collectives": "padded"}},
    "stage2_compile_streams_grouped": {"stage": 2, "compile_streams": True, "canzona": {"collectives": "grouped"}},
    # Every bucket in one gather group: one launch after the whole update, whose side stream must wait for the
    # compute stream's writes into all the buckets (the other cases run the default two groups).
    "stage2_compile_streams_one_gather_group": {"stage": 2, "compile_streams": True,
                                                "canzona": {"collectives": "grouped", "all_gather_groups": 1}},
    "stage1_padded_one_gather_group": {"stage": 1, "canzona": {"collectives": "padded", "all_gather_groups": 1}},
    "stage3": {"stage": 3},
    "stage3_compile_streams": {"stage": 3, "compile_streams": True},
    "stage3_compile_streams_bf16_communication": {"stage": 3, "compile_streams": True, "config": NUMERICS},
    "stage3_grouped_compile_streams": {"stage": 3, "compile_streams": True, "collectives": "grouped"},
    "stage3_padded_compile_streams_bf16_communication": {"stage": 3, "compile_streams": True, "config": NUMERICS,
                                                         "collectives": "padded"},
    # Optimizer offload, page-locked: matrices staged through the copy stream, the rest on the host.
    "stage2_offload_pinned": {"stage": 2, "zero": {"offload_optimizer": OFFLOAD_PINNED}},
    "stage3_offload_pinned_compile_streams": {"stage": 3, "compile_streams": True,
                                              "zero": {"offload_optimizer": OFFLOAD_PINNED}},
    "stage2_offload_pageable": {"stage": 2, "zero": {"offload_optimizer": {"device": "cpu", "pin_memory": False}}},
    # A parameter with two gradients in one backward (reentrant checkpointing), each from its own stream.
    "stage3_two_gradients_two_streams": {"stage": 3, "two_gradients": True},
    "control_stage2_compile_streams": {"stage": 2, "compile_streams": True, "unordered": True},
    # Nothing persistent: the small AdamW tensors an owner updates are fetched on DeepSpeed's stream.
    "control_stage3": {"stage": 3, "unordered": True, "persistence_threshold": 0},
    # Offload without the copy stream's synchronize at the end of the update (the host then reads
    # masters still being copied back), and without the compute stream's wait for a wave's copies.
    "control_stage2_offload_no_copy_sync": {"stage": 2, "zero": {"offload_optimizer": OFFLOAD_PINNED},
                                            "offload_control": "no_copy_sync"},
    "control_stage2_offload_no_event_wait": {"stage": 2, "zero": {"offload_optimizer": OFFLOAD_PINNED},
                                             "offload_control": "no_event_wait"},
    # The same two gradients, the earlier one dropped on the second stream with no record_stream.
    "control_stage3_two_gradients_unread": {"stage": 3, "two_gradients": True, "unread": True},
    # Last: DeepSpeed keeps the TP mesh of the first AutoTP engine for the rest of the process.
    "autotp": {"stage": 2, "tp": 2},
    "autotp_compile_streams": {"stage": 2, "tp": 2, "compile_streams": True},
}


# --------------------------------------------------------------------------- rank side (one spawned process)
def _engine(case: dict):
    """(engine, micro-batch function, loss function) for a case, on rank 0 of the fake world."""
    if case.get("tp"):
        import tp_workers
        config = tp_workers.ds_config(tp=case["tp"], dp=WORLD // case["tp"], stage=case["stage"], ga=GA, canzona={},
                                      optimizer={"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003}})
        engine = tp_workers._initialize(config, tp_workers.make_qwen3())
        return engine, lambda step, micro: tp_workers.tokens(step, micro, RANK // case["tp"]), tp_workers.lm_loss
    import zero_workers
    from tiny_model import batches
    config = zero_workers.make_config(WORLD, stage=case["stage"], gradient_accumulation_steps=GA,
                                      canzona=case.get("canzona"), **case.get("config", {}))
    config["zero_optimization"].update(case.get("zero", {}))
    if case["stage"] == 3:
        config["zero_optimization"]["stage3_param_persistence_threshold"] = case.get("persistence_threshold",
                                                                                     STAGE3_PERSISTENCE_THRESHOLD)
        config["zero_optimization"]["reduce_bucket_size"] = STAGE3_BUCKET
        config["canzona"]["collectives"] = case.get("collectives", "default")
    engine = zero_workers.init_engine(config)
    return engine, lambda step, micro: batches(step, micro, RANK, WORLD), lambda engine, batch: engine(batch)


def _hooks_on_side_stream(model, zero) -> list[int]:
    """Every other parameter's gradient produced on a second compute stream, its hook run there; returns a counter."""
    side = model.compute_stream("compiled backward stream")
    runs = [0]
    for i, param in enumerate(zero.params):
        if i % 2 == 0:
            continue
        zero._hook_handles[i].remove()
        hook = zero._make_grad_hook(i)

        def on_side(p, hook=hook):
            runs[0] += 1
            with model.gradient_from(side, p):
                hook(p)

        zero._hook_handles[i] = param.register_post_accumulate_grad_hook(on_side)
    return runs


def _gradients_twice_on_two_streams(model, zero) -> list[int]:
    """Every third parameter gets two gradients per backward, the first on one compute stream, the second on another.

    What reentrant activation checkpointing does to a parameter used in two checkpointed segments
    (stage 3 sums them on the rank before the reduce), with each gradient from its own stream (as
    torch.compile's backward may run them); returns a counter of second arrivals.
    """
    first, second = model.compute_stream("first gradient's stream"), model.compute_stream("second gradient's stream")
    # The runtime's state once it has seen a second gradient: reduces wait for the end of backward
    # (with early launches the first arrival could send the tensor before its second gradient).
    zero.early_launch = False
    runs = [0]
    for i, param in enumerate(zero.params):
        if i % 3 != 1:
            continue
        zero._hook_handles[i].remove()
        hook = zero._make_grad_hook(i)

        def twice(p, hook=hook):
            again = p.grad.detach().clone()
            with model.gradient_from(first, p):
                hook(p)
            p.grad = again
            runs[0] += 1
            with model.gradient_from(second, p):
                hook(p)

        zero._hook_handles[i] = param.register_post_accumulate_grad_hook(twice)
    return runs


def _stage3_buckets(zero) -> list[list[int]]:
    """Stage 3's gradient buckets per backward, as the items each reduces: tensors last first, a bucket closed
    once it holds the bucket size."""
    buckets, items, held = [], [], 0
    for tensor in reversed(range(len(zero.logical_shapes))):
        items += zero.plan.tensor_items()[tensor]
        held += math.prod(zero.logical_shapes[tensor])
        if held >= zero.reduce_bucket_numel:
            buckets, items, held = buckets + [items], [], 0
    return buckets + ([items] if items else [])


# What one stage-3 launch of each form issues: one collective, or (grouped) one per piece.
STAGE3_REDUCE = {"padded": "reduce_scatter_tensor", "allreduce": "all_reduce"}
STAGE3_FETCH = {"grouped": "broadcast", "padded": "all_gather_into_tensor", "allreduce": "all_reduce"}


def _stage3_refresh_form(zero) -> str:
    """The form of the persistent parameters' refresh after the step (one fetch of all of them)."""
    from ds_canzona.zero.owner_placement import PIECES_ATTR

    pieces = [(stop - start, owner) for p in zero.parameter_offload.persistent_parameters
              for start, stop, owner in getattr(p, PIECES_ATTR, ())]
    return zero.layout.launch_form(pieces, zero.params[0].ds_tensor.element_size())


def _expected(zero, case: dict) -> dict:
    """What the reduction stream must have issued in the run: one collective per bucket (or item) and reduction.

    A bucket's reduce-scatter is one ``reduce`` per non-empty segment (grouped, on a backend that is
    not gloo, the fake one included) or one ``reduce_scatter_tensor`` (padded).
    """
    if case["stage"] == 3:
        expected = {}
        for items in _stage3_buckets(zero):
            form = zero.layout.launch_form([(zero.plan.specs[i].numel, zero.plan.owner[i]) for i in items],
                                           zero.reduction.communicate_dtype.itemsize)
            kind, count = (STAGE3_REDUCE[form], 1) if form in STAGE3_REDUCE else ("reduce", len(items))
            expected[kind] = expected.get(kind, 0) + count * STEPS * GA
        return expected
    forms, cuts = zero.collective_forms.reduce_scatter, zero.layout.bucket_cuts
    padded = sum(form == "padded" for form in forms)
    reduces = sum(sum(b > a for a, b in zip(c, c[1:])) for c, form in zip(cuts, forms) if form == "grouped")
    expected = {"reduce": reduces * STEPS, "reduce_scatter_tensor": padded * STEPS}
    return {kind: count for kind, count in expected.items() if count}


def _expected_gathers(zero) -> dict:
    """Stages 1/2: the all-gathers the reduction stream must have issued, per kind (a broadcast per non-empty segment
    of a grouped bucket, an all_gather_into_tensor per padded one, each step), and the launches (per gather group,
    one per form its buckets take)."""
    from ds_canzona.plan.gather_groups import all_gather_launches

    forms, cuts = zero.collective_forms.all_gather, zero.layout.bucket_cuts
    broadcasts = sum(sum(b > a for a, b in zip(c, c[1:])) for c, form in zip(cuts, forms) if form == "grouped")
    gathers = {"broadcast": broadcasts * STEPS, "all_gather_into_tensor": sum(f == "padded" for f in forms) * STEPS}
    return {"calls": {kind: count for kind, count in gathers.items() if count},
            "launches": all_gather_launches(zero.gather_groups, forms, zero.world_size) * STEPS,
            "groups": len(zero.gather_groups), "buckets": len(cuts)}


def _run_case(case: dict) -> dict:
    import ds_canzona.zero.streams as streams
    from stream_standin import install_stream_model

    real = streams.streams_are_real
    if case.get("unordered"):
        streams.streams_are_real = lambda: False
    try:
        with install_stream_model() as model:
            engine, batch, loss_of = _engine(case)
            zero = engine.optimizer
            side_runs = _hooks_on_side_stream(model, zero) if case.get("compile_streams") else [0]
            if case.get("two_gradients"):
                side_runs = _gradients_twice_on_two_streams(model, zero)
            if case.get("unread"):  # the control: the earlier gradient dropped without its record_stream
                zero.streams.read_here = lambda *tensors: None
            if case.get("offload_control") == "no_copy_sync":  # the host reads the masters before the copies end
                zero.offload._copy_stream.synchronize = lambda: None
            if case.get("offload_control") == "no_event_wait":  # the update reads a wave before it arrived
                stage_in = zero.offload._stage_in
                zero.offload._stage_in = lambda wave: (stage_in(wave)[0], None)
            for step in range(STEPS):
                for micro in range(GA):
                    engine.backward(loss_of(engine, batch(step, micro)))
                    engine.step()
                if case.get("zero", {}).get("offload_optimizer"):
                    # What a checkpoint save does after a step: the host reads every owned master and state.
                    for owned in zero.owned_tensors():
                        float(owned.master.sum())
                        for value in owned.state.values():
                            if torch.is_tensor(value) and value.numel():
                                float(value.float().sum())
            reduction = getattr(getattr(zero, "streams", None), "side", None)
            result = {
                "violations": list(model.violations),
                "collectives": {f"{kind} on {stream}": n for (kind, stream), n in model.collectives.items()},
                "reduction_stream": reduction.timeline.name if reduction is not None else None,
                "expected": _expected(zero, case),
                "side_hook_runs": side_runs[0],
                "stream_calls": dict(model.events),
            }
            if case["stage"] == 3:
                result["mode"], result["refresh_form"] = zero.collectives, _stage3_refresh_form(zero)
            if getattr(zero, "offload", None) is not None:
                result["offload"] = {"pinned": zero.offload.pinned, "to_device": zero.offload.counter.total_to_device,
                                     "to_host": zero.offload.counter.total_to_host}
            if case["stage"] in (1, 2) and not case.get("tp"):
                result["expected_gathers"] = _expected_gathers(zero)
                result["gather_launches"] = zero.comm.calls["all_gather"]
            if case.get("tp"):
                # The masters' gather at start-up (one per micro-group), then each step's exchange.
                groups = len(zero.exchange.groups)
                result["expected"]["all_to_all_single"] = groups + STEPS * zero.exchange.launches_per_step(groups)
    finally:
        streams.streams_are_real = real
    return result


def stream_order_runs(rank: int, world_size: int, names: list[str]) -> dict[str, dict]:
    from fake_world import fake_world

    with fake_world(RANK, WORLD):
        return {name: _run_case(CASES[name]) for name in names}


# --------------------------------------------------------------------------- the checker itself
@pytest.fixture
def model():
    """The stand-in installed in this process, for hand-made orders (no process group needed)."""
    from stream_standin import install_stream_model

    with install_stream_model() as installed:
        yield installed
    assert "record_stream" not in torch.Tensor.__dict__  # torch's own again, for the tests after this one


def test_checker_sees_an_unordered_read_and_accepts_a_wait(model):
    from deepspeed.accelerator import get_accelerator

    side = model.new_stream("side")
    x, y, z = torch.zeros(8), torch.zeros(8), torch.zeros(8)
    side.wait_stream(model.default)  # after the allocations
    with model.on_stream(side):
        x.add_(1)
    _ = x * 2  # the default stream reads what the side stream wrote, unordered
    assert len(model.violations) == 1 and model.violations[0].startswith("race: mul on default"), model.violations

    with model.on_stream(side):
        y.add_(1)
    model.default.wait_stream(side)
    _ = y * 2
    with model.on_stream(side):
        z.add_(1)
        marker = get_accelerator().Event()
        marker.record()  # on the current stream: the side stream
    model.default.wait_event(marker)
    _ = z * 2
    assert len(model.violations) == 1, model.violations


def test_checker_sees_memory_freed_under_another_stream(model):
    side = model.new_stream("side")
    x, y = torch.zeros(16), torch.zeros(16)  # allocated on the default stream
    side.wait_stream(model.default)
    with model.on_stream(side):
        x.mul_(2)
    del x
    torch.ones(1)  # the next event: the allocator would have handed the memory out
    assert len(model.violations) == 1 and model.violations[0].startswith("freed while in use"), model.violations
    with model.on_stream(side):
        y.mul_(2)
    y.record_stream(side)
    del y
    torch.ones(1)
    assert len(model.violations) == 1, model.violations


def test_checker_orders_collectives_and_sees_waits_in_backward(model):
    side = model.new_stream("side")
    t = torch.ones(4)
    side.wait_stream(model.default)
    with model.on_stream(side):
        t.mul_(3)
    work = torch.distributed.all_reduce(t, async_op=True)  # issued on the default stream: not after the side write
    assert model.violations[-1].startswith("race: all_reduce"), model.violations
    with model.on_stream(side):
        work.wait()
    _ = t + 1  # the default stream did not wait for the collective
    assert len(model.violations) == 2 and model.violations[-1].startswith("race: add on default"), model.violations
    model.default.wait_stream(side)
    _ = t + 2
    assert len(model.violations) == 2

    u = torch.ones(4)
    param = torch.nn.Parameter(torch.ones(3))

    def hook(p):
        torch.distributed.all_reduce(u, async_op=True).wait()

    param.register_post_accumulate_grad_hook(hook)
    (param * 2).sum().backward()
    assert model.violations[-1].startswith("compute waits in backward"), model.violations


# --------------------------------------------------------------------------- the runtimes
@pytest.fixture(scope="module")
def runs() -> dict[str, dict]:
    (result,) = run_ranks(stream_order_runs, 1, list(CASES), timeout=900)
    return result


ORDERED = [name for name in CASES if not name.startswith("control_")]


@pytest.mark.parametrize("name", ORDERED)
def test_runtime_orders_every_collective_and_buffer(runs, name):
    run = runs[name]
    assert run["violations"] == [], "\n".join(run["violations"])
    # The run did what it is checked for: every reduction on the reduction stream (none elsewhere),
    # and, with compile streams, the second stream's hooks ran.
    for kind, count in run["expected"].items():
        if kind == "all_to_all_single":
            assert run["collectives"].get(f"{kind} on default (compute)") == count, run["collectives"]
            continue
        assert run["collectives"].get(f"{kind} on {run['reduction_stream']}") == count, run["collectives"]
        if kind != "all_reduce":  # (the norm's, and at stage 3 an all-reduced refresh, run on the compute stream)
            assert sum(n for key, n in run["collectives"].items() if key.startswith(f"{kind} on ")) == count
    if name.startswith(("stage1", "stage2")):  # the form each case is meant to check
        padded = CASES[name].get("canzona", {}).get("collectives") == "padded"
        assert set(run["expected"]) == {"reduce_scatter_tensor" if padded else "reduce"}
    if "expected_gathers" in run:  # stages 1/2: every gather group's all-gathers on the reduction stream
        gathers = run["expected_gathers"]
        for kind, count in gathers["calls"].items():
            # (DeepSpeed's start-up broadcasts of the model run on the compute stream: only the side stream's count.)
            assert run["collectives"].get(f"{kind} on {run['reduction_stream']}") == count, run["collectives"]
        assert gathers["buckets"] > gathers["groups"] >= 1  # several buckets share a launch
        assert run["gather_launches"] == gathers["launches"]
    if CASES[name].get("compile_streams") or CASES[name].get("two_gradients"):
        assert run["side_hook_runs"] > 0
    if CASES[name]["stage"] == 3:
        assert run["mode"] == CASES[name].get("collectives", "priced")
        # Priced: a module fetch of one matrix is its broadcast, as grouped's.
        fetch = "all_gather_into_tensor" if run["mode"] == "padded" else "broadcast"
        fetch_streams = {key for key in run["collectives"] if key.startswith(f"{fetch} on stream")}
        assert fetch_streams, run["collectives"]  # DeepSpeed's all-gather stream fetched the shards
        # The persistent parameters' refresh after each step, on the compute stream (priced: all-reduced here).
        refresh = STAGE3_FETCH[run["refresh_form"]]
        assert run["mode"] != "priced" or refresh == "all_reduce"
        assert run["collectives"].get(f"{refresh} on default (compute)", 0) >= STEPS, run["collectives"]


@pytest.mark.parametrize("name", [name for name, case in CASES.items() if case.get("unordered")])
def test_without_stream_order_the_same_runs_have_hazards(runs, name):
    violations = runs[name]["violations"]
    assert any(v.startswith("compute waits in backward") for v in violations), violations
    assert any(v.startswith("race") for v in violations), violations


def test_an_earlier_gradient_dropped_on_another_stream_without_record_stream_is_caught(runs):
    """The control of the two-gradient case: without ``StreamOrder.read_here`` the first gradient's memory goes
    back to its stream's pool while the second stream's sum may still read it."""
    violations = runs["control_stage3_two_gradients_unread"]["violations"]
    freed = [v for v in violations if v.startswith("freed while in use")]
    assert freed and all("first gradient's stream" in v for v in freed), violations
    assert runs["stage3_two_gradients_two_streams"]["violations"] == []


def test_offload_copies_are_ordered_on_pinned_and_pageable_host_memory(runs):
    """Offloaded masters and state: page-locked on the stand-in (its accelerator pins), bytes both ways, no hazard."""
    for name in ("stage2_offload_pinned", "stage3_offload_pinned_compile_streams", "stage2_offload_pageable"):
        offload = runs[name]["offload"]
        assert offload["pinned"] == (name != "stage2_offload_pageable"), name
        assert offload["to_device"] > 0 and offload["to_host"] > 0, name
        assert runs[name]["violations"] == [], "\n".join(runs[name]["violations"])


def test_offload_controls_show_the_hazards_of_a_missing_synchronize_and_event_wait(runs):
    """Without the copy stream's synchronize the host's read of a master races its copy back; without the event
    the update reads a staged wave before its copy in ended."""
    no_sync = runs["control_stage2_offload_no_copy_sync"]["violations"]
    assert any(v.startswith("race") and "on host" in v and "copy_" in v for v in no_sync), no_sync
    no_wait = runs["control_stage2_offload_no_event_wait"]["violations"]
    assert any(v.startswith("race") and "default (compute)" in v and "copy_" in v for v in no_wait), no_wait
