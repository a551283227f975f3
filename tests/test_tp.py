"""DeepSpeed AutoTP with ZeRO-1/2 (ds_canzona/zero/tp.py): a sharded matrix gets the whole-matrix update.

Three spawned runs, several engines each (tests/tp_workers.py), on a transformers Qwen3 with 6
heads and 3 KV heads: at TP=2 AutoTP splits k/v 16/8 rows (2 and 1 KV heads), at TP=4 8/8/8/0
(the last rank holds empty slices).

- fed: every step's gradient is a fixed full gradient (each rank's slice of it), so the ranks'
  averaged gradients are exactly those numbers; the parameters after the steps must equal the
  single-process ``ds_canzona.optim`` optimizer's on the unsharded model bit for bit (the host
  reassembles the same numbers and runs the same per-tensor rule). Clipping is active.
- trained: real forward/backward for 10 steps, against single-process training on the same
  global batches. The runs differ in rounding only: AutoTP's row-parallel layers sum partial
  products across TP ranks and ZeRO sums gradients across DP ranks in another order than one
  process does (relative differences around fp32's 6e-8 per gradient), and ten steps of
  Newton-Schulz and momentum carry them on. Measured here: at most 6e-6 of each tensor's total
  update (||ours - reference|| / ||reference - initial||); the bound is 1e-4, which leaves room
  for other BLAS builds while staying four orders of magnitude below what a wrong distribution
  gives. DeepSpeed 0.19.8's own Muon (ZeRO-1, Newton-Schulz forced to fp32 so only the
  distribution differs) under the same AutoTP mesh orthogonalises each slice on its own and
  lands about 0.3-1.0 of the update away (it matches our Muon to 1.3e-5 without TP, README).
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from tp_workers import (
    logical_params,
    make_qwen3,
    phi3_sub_sizes,
    reference_fed,
    reference_fed_phi3,
    reference_training,
    tp_scenarios,
)

MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
SHAMPOO = {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "weight_decay": 0.01}}
SOAP = {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "weight_decay": 0.01}}
NORMUON = {"type": "NorMuon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
ADAMUON = {"type": "AdaMuon", "params": {"lr": 0.003, "weight_decay": 0.01}}
FED_STEPS = 3
TRAIN_STEPS = 10
TOLERANCE = 1e-4  # of each tensor's total update; see the module docstring
SMALL_GROUPS = {"tp_micro_group_bytes": 16_000}  # several micro-groups per TP group (matrices are 9-15 KB)


def relative_distance(got: dict, ref: dict) -> dict[str, float]:
    initial = dict(make_qwen3().named_parameters())
    return {name: float((got[name] - ref[name]).norm() / (ref[name] - initial[name].detach()).norm())
            for name in ref}


def assert_bitwise(got: dict, ref: dict) -> None:
    initial = dict(make_qwen3().named_parameters())
    assert got.keys() == ref.keys()
    for name in ref:
        assert not torch.equal(ref[name], initial[name].detach()), f"{name} did not move"
        assert torch.equal(got[name], ref[name]), f"{name}: max |diff| {(got[name] - ref[name]).abs().max():.3e}"


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """Checkpoint directories: A saved at TP=2 x DP=2, B at TP=1 x DP=3 after loading A, C at TP=4 after loading B;
    D: Phi3 (fused weights) saved at TP=2 x DP=2, E at TP=1 x DP=3 after loading D."""
    root = tmp_path_factory.mktemp("tp_checkpoints")
    return {name: str(root / name) for name in "ABCDE"}


@pytest.fixture(scope="module")
def tp2_dp2(checkpoints):
    scenarios = [
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": MUON, "stage": 1, "canzona": SMALL_GROUPS},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": SHAMPOO, "stage": 2, "canzona": {}},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": SOAP, "stage": 1, "canzona": SMALL_GROUPS},
        {"tp": 2, "mode": "train", "steps": TRAIN_STEPS, "optimizer": MUON, "stage": 2, "canzona": SMALL_GROUPS},
        {"tp": 2, "mode": "train", "steps": TRAIN_STEPS, "optimizer": MUON, "stage": 1},  # DeepSpeed's own Muon
        {"tp": 2, "mode": "train", "steps": 2, "ga": 3, "optimizer": MUON, "stage": 1, "canzona": SMALL_GROUPS,
         "meter": True},
        {"tp": 2, "mode": "train", "steps": 2, "optimizer": SOAP, "stage": 2, "canzona": SMALL_GROUPS,
         "save": checkpoints["A"]},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": MUON, "stage": 2, "canzona": SMALL_GROUPS,
         "bf16": True},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": MUON, "stage": 2, "canzona": SMALL_GROUPS,
         "model": "phi3", "save": checkpoints["D"]},
        {"tp": 2, "mode": "fed", "steps": 1, "optimizer": MUON, "stage": 2, "canzona": SMALL_GROUPS,
         "fragments": True},  # DeepSpeed's tensor-fragment API (tests/fragment_workers.py)
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": NORMUON, "stage": 1, "canzona": SMALL_GROUPS},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": ADAMUON, "stage": 2, "canzona": {}},
    ]
    return run_ranks(tp_scenarios, 4, scenarios, timeout=1200)


def scenario(results, index: int) -> list[dict]:
    return [rank[index] for rank in results]


@pytest.mark.parametrize("index, optimizer", [(0, MUON), (1, SHAMPOO), (2, SOAP), (10, NORMUON), (11, ADAMUON)],
                         ids=["muon", "shampoo", "soap", "normuon", "adamuon"])
def test_tp2_dp2_fed_update_is_bitwise_the_single_process_step(tp2_dp2, index, optimizer):
    ranks = scenario(tp2_dp2, index)
    reference = reference_fed(optimizer, steps=FED_STEPS)
    assert_bitwise(logical_params(ranks, 2), reference)
    assert_bitwise(logical_params(ranks[2:], 2), reference)  # the other DP rank's TP group holds the same


def test_fused_sub_parameters_tp2_dp2_update_each_sub_matrix_bitwise(tp2_dp2):
    ranks = scenario(tp2_dp2, 8)
    assert_fused_update_is_separate_matrices(ranks, 2)
    other = logical_params(ranks[2:], 2)  # the other DP rank's TP group holds the same
    for name, value in logical_params(ranks, 2).items():
        assert torch.equal(other[name], value), name


def test_fused_sub_parameters_checkpoint_reshards_from_tp2_to_tp1(tp2_dp2, tp1_dp3, checkpoints):
    """A fused weight is stored fused, under the model's name (qkv_proj.weight, gate_up_proj.weight), with its
    momentum of the same shape: saved at TP=2 x DP=2 it loads at TP=1 x DP=3, and saved again there it is
    the same checkpoint by name and value."""
    saved_params = logical_params(scenario(tp2_dp2, 8), 2)
    masters_d, state_d = checkpoint_contents(checkpoints["D"] + "/saved")
    assert masters_d.keys() == saved_params.keys()
    for name, master in masters_d.items():
        assert torch.equal(master, saved_params[name]), name
    for name in phi3_sub_sizes():
        assert state_d[name]["momentum_buffer"].shape == masters_d[name].shape
    for rank in scenario(tp1_dp3, 1):
        for name, master in masters_d.items():
            assert torch.equal(rank["loaded"][name], master), name
    masters_e, state_e = checkpoint_contents(checkpoints["E"] + "/saved")
    for name in masters_d:
        assert torch.equal(masters_e[name], masters_d[name]), name
    assert_same_state(state_e, state_d)


def test_tp2_dp2_bf16_parameters_are_the_rounded_single_process_masters(tp2_dp2):
    """bf16 at stage 2: fp32 masters on the hosts (whole matrices) and owners, bf16 slices written back."""
    got = logical_params(scenario(tp2_dp2, 7), 2)
    reference = {n: p.bfloat16().float() for n, p in reference_fed(MUON, steps=FED_STEPS, bf16=True).items()}
    initial = {n: p.detach().bfloat16().float() for n, p in make_qwen3().named_parameters()}
    assert got.keys() == reference.keys()
    for name in reference:
        assert torch.equal(got[name], reference[name]), f"{name}: max |diff| {(got[name] - reference[name]).abs().max()}"
        if "proj" in name:  # a norm's few steps of AdamW may round back to its bf16 start
            assert not torch.equal(reference[name], initial[name]), f"{name} did not move"


def test_tp2_dp2_training_matches_single_process_and_deepspeed_muon_does_not(tp2_dp2):
    ours, deepspeed_muon = scenario(tp2_dp2, 3), scenario(tp2_dp2, 4)
    # Three groups or more on one TP group: a scatter shares its launch with a later group's gather.
    assert max(rank["micro_groups"] for rank in ours) >= 3, [rank["micro_groups"] for rank in ours]
    reference = reference_training(MUON, dp=2, steps=TRAIN_STEPS)
    distance = relative_distance(logical_params(ours, 2), reference)
    assert max(distance.values()) < TOLERANCE, distance
    theirs = relative_distance(logical_params(deepspeed_muon, 2), reference)
    sharded = [n for n, split in deepspeed_muon[0]["splits"].items() if split is not None and "lm_head" not in n]
    assert min(theirs[n] for n in sharded) > 1000 * TOLERANCE, theirs


def test_tp2_dp2_gradient_accumulation_matches_single_process(tp2_dp2):
    ranks = scenario(tp2_dp2, 5)
    reference = reference_training(MUON, dp=2, steps=2, ga=3)
    distance = relative_distance(logical_params(ranks, 2), reference)
    assert max(distance.values()) < TOLERANCE, distance


def test_tp2_dp2_step_collectives(tp2_dp2):
    from ds_canzona.zero.tp_exchange import MicroGroupExchange

    """Per step (the boundary reduction and engine.step): one norm all-reduce, the DP collectives
    of ZeRO-1 (a reduce-scatter per bucket; gloo's uneven all-gather is one broadcast per non-empty
    segment) and the micro-groups' all-to-alls (groups + 1 above one group); nothing else."""
    for rank in scenario(tp2_dp2, 5):
        for calls in rank["calls"]:
            assert set(calls) == {"all_reduce", "reduce_scatter", "broadcast", "all_to_all"}, calls
            assert calls["all_reduce"] == 1
            # gathers 0 and 1 in one launch, then scatter k with gather k+2 in one: groups + 1 (2 for one group)
            assert calls["all_to_all"] == MicroGroupExchange.launches_per_step(rank["micro_groups"])
            assert calls["reduce_scatter"] == rank["buckets"]
            assert calls["broadcast"] == rank["segments"]


def test_tp2_dp2_tensor_fragment_api_on_the_slices(tp2_dp2):
    """deepspeed.utils' full getters and setters under AutoTP: a parameter is this rank's slice, as in DeepSpeed."""
    ranks = scenario(tp2_dp2, 9)
    assert set().union(*(r["hosted"] for r in ranks)), "no sharded matrix was covered"
    for r in ranks:
        assert all(r["full_equals_local"].values()), [n for n, ok in r["full_equals_local"].items() if not ok]
        assert all(r["read_back"].values()), [n for n, ok in r["read_back"].items() if not ok]
        # At learning rate 0 the step publishes the set values: a sharded matrix's from its host's master.
        assert all(r["after_zero_lr_step"].values()), [n for n, ok in r["after_zero_lr_step"].items() if not ok]


def test_tp2_dp2_plan_summary_prints_the_tp_load(tp2_dp2):
    summary = scenario(tp2_dp2, 3)[0]["plan_summary"]
    assert "TP=2" in summary and "host cost max/avg=" in summary and "host bytes max/avg=" in summary
    assert "buckets closing at 3000 elements counted in each tensor's largest TP slice" in summary
    assert summary.count("micro-groups, host cost") == 2  # one line per DP rank


@pytest.fixture(scope="module")
def tp1_dp3(tp2_dp2, checkpoints):
    scenarios = [{"tp": 1, "mode": "train", "steps": 1, "optimizer": SOAP, "stage": 1, "canzona": {},
                  "load": checkpoints["A"], "save": checkpoints["B"]},
                 {"tp": 1, "mode": "train", "steps": 0, "optimizer": MUON, "stage": 1, "canzona": {},
                  "model": "phi3", "load": checkpoints["D"], "save": checkpoints["E"]}]
    return run_ranks(tp_scenarios, 3, scenarios, timeout=900)


@pytest.fixture(scope="module")
def tp4_dp1(tp1_dp3, checkpoints):
    scenarios = [
        {"tp": 4, "mode": "fed", "steps": FED_STEPS, "optimizer": MUON, "stage": 2, "canzona": SMALL_GROUPS},
        {"tp": 4, "mode": "fed", "steps": FED_STEPS, "optimizer": SOAP, "stage": 1, "canzona": {}},
        {"tp": 4, "mode": "train", "steps": 0, "optimizer": SOAP, "stage": 2, "canzona": SMALL_GROUPS,
         "load": checkpoints["B"], "save": checkpoints["C"]},
    ]
    return run_ranks(tp_scenarios, 4, scenarios, timeout=900)


@pytest.mark.parametrize("index, optimizer", [(0, MUON), (1, SOAP)], ids=["muon", "soap"])
def test_tp4_with_empty_slices_is_bitwise_the_single_process_step(tp4_dp1, index, optimizer):
    ranks = scenario(tp4_dp1, index)
    assert ranks[0]["splits"]["model.layers.0.self_attn.k_proj.weight"] == (0, (8, 8, 8, 0))
    assert_bitwise(logical_params(ranks, 4), reference_fed(optimizer, steps=FED_STEPS))


@pytest.fixture(scope="module")
def tp2_dp1():
    scenarios = [
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": SHAMPOO, "stage": 1, "canzona": SMALL_GROUPS},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": MUON, "stage": 1, "canzona": SMALL_GROUPS,
         "model": "phi3"},
        {"tp": 2, "mode": "refused", "optimizer": {"type": "Muon", "params": {"lr": 0.02, "per_head_muon": True}},
         "stage": 1, "canzona": {}},
        {"tp": 2, "mode": "refused", "optimizer": SHAMPOO, "stage": 1, "canzona": {}, "model": "phi3"},
        {"tp": 2, "mode": "refused", "optimizer": SOAP, "stage": 1, "canzona": {}, "model": "phi3"},
        {"tp": 2, "mode": "fed", "steps": FED_STEPS, "optimizer": MUON, "stage": 2, "canzona": {},
         "model": "phi3_gqa"},
        {"tp": 2, "mode": "refused", "optimizer": NORMUON, "stage": 1, "canzona": {}, "model": "phi3"},
        {"tp": 2, "mode": "refused", "optimizer": ADAMUON, "stage": 1, "canzona": {}, "model": "phi3"},
    ]
    return run_ranks(tp_scenarios, 2, scenarios, timeout=900)


def test_tp2_dp1_is_bitwise_the_single_process_step(tp2_dp1):
    assert_bitwise(logical_params(scenario(tp2_dp1, 0), 2), reference_fed(SHAMPOO, steps=FED_STEPS))


def assert_fused_update_is_separate_matrices(ranks: list[dict], tp: int, model: str = "phi3") -> None:
    """Phi3 under AutoTP's phi3 preset: each TP slice of qkv_proj (gate_up_proj) is a piece of each of
    q, k, v (gate, up). Fed the same full gradients, the update is bit for bit the single-process Muon on
    q, k, v, gate and up as separate matrices, cut from the fused weights and gradients by the test; Muon
    on each fused weight as one matrix lands far away (so the comparison can fail)."""
    sub_sizes = phi3_sub_sizes(model)
    fused = ranks[0]["fused"]
    assert fused.keys() == sub_sizes.keys()
    for name, widths in fused.items():
        assert tuple(sum(per_rank) for per_rank in widths) == sub_sizes[name]
        assert all(len(per_rank) == tp for per_rank in widths)
    got = logical_params(ranks, tp)
    separate = reference_fed_phi3(MUON, steps=FED_STEPS, separate=True, model=model)
    one_matrix = reference_fed_phi3(MUON, steps=FED_STEPS, separate=False, model=model)
    initial = reference_fed_phi3(MUON, steps=0, separate=False, model=model)
    assert got.keys() == separate.keys()
    for name in separate:
        assert not torch.equal(separate[name], initial[name]), f"{name} did not move"
        assert torch.equal(got[name], separate[name]), f"{name}: max |diff| {(got[name] - separate[name]).abs().max()}"
    for name in sub_sizes:
        # The slice is not the logical weight's leading rows (what an even chunk would assume).
        local = ranks[0]["params"][name]
        assert not torch.equal(local, got[name][:local.shape[0]]), name
        gap = (one_matrix[name] - separate[name]).norm() / (separate[name] - initial[name]).norm()
        assert gap > 0.1, (name, float(gap))


def test_fused_sub_parameters_tp2_dp1_update_each_sub_matrix_bitwise(tp2_dp1):
    assert_fused_update_is_separate_matrices(scenario(tp2_dp1, 1), 2)


def test_fused_sub_parameters_of_unequal_sizes_tp2_dp1_update_each_sub_matrix_bitwise(tp2_dp1):
    """A Phi3 with 3 KV heads for 6 heads: q is 48 rows, k and v 24 each, cut per sub-parameter on whole
    KV heads (q 32/16, k and v 16/8 at TP=2: uneven, and different per sub-parameter)."""
    ranks = scenario(tp2_dp1, 5)
    qkv = ranks[0]["fused"]["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv == ((32, 16), (16, 8), (16, 8)), qkv
    assert_fused_update_is_separate_matrices(ranks, 2, model="phi3_gqa")


@pytest.mark.parametrize("index, kind", [(3, "shampoo"), (4, "soap"), (6, "normuon"), (7, "adamuon")])
def test_fused_sub_parameters_with_shampoo_or_soap_are_refused_at_init(tp2_dp1, index, kind):
    """Shampoo's and SOAP's factors are per matrix: a fused weight's sub-matrices would need a state layout
    of their own, so a fused weight under either is refused at init, naming it. NorMuon's row moments and
    AdaMuon's element-wise one are not cut per sub-parameter yet (zero/tp.py FUSED_KINDS): refused alike."""
    for rank in scenario(tp2_dp1, index):
        assert rank["error"] is not None
        assert rank["error"].startswith(f"optimizer.type: {kind} cannot update parameter"), rank["error"]
        assert "qkv_proj.weight" in rank["error"] or "gate_up_proj.weight" in rank["error"]
        assert "per sub-parameter" in rank["error"]


def test_per_head_muon_with_autotp_is_refused_at_init(tp2_dp1):
    for rank in scenario(tp2_dp1, 2):
        assert rank["error"] is not None and "per_head_muon together with tensor_parallel.autotp_size" in rank["error"]


def test_held_before_counts_a_slice_in_logical_order():
    """A logical flat range maps to a contiguous local range: checked against a mask for every split kind,
    plain and fused (a piece of each sub-parameter per rank); a rank's slice and its logical indices agree,
    and writing every rank's slice back rebuilds the logical tensor."""
    from ds_canzona.zero.tp_layout import TPSplit

    plain = [((5, 4), 0, (3, 2)), ((5, 4), 1, (1, 3)), ((3, 4, 2), 1, (2, 0, 2)), ((6,), 0, (4, 2))]
    fused = [((10, 4), 0, ((2, 2), (3, 1), (1, 1))), ((3, 6), 1, ((1, 2), (0, 3))), ((2, 5, 3), 1, ((2, 0), (1, 2))),
             ((8,), 0, ((2, 2), (2, 2)))]
    splits = [TPSplit.plain(shape, dim, sizes) for shape, dim, sizes in plain]
    splits += [TPSplit(logical_shape=shape, dim=dim, widths=widths) for shape, dim, widths in fused]
    for split in splits:
        shape = split.logical_shape
        full = torch.arange(torch.Size(shape).numel()).reshape(shape)
        rebuilt = torch.full_like(full, -1)
        for rank in range(len(split.sizes)):
            held = split.slice_of(full, rank).reshape(-1)
            assert torch.equal(held, held.sort().values)
            assert torch.equal(split.logical_index(rank, 0, held.numel()), held)
            for index in range(full.numel() + 1):
                assert split.held_before(rank, index) == int((held < index).sum())
            split.write_slice(rebuilt, rank, split.slice_of(full, rank))
        assert torch.equal(rebuilt, full)
    # Fused: rank 0 of ((2, 2), (3, 1), (1, 1)) holds rows 0-1 of the first sub-parameter, rows 4-6 of the
    # second and row 8 of the third.
    assert TPSplit(logical_shape=(10, 4), dim=0, widths=fused[0][2]).runs(0) == ((0, 2), (4, 3), (8, 1))


def test_buckets_count_each_tensor_by_its_largest_slice_on_every_tp_rank():
    """What the runtime hands the planner as held elements (``_held_numels``), on stand-ins of both TP ranks.

    k_proj of 3 KV heads at TP=2 is cut 16/8 rows: both ranks count the 16-row slice, so their plans (and
    bucket boundaries) agree, and neither rank's bucket holds more than the bucket size. A replicated
    tensor counts whole, a fused one by its larger slice (its pieces of every sub-parameter together).
    """
    from types import SimpleNamespace

    from ds_canzona.zero.tp import CanzonaTPZeroOptimizer
    from ds_canzona.zero.tp_layout import TPSplit

    k_proj = TPSplit.plain((24, 48), 0, (16, 8))
    fused = TPSplit(logical_shape=(10, 8), dim=0, widths=((2, 2), (3, 1), (1, 1)))  # rank 0: 6 rows, rank 1: 4
    o_proj = TPSplit.plain((48, 48), 1, (24, 24))
    splits = [k_proj, None, fused, o_proj]
    for tp_rank in (0, 1):
        params = [torch.empty(split.local_shape(tp_rank)) if split else torch.empty(48) for split in splits]
        stand_in = SimpleNamespace(splits=splits, params=params, tp_size=2)
        assert CanzonaTPZeroOptimizer._held_numels(stand_in) == [16 * 48, 48, 6 * 8, 48 * 24]
    assert k_proj.local_numel(1) == 8 * 48  # what TP rank 1 itself holds: not what it counts


def test_read_tp_splits_takes_sub_parameter_widths_and_refuses_what_it_cannot_place():
    """AutoTP's metadata on stand-in parameters: a fused weight's split comes from its sub_param_shard_widths;
    a layout AutoTP marks unsupported, and a sub-parameter view whose logical shape is not the parameter's
    (a 3-D (heads, head_dim, in) view of a 2-D weight), are refused naming the parameter."""
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META

    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.tp_layout import read_tp_splits

    def param(shape: tuple[int, ...], **meta) -> torch.nn.Parameter:
        p = torch.nn.Parameter(torch.zeros(shape))
        setattr(p, DS_AUTOTP_UC_META, {"partition_dim": 0, "conversion": {}, **meta})
        return p

    fused = param((24 + 16, 8), logical_shape=(64, 8), sub_param_sizes=(32, 16, 16),
                  sub_param_shard_widths=[[24, 8], [8, 8], [8, 8]])
    (split,) = read_tp_splits([("qkv.weight", fused)], tp_rank=0, tp_size=2)
    assert split.fused and split.sub_sizes == (32, 16, 16) and split.runs(0) == ((0, 24), (32, 8), (48, 8))
    assert split.runs(1) == ((24, 8), (40, 8), (56, 8))

    unsupported = param((12, 8), logical_shape=(24, 8), partition_sizes=(12, 12),
                        conversion={"unsupported_reason": "its fused qkv layout interleaves blocks"})
    viewed = param((16, 8), logical_shape=(4, 8, 8), sub_param_sizes=None, sub_param_shard_widths=[[2, 2]])
    for name, p, why in [("codegen.qkv.weight", unsupported, "marks unsupported"),
                         ("heads.weight", viewed, "sub-parameter view of another shape")]:
        with pytest.raises(CanzonaConfigError, match=why) as error:
            read_tp_splits([(name, p)], tp_rank=0, tp_size=2)
        assert name in str(error.value) and str(error.value).startswith("tensor_parallel.autotp_size")


def checkpoint_contents(directory: str) -> tuple[dict, dict]:
    """Masters and optimizer state by tensor name, as ds_canzona's reader puts them together."""
    from ds_canzona.zero.checkpoint import Checkpoint

    ckpt = Checkpoint.open(directory)
    return ({name: ckpt.tensor_master(name) for name in ckpt.tensor_names},
            {name: ckpt.tensor_state(name) for name in ckpt.tensor_names})


def assert_same_state(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert a[name].keys() == b[name].keys(), name
        for key in a[name]:
            x, y = a[name][key], b[name][key]
            assert torch.equal(torch.as_tensor(x), torch.as_tensor(y)), (name, key)


def test_checkpoints_reshard_between_tp_and_dp(tp2_dp2, tp1_dp3, tp4_dp1, checkpoints, tmp_path):
    """Saved at TP=2 x DP=2, the checkpoint holds logical tensors by name: they are the run's parameters,
    `ds-canzona consolidate` exports them, TP=1 x DP=3 loads them exactly; its checkpoint loads at TP=4
    (empty slices on one rank) and, saved again at once, is the same checkpoint by name and value."""
    from ds_canzona.consolidate import consolidate_checkpoint, load_consolidated_model

    saved_params = logical_params(scenario(tp2_dp2, 6), 2)
    masters_a, state_a = checkpoint_contents(checkpoints["A"] + "/saved")
    for name, master in masters_a.items():
        assert torch.equal(master, saved_params[name]), name
    assert any(state["exp_avg"].dim() == 2 for state in state_a.values())  # SOAP state of whole matrices

    consolidate_checkpoint(checkpoints["A"], str(tmp_path / "out"))
    exported = load_consolidated_model(str(tmp_path / "out"))
    for name, master in masters_a.items():
        assert torch.equal(exported[name].float(), master), name

    loaded_dp3 = scenario(tp1_dp3, 0)
    for rank in loaded_dp3:
        for name, master in masters_a.items():
            assert torch.equal(rank["loaded"][name], master), name

    masters_b, state_b = checkpoint_contents(checkpoints["B"] + "/saved")
    assert any(not torch.equal(masters_b[n], masters_a[n]) for n in masters_a)  # B trained one more step
    loaded_tp4 = scenario(tp4_dp1, 2)
    assert loaded_tp4[3]["splits"]["model.layers.0.self_attn.k_proj.weight"] == (0, (8, 8, 8, 0))
    loaded = {name: torch.cat([loaded_tp4[r]["loaded"][name] for r in range(4)], dim=split[0]) if split else
              loaded_tp4[0]["loaded"][name] for name, split in loaded_tp4[0]["splits"].items()}
    for name, master in masters_b.items():
        assert torch.equal(loaded[name], master), name
    masters_c, state_c = checkpoint_contents(checkpoints["C"] + "/saved")
    for name in masters_b:
        assert torch.equal(masters_c[name], masters_b[name]), name
    assert_same_state(state_c, state_b)


def trainer_with_autotp(rank: int, world_size: int, outdir: str) -> dict:
    """The HuggingFace Trainer (transformers' DeepSpeed integration shards the model with
    ``deepspeed.tp_model_init`` from the config's ``tensor_parallel.autotp_size``) for two steps."""
    import ds_canzona  # noqa: F401
    from test_hf import _tiny_trainer

    from ds_canzona.hf import training_arguments

    config = {"train_micro_batch_size_per_gpu": 2, "gradient_clipping": 1.0, "zero_optimization": {"stage": 1},
              "tensor_parallel": {"autotp_size": 2},
              "optimizer": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003}}, "canzona": {"log_plan": False}}
    arguments = training_arguments(config, output_dir=outdir, max_steps=2, report_to="none", save_strategy="no",
                                   disable_tqdm=True, logging_steps=1, lr_scheduler_type="constant")
    trainer = _tiny_trainer(arguments)
    trainer.train()
    engine = trainer.model_wrapped
    return {"optimizer": type(engine.optimizer).__name__, "steps": trainer.state.global_step,
            "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
            "q_proj": tuple(dict(engine.module.named_parameters())["model.layers.0.self_attn.q_proj.weight"].shape),
            "norm": engine.module.model.norm.weight.detach().clone()}


def test_huggingface_trainer_with_autotp(tmp_path):
    results = run_ranks(trainer_with_autotp, 2, str(tmp_path), timeout=600)
    for result in results:
        assert result["optimizer"] == "CanzonaTPZeroOptimizer"
        assert result["q_proj"] == (32, 64)  # qwen3-tiny's 64 query rows, split over 2 TP ranks
        assert result["steps"] == 2 and len(result["losses"]) == 2
    assert results[0]["losses"] == results[1]["losses"], "both TP ranks see the same batches"
    assert torch.equal(results[0]["norm"], results[1]["norm"]), "replicated parameters stay identical across TP"


def test_plan_tp_hosts_and_host_bytes():
    """Algorithm 2 on logical matrices: every matrix in one micro-group with one host, groups within the
    capacity (unless one matrix alone exceeds it), and the host's bytes are the whole matrix's fp32
    master plus its optimizer state."""
    from ds_canzona.plan import ParamSpec, memory_model, plan_tp_hosts, tp_host_bytes

    specs = [ParamSpec(name=f"m{i}", shape=(48 + 8 * i, 48), matrix=True) for i in range(6)]
    plan = plan_tp_hosts(specs, tp_size=2, capacity_bytes=20_000)
    placed = sorted(index for group in plan.groups for index in group.params)
    assert placed == list(range(6)) and len(plan.groups) >= 2
    for group in plan.groups:
        assert all(0 <= host < 2 for host in group.hosts)
        assert max(group.rank_bytes) <= 20_000 or len(group.params) == 1
    assert plan.digest() == plan_tp_hosts(specs, tp_size=2, capacity_bytes=20_000).digest()
    spec = ParamSpec(name="w", shape=(48, 32), matrix=True)
    assert tp_host_bytes(memory_model("muon", param_bytes=4), spec) == 4 * (48 * 32 + 48 * 32)  # master, momentum
    soap = memory_model("soap", param_bytes=4)
    assert tp_host_bytes(soap, spec) == 4 * (48 * 32 + 2 * 48 * 32 + 2 * 48 * 48 + 2 * 32 * 32)
