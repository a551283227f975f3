"""DeepSpeed MoE expert parallelism with ZeRO-1/2 (ds_canzona/zero/expert_parallel.py).

One spawn of 4 CPU ranks trains the model of tests/ep_workers.py (a dense projection, one
``deepspeed.moe.layer.MoE`` with 4 experts, a dense head) several times: EP=2 x DP=2 at stages 2
and 1, EP=4 (each expert-data-parallel group a single rank), EP=1 (every expert on every rank),
gradient accumulation, optimizer offload (bit for bit the run without it), Shampoo and SOAP on the experts, and DeepSpeed 0.19.8's own Muon under the
same EP config (Newton-Schulz forced to fp32 in both, so only the distribution differs). Shampoo
and SOAP are checked the other way (see their test): the averaged gradients replayed through the
single-process optimizer give the distributed parameters bit for bit.

Against a single-process reference of the paper's math: ``ds_canzona.optim`` on the whole model
(EP=1 in one process, every expert local), each step's gradient the mean over the four ranks'
micro-batches, clipped by the global norm. Top-1 gating without dropped tokens routes each token
alone, so the reference sees the same experts per token; the runs differ in rounding only (the
order of the gradient sums, the all-to-all's reassembly), carried on by three steps of
Newton-Schulz and momentum. Measured here: at most 1.6e-5 of a tensor's total update
(||ours - reference|| / ||reference - initial||); the bound is 1e-4, as for AutoTP
(tests/test_tp.py), four orders of magnitude below a wrong reduction (an expert averaged over the
wrong group moves by about its whole update).

DeepSpeed's Muon clips the orthogonalised update rather than the gradient (docs/NOTES.md), so
it is compared with clipping off, where it agrees with the reference and with us to 1e-4.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from ep_workers import config, make_model, references, replay, save_and_resume, train

WORLD = 4
STEPS = 3
TOLERANCE = 1e-4  # of each tensor's total update; see the module docstring
MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
SHAMPOO = {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "weight_decay": 0.01,
                                         "start_preconditioning_step": 1, "precondition_frequency": 1}}
SOAP = {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "weight_decay": 0.01}}

RUNS = {
    "ep2_stage2": {"ep": 2, "steps": STEPS, "config": config(WORLD)},
    "ep2_stage1": {"ep": 2, "steps": STEPS, "config": config(WORLD, stage=1)},
    "ep4": {"ep": 4, "steps": STEPS, "config": config(WORLD)},
    "ep1": {"ep": 1, "steps": STEPS, "config": config(WORLD)},
    "ep2_ga2": {"ep": 2, "steps": 2, "config": config(WORLD, ga=2)},
    "ep2_shampoo": {"ep": 2, "steps": STEPS, "capture": True,
                    "config": config(WORLD, optimizer=SHAMPOO, gradient_clipping=0.0)},
    "ep2_soap": {"ep": 2, "steps": STEPS, "capture": True,
                 "config": config(WORLD, optimizer=SOAP, gradient_clipping=0.0)},
    "ep2_noclip": {"ep": 2, "steps": STEPS, "config": config(WORLD, gradient_clipping=0.0)},
    "ep2_offload": {"ep": 2, "steps": STEPS, "config": config(WORLD, offload=True)},
    "deepspeed_muon_noclip": {"ep": 2, "steps": STEPS, "deepspeed_muon_fp32": True,
                              "config": config(WORLD, canzona=False, gradient_clipping=0.0)},
}
REFERENCES = {
    "muon": {"optimizer": MUON, "world_size": WORLD, "steps": STEPS},
    "muon_ga2": {"optimizer": MUON, "world_size": WORLD, "steps": 2, "ga": 2},
    "muon_noclip": {"optimizer": MUON, "world_size": WORLD, "steps": STEPS, "clip": 0.0},
    "first_gradients": {"gradients": True, "world_size": WORLD},
}


@pytest.fixture(scope="module")
def runs() -> dict[str, list[dict]]:
    ranks = run_ranks(train, WORLD, list(RUNS.values()), timeout=1200)
    return {name: [rank[k] for rank in ranks] for k, name in enumerate(RUNS)}


@pytest.fixture(scope="module")
def reference() -> dict[str, dict[str, torch.Tensor]]:
    (results,) = run_ranks(references, 1, list(REFERENCES.values()), timeout=600)
    return dict(zip(REFERENCES, results))


def _whole(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """The model by global names from the ranks' copies, which must agree where they overlap."""
    whole: dict[str, torch.Tensor] = {}
    for rank in ranks:
        for name, value in rank["params"].items():
            if name in whole:
                assert torch.equal(whole[name], value), f"{name} differs between ranks"
            whole[name] = value
    return whole


def distance(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor]) -> dict[str, float]:
    initial = {n: p.detach() for n, p in make_model(1, 0).named_parameters()}
    assert got.keys() == ref.keys()
    out = {}
    for name in ref:
        moved = (ref[name] - initial[name]).norm()
        assert moved > 0, f"{name} did not move"
        out[name] = float((got[name] - ref[name]).norm() / moved)
    return out


@pytest.mark.parametrize("run, ref", [("ep2_stage2", "muon"), ("ep2_stage1", "muon"), ("ep4", "muon"),
                                      ("ep1", "muon"), ("ep2_ga2", "muon_ga2"), ("ep2_noclip", "muon_noclip")])
def test_training_matches_the_single_process_reference(runs, reference, run, ref) -> None:
    gaps = distance(_whole(runs[run]), reference[ref])
    assert max(gaps.values()) < TOLERANCE, gaps


def test_averaged_gradients_are_the_whole_batch_gradient(runs, reference) -> None:
    # Muon and Adam are nearly blind to a gradient's scale, so the reduction is checked directly:
    # an expert's gradient summed over its expert-data-parallel group and divided by the whole
    # world (DeepSpeed's convention), a dense one over the world, equal the gradient of the mean
    # loss over the four ranks' micro-batches, to fp32 summation order (measured: 1e-7).
    first = {name: grad for rank in runs["ep2_shampoo"] for name, grad in rank["grads"][0].items()}
    want = reference["first_gradients"]
    assert first.keys() == want.keys()
    for name in want:
        gap = float((first[name] - want[name]).norm() / want[name].norm())
        assert gap < 1e-5, (name, gap)


@pytest.mark.parametrize("run, optimizer", [("ep2_shampoo", SHAMPOO), ("ep2_soap", SOAP)])
def test_shampoo_and_soap_steps_are_bitwise_the_single_process_rule_on_the_averaged_gradients(runs, run, optimizer):
    # Their preconditioners are eigendecompositions of statistics that are rank-deficient after a
    # few steps (a 16 x 8 gradient), whose bases in the degenerate directions turn with the last bit
    # of the gradients: no rounding-level comparison with the reference holds there. So the other
    # kind of check: the ranks' averaged gradients (each tensor's from its owner, experts by global
    # name), fed to the single-process optimizer, give the distributed parameters bit for bit.
    ranks = runs[run]
    steps = [{name: grad for rank in ranks for name, grad in rank["grads"][step].items()} for step in range(STEPS)]
    got = _whole(ranks)
    assert all(step.keys() == got.keys() for step in steps)
    want = replay(optimizer, steps)
    initial = {n: p.detach() for n, p in make_model(1, 0).named_parameters()}
    for name in want:
        assert not torch.equal(want[name], initial[name]), f"{name} did not move"
        assert torch.equal(got[name], want[name]), name


def test_optimizer_offload_is_bitwise_the_run_without_it(runs) -> None:
    # Each family offloads its own owned masters and state (zero/offload.py), as without MoE.
    assert all(rank["offloaded"] == [True, True] for rank in runs["ep2_offload"])
    assert all(rank["offloaded"] == [False, False] for rank in runs["ep2_stage2"])
    offloaded, on_device = _whole(runs["ep2_offload"]), _whole(runs["ep2_stage2"])
    assert offloaded.keys() == on_device.keys()
    assert all(torch.equal(offloaded[n], on_device[n]) for n in on_device)


def test_deepspeed_muon_under_the_same_ep_config_agrees(runs, reference) -> None:
    theirs = _whole(runs["deepspeed_muon_noclip"])
    assert max(distance(theirs, reference["muon_noclip"]).values()) < TOLERANCE
    assert max(distance(_whole(runs["ep2_noclip"]), theirs).values()) < TOLERANCE


def test_each_expert_is_owned_once_inside_its_expert_data_parallel_group(runs) -> None:
    ranks = runs["ep2_stage2"]
    expert_names = {n for n in _whole(ranks) if "deepspeed_experts" in n}
    assert {n.split("deepspeed_experts.")[1].split(".")[0] for n in expert_names} == {"0", "1", "2", "3"}
    owners: dict[str, list[int]] = {}
    for rank, result in enumerate(ranks):
        (dense, dense_world, _, _, _), (group, world, tensors, plan_world, owned) = result["families"]
        assert (dense, dense_world, group, world, plan_world, tensors) == ("dense", 4, "ep_size_2", 2, 2, 8)
        for name in owned:
            owners.setdefault(name, []).append(rank)
            # Experts 0-1 live on EP rank 0 (world ranks 0 and 2), 2-3 on EP rank 1 (ranks 1 and 3).
            index = int(name.split("deepspeed_experts.")[1].split(".")[0])
            assert index // 2 == result["ep_rank"], (rank, name)
        assert result["state_names"] == result["owned"]  # the state API names experts globally too
    dense_names = {n for n in _whole(ranks) if "deepspeed_experts" not in n}
    assert sorted(owners) == sorted(expert_names)
    assert all(len(r) == 1 for r in owners.values()), owners
    assert {n for result in ranks for n in result["owned"] if n in dense_names} == dense_names
    # The clipping norm is one number on every rank (one all-reduce, summed in one order).
    assert len({result["grad_norm"] for result in ranks}) == 1


def test_single_rank_expert_groups_and_replicated_experts(runs) -> None:
    # EP=4: each expert-data-parallel group is one rank, which owns its local experts; EP=1: the
    # expert family spans all four ranks like the dense one.
    for result in runs["ep4"]:
        assert result["families"][1][:2] == ("ep_size_4", 1)
        assert len(result["families"][1][4]) == 4  # one expert's four tensors
    assert all(result["families"][1][:2] == ("ep_size_1", 4) for result in runs["ep1"])


def test_checkpoints_reshard_across_expert_parallel_sizes(runs, reference, tmp_path) -> None:
    # Saved at EP=2 x DP=2 after two steps, loaded at EP=2, EP=4 and EP=1 (each rank reading what
    # it owns there by global name), one more step each.
    ranks = run_ranks(save_and_resume, WORLD, str(tmp_path), 2, [2, 4, 1], 2, 1, timeout=900)
    manifest = ranks[0][0]["manifest"]
    assert sorted(manifest) == sorted(_whole(runs["ep2_stage2"])) and len(manifest) == len(set(manifest))
    # Consolidated in one process: the whole model by global names, the values at the save.
    from ds_canzona.consolidate import fp32_state_dict_from_checkpoint

    consolidated = fp32_state_dict_from_checkpoint(str(tmp_path), tag="saved")
    at_save = _whole([{"params": rank[0]["at_save"]} for rank in ranks])
    assert consolidated.keys() == at_save.keys()
    assert all(torch.equal(consolidated[n], at_save[n]) for n in at_save)
    uninterrupted = _whole(runs["ep2_stage2"])
    for k, ep in enumerate([2, 4, 1]):
        resumed = _whole([rank[k] for rank in ranks])
        assert all(rank[k]["loaded_steps"] == 2 for rank in ranks)
        if ep == 2:  # the same layout: the same numbers as never stopping, bit for bit
            assert all(torch.equal(resumed[n], uninterrupted[n]) for n in uninterrupted)
        gaps = distance(resumed, reference["muon"])
        assert max(gaps.values()) < TOLERANCE, (ep, gaps)
