"""What the ZeRO-1/2 runtime does on the wire and in memory, and how it handles overflow."""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from test_zero_stage12 import assert_params_equal, merged_grads, single_process_replay
from zero_workers import instrumented_trains, make_config, train

MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "ns_method": "gram"}}


@pytest.fixture(scope="module")
def dp3_systems():
    """One instrumented run each at DP=3: ds_canzona, DeepSpeed's own Muon, DeepSpeed's AdamW.

    No gradient accumulation: DeepSpeed's stage 2 reduces at every micro-batch, ds_canzona only
    at the boundary, so with accumulation the comparison would flatter us.
    """
    ga1 = {"gradient_accumulation_steps": 1}
    ours = make_config(3, stage=2, optimizer=MUON, **ga1)
    stock_muon = make_config(3, stage=2, optimizer={"type": "Muon", "params": MUON["params"]},
                             canzona={"enabled": False}, **ga1)
    stock_adamw = make_config(3, stage=2, optimizer={"type": "AdamW", "params": {"lr": 0.003, "torch_adam": True}},
                              canzona={"enabled": False}, **ga1)
    runs = run_ranks(instrumented_trains, 3, [ours, stock_muon, stock_adamw], 2, timeout=900)
    return tuple([rank[system] for rank in runs] for system in range(3))


def test_step_runs_no_collective_but_the_norm_and_the_parameter_gathers(dp3_systems):
    ours, _, _ = dp3_systems
    for r in ours:
        step_calls = [(name, n) for phase, name, n in r["calls"] if phase == "step"]
        # Per optimizer step: one all-reduce of per-tensor squared norms (float64, one per
        # tensor: overflow flag and clipping together), then the parameter gathers of each
        # bucket (one padded all-gather, or a broadcast per non-empty segment on gloo).
        names = [name for name, _ in step_calls]
        assert names.count("all_reduce") == 2 and names[0] == "all_reduce"
        second = names.index("all_reduce", 1)
        for one_step in (names[1:second], names[second + 1:]):
            assert one_step and set(one_step) <= {"all_gather_into_tensor", "broadcast"}, one_step
        norm_bytes = [n for name, n in step_calls if name == "all_reduce"]
        assert norm_bytes == [8 * r["n_params"]] * 2
        backward_calls = {name for phase, name, _ in r["calls"] if phase == "backward"}
        assert backward_calls == {"reduce_scatter"}, "gradients are only ever reduce-scattered"


def test_newton_schulz_runs_once_per_owned_matrix_per_step(dp3_systems):
    ours, _, _ = dp3_systems
    owned = [set(r["owned_matrices"]) for r in ours]
    assert sum(len(o) for o in owned) == len(set().union(*owned)), "each matrix has exactly one owner"
    n_matrices = len(set().union(*owned))
    for r, mine in zip(ours, owned):
        assert r["ns_per_step"] == [len(mine)] * 2
    assert sum(r["ns_per_step"][0] for r in ours) == n_matrices


def test_gradient_traffic_equals_adamw_and_deepspeed_muon_moves_more(dp3_systems):
    ours, theirs, adamw = dp3_systems

    def per_step_bytes(results):
        total = {}
        for r in results:
            for phase, name, n in r["calls"]:
                total[name] = total.get(name, 0) + n
        return {k: v / 2 for k, v in total.items()}  # 2 steps

    ours_bytes, theirs_bytes, adamw_bytes = map(per_step_bytes, (ours, theirs, adamw))
    model_bytes = sum(p.numel() * 4 for p in ours[0]["params"].values())
    # Our gradients go through exactly one reduce-scatter of the whole model per step per rank.
    assert ours_bytes["reduce_scatter"] == 3 * model_bytes
    adamw_grad = sum(v for k, v in adamw_bytes.items() if k not in ("all_gather", "all_gather_into_tensor"))
    theirs_grad = sum(v for k, v in theirs_bytes.items() if k not in ("all_gather", "all_gather_into_tensor"))
    # DeepSpeed pads its flat buffers for alignment; allow that and nothing more.
    assert abs(ours_bytes["reduce_scatter"] - adamw_grad) <= 3 * 3 * 2 * 4 * 16, (ours_bytes, adamw_bytes)
    assert theirs_grad > adamw_grad, (theirs_bytes, adamw_bytes)


def test_optimizer_state_is_only_the_owned_tensors_and_half_deepspeeds(dp3_systems):
    ours, theirs, _ = dp3_systems
    for r in ours:
        assert r["state_bytes"] == r["owned_state_bytes"]
    ours_total = sum(r["state_bytes"] for r in ours)
    theirs_total = sum(r["state_bytes"] for r in theirs)
    assert ours_total < theirs_total, (ours_total, theirs_total)


def test_plan_summary_names_every_rank(dp3_systems):
    ours, _, _ = dp3_systems
    summary = ours[0]["plan_summary"]
    assert "cost max/avg" in summary and all(f"rank {r}:" in summary for r in range(3))
    # The runtime's default cost model: roofline, with the CPU's default machine balance.
    assert "cost=roofline:muon(" in summary and "machine_balance=30)" in summary, summary


@pytest.mark.parametrize("ranks", ["all", "owner"])
def test_overflow_skips_the_step_everywhere_and_leaves_state_untouched(ranks):
    world_size, steps, bad_step, name = 2, 4, 2, "layers.0.q_proj.weight"
    config = make_config(world_size, stage=2, optimizer=MUON)
    probe = run_ranks(train, world_size, config, 1, timeout=300)
    owner = next(r for r, res in enumerate(probe) if name in res["owned"])
    inject = {"step": bad_step, "name": name, "ranks": list(range(world_size)) if ranks == "all" else [owner]}
    results = run_ranks(train, world_size, config, steps, inject=inject, timeout=300)
    for res in results:
        assert res["skipped"] == 1
        before, after = res["around_inject"]
        assert before.keys() == after.keys()
        for key in before:
            assert torch.equal(before[key], after[key]) if torch.is_tensor(before[key]) else before[key] == after[key]
    grads = merged_grads(results)
    assert not all(torch.isfinite(g).all() for g in grads[bad_step].values())
    kept = [g for s, g in enumerate(grads) if s != bad_step]
    assert_params_equal(results[0]["params"], single_process_replay(MUON, kept, clip=1.0))


def test_rank_that_owns_nothing_trains_correctly():
    config = make_config(4, stage=2, optimizer=MUON)
    results = run_ranks(train, 4, config, 8, model_name="three", timeout=400)
    assert any(not r["owned"] for r in results)
    from zero_workers import MODELS
    replay = single_process_replay(MUON, merged_grads(results), clip=1.0, model_factory=MODELS["three"])
    assert_params_equal(results[0]["params"], replay)
    losses = results[0]["losses"]
    assert sum(losses[-4:]) < sum(losses[:4])


def test_stage2_releases_gradient_buckets_and_equals_stage1_without_accumulation():
    runs = {stage: run_ranks(train, 2, make_config(2, stage=stage, optimizer=MUON, gradient_accumulation_steps=1),
                             4, timeout=300)
            for stage in (1, 2)}
    assert all(r["grad_buckets_held"] == 0 for r in runs[2])  # nothing held between steps
    # During backward: the bucket being filled plus the reduce-scatters in flight, never all of them.
    from ds_canzona.zero.stage12 import REDUCE_SCATTERS_IN_FLIGHT
    for r in runs[2]:
        assert r["buckets"] > REDUCE_SCATTERS_IN_FLIGHT + 1, r["buckets"]
        assert 1 <= r["grad_buckets_peak"] <= REDUCE_SCATTERS_IN_FLIGHT + 1, r["grad_buckets_peak"]
    assert all(r["grad_buckets_held"] > 0 for r in runs[1])   # stage 1 keeps its buffers
    assert_params_equal(runs[1][0]["params"], runs[2][0]["params"])
    assert_params_equal(runs[2][0]["params"], single_process_replay(MUON, merged_grads(runs[2]), clip=1.0))


def _fp16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().is_fp16_supported()


def _bf16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().is_bf16_supported()


@pytest.mark.skipif(not _bf16_supported(), reason="DeepSpeed's accelerator reports no bf16 on this machine")
@pytest.mark.parametrize("split_numel", [None, 500])
def test_bf16_keeps_fp32_masters_and_trains(split_numel):
    """With pieces too: a piece's fp32 master is a copy of its slice and is written back to it."""
    config = make_config(2, stage=2, optimizer=MUON, bf16={"enabled": True}, canzona={"split_numel": split_numel})
    results = run_ranks(train, 2, config, 8, timeout=300)
    if split_numel:
        assert any("embed_tokens.weight[" in name for r in results for name in r["owned"])
    for r in results:
        assert all(p.dtype == torch.bfloat16 for p in r["params"].values())
        assert r["master_dtypes"] == ["torch.float32"] and r["masters_match_params"]
    losses = results[0]["losses"]
    assert sum(losses[-4:]) < sum(losses[:4])


def test_mismatched_plans_fail_with_a_clear_error_not_a_hang():
    from zero_workers import BASE_CONFIG  # noqa: F401
    with pytest.raises(RuntimeError, match="plans differ across ranks"):
        run_ranks(_different_alpha, 2, timeout=200)


def _different_alpha(rank, world_size):
    from zero_workers import init_engine
    config = make_config(world_size, stage=2, optimizer=MUON, canzona={"alpha": 1.0 if rank == 0 else 0.0})
    init_engine(config)


@pytest.mark.skipif(not _fp16_supported(), reason="DeepSpeed's accelerator reports no fp16 on this machine")
def test_fp16_dynamic_loss_scale_halves_on_overflow_and_grows_after_the_window():
    config = make_config(2, stage=2, optimizer=MUON, gradient_accumulation_steps=1,
                         fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "loss_scale_window": 2,
                               "hysteresis": 1})
    for scales, skipped in run_ranks(_fp16_scale_trace, 2, config, timeout=300):
        # 2**8 to start; the poisoned first step halves it and is skipped; two clean steps later
        # (the window) it doubles back.
        assert scales[:5] == [256, 128, 128, 128, 256] and skipped == 1


def _fp16_scale_trace(rank, world_size, config):
    from tiny_model import batches
    from zero_workers import _poison, init_engine
    engine = init_engine(config)
    scales = [engine.optimizer.loss_scale]
    for step in range(5):
        loss = engine(batches(step, 0, rank, world_size).to(engine.device))
        handle = None
        if step == 0:
            handle = next(engine.module.parameters()).register_hook(_poison)
        engine.backward(loss)
        if handle:
            handle.remove()
        engine.step()
        scales.append(engine.optimizer.loss_scale)
    return scales, engine.skipped_steps


def test_dynamic_loss_scale_and_overflow_without_fp16():
    """The loss-scale path of the optimizer, on any machine: fp32 with DeepSpeed's dynamic scaler.

    DeepSpeed builds a dynamic scaler for fp16 only, and fp16 needs the accelerator to support it
    (the test above); the scaling, unscaling, overflow skip and scale schedule are the optimizer's
    own arithmetic whatever the dtype, so here an fp32 engine gets the same ``DynamicLossScaler``
    fp16 would. Multiplying the loss by a power of two and dividing the gradients by it is exact in
    fp32, so the parameters must equal, bit for bit, those of the unscaled run that skips the same
    poisoned step (gradient accumulation 2, the poison on the boundary micro-batch of step 0).
    """
    config = make_config(2, stage=2, optimizer=MUON)
    scaled, unscaled = run_ranks(_scaled_and_unscaled, 2, config, timeout=300)[0]
    # 2**8 to start; the poisoned first step halves it and is skipped; two clean steps later (the
    # window) it doubles back. The unscaled run skips the same step.
    assert scaled["scales"][:5] == [256, 128, 128, 128, 256] and scaled["skipped"] == 1
    assert unscaled["scales"] == [1] * 6 and unscaled["skipped"] == 1
    assert_params_equal(scaled["params"], unscaled["params"])
    assert not torch.equal(scaled["params"]["lm_head.weight"], scaled["initial"]["lm_head.weight"])


def _scaled_and_unscaled(rank, world_size, config):
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from tiny_model import batches
    from zero_workers import _poison, init_engine

    runs = []
    for dynamic in (True, False):
        engine = init_engine(config)
        zero = engine.optimizer
        if dynamic:
            zero.loss_scaler = DynamicLossScaler(init_scale=2**8, scale_window=2, min_scale=1, delayed_shift=1,
                                                 consecutive_hysteresis=False, dtype=torch.float32)
            zero.dynamic_loss_scale = True
        initial = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
        scales = [zero.loss_scale]
        for step in range(5):
            for micro in range(engine.gradient_accumulation_steps()):
                loss = engine(batches(step, micro, rank, world_size))
                last = micro == engine.gradient_accumulation_steps() - 1
                handle = next(engine.module.parameters()).register_hook(_poison) if step == 0 and last else None
                engine.backward(loss)
                if handle:
                    handle.remove()
                engine.step()
            scales.append(zero.loss_scale)
        runs.append({"scales": scales, "skipped": engine.skipped_steps, "initial": initial,
                     "params": {n: p.detach().clone() for n, p in engine.module.named_parameters()}})
    return runs


def _lr_traces(rank, world_size):
    import deepspeed
    import ds_canzona
    from ds_canzona.zero.stage12 import CanzonaZeroOptimizer
    from tiny_model import batches, make_model

    traces = {}
    config = make_config(world_size, stage=1, optimizer=MUON,
                         scheduler={"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 0.01,
                                                                    "warmup_num_steps": 3, "warmup_type": "linear"}})
    engine, *_ = deepspeed.initialize(model=make_model(), config=config)
    traces["config"] = _run_lrs(engine, rank, world_size, batches)

    model = make_model()
    client = ds_canzona.optim.Muon(list(model.named_parameters()), lr=0.02, adam_lr=0.002)
    config = make_config(world_size, stage=2)
    del config["optimizer"]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=client, config=config,
        lr_scheduler=lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)))
    assert isinstance(engine.optimizer, CanzonaZeroOptimizer) and engine.optimizer.optimizer is client
    traces["client"] = _run_lrs(engine, rank, world_size, batches)
    return traces


def _run_lrs(engine, rank, world_size, batches):
    lrs = []
    for step in range(4):
        for micro in range(engine.gradient_accumulation_steps()):
            engine.backward(engine(batches(step, micro, rank, world_size)))
            engine.step()
        lrs.append(engine.get_lr())
    return lrs


def test_lr_schedulers_from_the_config_and_client_optimizers_and_schedulers():
    traces = run_ranks(_lr_traces, 2, timeout=300)[0]
    # WarmupLR sets every group (Muon's and AdamW's) to the same warm-up value, as it does for
    # DeepSpeed's own Muon.
    config_lrs = [lrs[0] for lrs in traces["config"]]
    assert config_lrs == sorted(config_lrs) and config_lrs[-1] == pytest.approx(0.01)
    # A client LambdaLR scales each group's own initial lr.
    expected = [[0.02 / (1 + s), 0.002 / (1 + s)] for s in range(1, 5)]
    for got, want in zip(traces["client"], expected):
        assert got == pytest.approx(want)
