"""DeepSpeed's tensor-fragment API (deepspeed.utils.safe_get_full_* / safe_set_full_* / local) on ds_canzona.

DeepSpeed's tests/unit/runtime/zero/test_zero_tensor_fragment.py, ported to our runtimes at
ZeRO-1, 2 and 3 (fp32; and bf16 at stage 3) on one spawn of two gloo ranks (Muon with AdamW for the rest, the embedding
and the head owned in pieces, one frozen parameter; tests/fragment_workers.py says what each rank
does). Everything is compared bit for bit:

- the full gradient after backward equals the mean over ranks of plain torch's gradients (two
  ranks: one fp32 addition and a division by 2, both exact; the same operations as the ranks');
- the full value and state after a step equal the single-process optimizer's fed those gradients;
- values and state set through the API read back as set, the next forward uses them on every
  rank (its gradients equal plain torch's from the set values), and the steps after the set (one
  of them with two gradients set through the API) equal the single-process optimizer given the
  same values, state and gradients;
- a frozen parameter reads None (DeepSpeed's behaviour); an unknown state name and a gradient
  read after the step at stage 1/2 raise errors that say what to do;
- stage 3's local functions: this rank's part as its ds_tensor, set and read back.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from fragment_workers import FROZEN, OPTIMIZER, SET_GRADS, SPLIT_NUMEL, fragment_case, frozen_model
from grad_reference import Replay, mean_gradient, rank_gradients, whole_grads
from test_zero3 import _bound, _outside

WORLD = 2
STAGES = (1, 2, 3)
# bf16 at stage 3: the fp32 masters are apart from the shards there (at fp32 the master is the
# shard), so a set value must be written into the shard as well.
CASES = [(stage, "fp32") for stage in STAGES] + [(3, "bf16")]
PRECISION = {"fp32": {}, "bf16": {"bf16": {"enabled": True}}}
CLIP = 1.0  # zero_workers.BASE_CONFIG's gradient_clipping


def fragment_cases(rank: int, world_size: int) -> list[dict]:
    return [fragment_case(rank, world_size, stage, PRECISION[dtype]) for stage, dtype in CASES]


@pytest.fixture(scope="module")
def results():
    per_rank = run_ranks(fragment_cases, WORLD, timeout=900)
    return {case: [per_rank[r][i] for r in range(WORLD)] for i, case in enumerate(CASES)}


def check_gradients(ranks: list[dict], step: int, model: torch.nn.Module, stage: int, dtype: str = "fp32") -> None:
    """Every rank's full gradients equal the runtime's own (bit for bit) and plain torch's mean of the ranks'.

    Plain torch (fp32): bit for bit at stage 1/2 (the same operations); at stage 3 DeepSpeed's
    backward through its fetched parameters may round differently, so there within
    tests/test_zero3.py's bound for the same two-rank mean. bf16: the runtime's own only (its
    bf16 gradients against plain torch are tests/test_zero3_features.py's).
    """
    per_rank = [rank_gradients(model, step=step, rank=r, world_size=WORLD, ga=1) for r in range(WORLD)]
    owned = {}
    for r in ranks:
        owned.update(r[f"owned{step}"])
    owned = whole_grads(owned, {n: g.shape for n, g in per_rank[0].items()})
    for r in ranks:
        assert_equal(r[f"grads{step}"], owned, f"stage {stage} step {step}: full gradients against the runtime's own")
    if dtype != "fp32":
        return
    if stage < 3:
        assert_equal(owned, mean_gradient(per_rank, divide_by=WORLD), f"stage {stage} step {step}: against plain torch")
    else:
        mean = mean_gradient(per_rank, divide_by=WORLD)
        outside = _outside(owned, mean, _bound(per_rank, world_size=WORLD, dtype=torch.float32))
        assert not outside, f"stage 3 step {step}: gradients outside the bound of plain torch's: {outside}"


def assert_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    different = [n for n in want if not torch.equal(got[n].reshape(want[n].shape), want[n])]
    assert not different, f"{what}: {len(different)} tensors differ, e.g. {different[:3]}"


def replay_state(replay: Replay) -> dict:
    state = replay.optimizer.state
    return {n: {"value": p.detach().clone(), **{k: v for k, v in state[p].items() if torch.is_tensor(v) and v.shape == p.shape}}
            for n, p in replay.named}


def assert_state_equal(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), what
    for name in want:
        assert set(got[name]) == set(want[name]), f"{what}: {name} has {sorted(got[name])}, want {sorted(want[name])}"
        different = [k for k in want[name] if not torch.equal(got[name][k].reshape(want[name][k].shape), want[name][k])]
        assert not different, f"{what}: {name}'s {different} differ"


@pytest.mark.parametrize("stage, dtype", CASES)
def test_full_api_against_plain_torch_and_the_single_process_optimizer(results, stage, dtype):
    ranks = results[(stage, dtype)]
    torch.set_num_threads(1)  # as the ranks run: the same blocking of every product
    replay = Replay(OPTIMIZER, frozen_model, clip=CLIP, split_numel=SPLIT_NUMEL,
                    param_dtype={"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])

    # Step 0: the averaged gradient, as plain torch gives it, on every rank.
    check_gradients(ranks, 0, replay.model_in(replay.param_dtype), stage, dtype)
    replay.step(ranks[0]["grads0"])
    for r in ranks:
        assert_state_equal(r["after0"], replay_state(replay), f"stage {stage} value and state after step 0")

    # The set values read back as set; the next forward uses them on every rank.
    values = ranks[0]["set"]
    for r in ranks:
        assert_state_equal(r["read_back"], {n: {("value" if k is None else k): v for k, v in d.items()}
                                            for n, d in values.items()}, f"stage {stage} values read back")
        assert_equal(r["params_after_set"], {n: d[None].to(replay.param_dtype).float() for n, d in values.items()},
                     f"stage {stage} {dtype}: the parameters the next forward sees after a set")
    with torch.no_grad():
        for n, p in replay.named:
            p.copy_(values[n][None])
            for k, v in values[n].items():
                if k is not None:
                    replay.optimizer.state[p][k].copy_(v)
    check_gradients(ranks, 1, replay.model_in(replay.param_dtype), stage, dtype)  # the forward after the set used the set values
    replay.step(ranks[0]["grads1"])

    # Step 2 with two gradients set through the API.
    check_gradients(ranks, 2, replay.model_in(replay.param_dtype), stage, dtype)
    for r in ranks:
        assert_equal(r["set_grads_read_back"], r["set_grads"], "gradients read back after a set")
    replay.step({**ranks[0]["grads2"], **ranks[0]["set_grads"]})
    for r in ranks:
        assert_state_equal(r["after2"], replay_state(replay), f"stage {stage} value and state after the set")
        if r["params"] is not None:
            assert_equal(r["params"], replay.params(), f"stage {stage} parameters after the set")


@pytest.mark.parametrize("stage, dtype", CASES)
def test_frozen_parameters_and_errors(results, stage, dtype):
    for r in results[(stage, dtype)]:
        assert r["frozen"] == [None, None, None], f"{FROZEN} is frozen: DeepSpeed's getters return None"
        assert "no per-element optimizer state 'exp_avg'" in r["unknown_key"] and "momentum_buffer" in r["unknown_key"]
        if stage < 3:
            assert "between the backward" in r["grad_after_step"] and "engine.step()" in r["grad_after_step"]
        else:  # ZeRO-3 reads what has been reduced since the last step: nothing yet
            assert r["grad_after_step"] == "no error"


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero3_local_api(results, dtype):
    ranks = results[(3, dtype)]
    for name in ranks[0]["local"]:
        parts = [r["local"][name] for r in ranks]
        assert all(p["numel"] == p["ds_numel"] for p in parts), name
        assert all(p["matches_full"] and p["value_back"] and p["state_back"] for p in parts), (name, parts)
        # Owner placement: the parts of all ranks together are the tensor once.
        shape = dict(frozen_model().named_parameters())[name].shape
        assert sum(p["numel"] for p in parts) == shape.numel(), name
    assert any(len({p["numel"] > 0 for p in (r["local"][n] for r in ranks)}) == 2 for n in ranks[0]["local"])
    assert any(0 < ranks[0]["local"][n]["numel"] < ranks[0]["local"][n]["numel"] + ranks[1]["local"][n]["numel"]
               and ranks[1]["local"][n]["numel"] > 0 for n in SET_GRADS[1:]), "the embedding is split between the ranks"
