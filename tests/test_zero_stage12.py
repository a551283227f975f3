"""The ZeRO-1/2 runtime against the single-process optimizers, on gloo ranks.

Bit-for-bit: after 10 steps (fp32, gradient accumulation 2, clipping on) the parameters at DP=2,
3 and 4, stage 1 and stage 2, equal those of the single-process ds_canzona.optim optimizer fed
the same averaged gradients. Within a tolerance: against single-process training on the whole
batch, where only the order of the gradient sum differs.
"""

from __future__ import annotations

import re

import pytest
import torch

from distributed import run_ranks
from tiny_model import batches, make_model
from zero_workers import make_config, train, train_many

STEPS = 10
OPTIMIZERS = {
    "muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "ns_method": "gram"}},
    "shampoo": {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 3}},
    "soap": {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 3}},
    # Non-default lr_scaling for each, so both rescalings run distributed (and AdaMuon without its sign step).
    "normuon": {"type": "NorMuon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01,
                                              "lr_scaling": "match_rms_adamw"}},
    "adamuon": {"type": "AdaMuon", "params": {"lr": 0.003, "weight_decay": 0.01, "beta2": 0.95}},
    "adamuon_original": {"type": "AdaMuon", "params": {"lr": 0.02, "adam_lr": 0.003, "lr_scaling": "original",
                                                       "sign_momentum": False, "ns_method": "standard"}},
}
# NorMuon and AdaMuon engines ride in the Muon spawns of these DP sizes (one spawn, engines in turn).
MUON_FAMILY = ("muon", "normuon", "adamuon", "adamuon_original")
MUON_FAMILY_WORLD_SIZES = (2, 3)


PIECE = re.compile(r"^(?P<tensor>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


def merged_grads(results) -> list[dict]:
    """Each step's averaged gradients from all ranks, by item name (a piece is "name[start:stop]")."""
    steps = len(results[0]["grads"])
    merged = []
    for s in range(steps):
        step = {}
        for r in results:
            step.update(r["grads"][s])
        merged.append(step)
    return merged


def whole_grads(items: dict, shapes: dict) -> dict:
    """Item gradients joined into whole tensors of ``shapes`` (pieces in element order)."""
    pieces: dict[str, list[tuple[int, torch.Tensor]]] = {}
    for name, grad in items.items():
        match = PIECE.match(name)
        if match:
            pieces.setdefault(match["tensor"], []).append((int(match["start"]), grad))
        else:
            pieces[name] = [(0, grad)]
    return {name: torch.cat([g.reshape(-1) for _, g in sorted(parts, key=lambda part: part[0])]).reshape(shapes[name])
            for name, parts in pieces.items()}


def single_process_replay(optimizer: dict, grads_per_step: list[dict], clip: float, model_factory=make_model,
                          split_numel: int | None = None) -> dict:
    """The single-process optimizer fed the runtime's averaged gradients, clipped the same way.

    With ``split_numel`` the clipping norm is summed over the same canonical items as the
    runtime's (``ds_canzona.plan.item_bounds``: pieces of large non-matrix tensors and of 3-D
    matrix stacks); the update runs on whole tensors.

    Runs with one torch thread, as the ranks do: CPU LAPACK/BLAS may block a product differently
    with another thread count, which changes the rounding, not the math.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return _replay(optimizer, grads_per_step, clip, model_factory, split_numel)
    finally:
        torch.set_num_threads(threads)


def _replay(optimizer: dict, grads_per_step: list[dict], clip: float, model_factory, split_numel=None) -> dict:
    from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm
    from ds_canzona.plan import item_bounds
    from ds_canzona.zero.build import translate_optimizer_params
    import ds_canzona.optim as optim

    model = model_factory()
    named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    name = optimizer["type"].lower()
    cls = {"muon": optim.Muon, "normuon": optim.NorMuon, "adamuon": optim.AdaMuon, "shampoo": optim.Shampoo,
           "soap": optim.SOAP}[name]
    opt = cls(named, **translate_optimizer_params(name, optimizer["params"]))
    matrix = {id(p): group["kind"] != "adamw" for group in opt.param_groups for p in group["params"]}
    for grads in grads_per_step:
        grads = whole_grads(grads, {n: p.shape for n, p in named})
        ordered = [grads[n].clone() for n, _ in named]
        sq = torch.stack([tensor_sq_norm(g.reshape(-1)[start:stop])
                          for (_, p), g in zip(named, ordered)
                          for start, stop in item_bounds(g.shape, matrix[id(p)], split_numel)])
        _, coefficient = clip_coefficient(sq, clip)
        for (_, p), g in zip(named, ordered):
            p.grad = g.mul_(coefficient) if coefficient < 1.0 else g
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def whole_batch_reference(optimizer: dict, world_size: int, ga: int, clip: float) -> dict:
    """Plain single-process training on each step's whole global batch."""
    from grad_reference import whole_batch_training  # imports this module: not at the top

    return whole_batch_training(optimizer, make_model(), lambda model, step, micro, rank: model(
        batches(step, micro, rank, world_size)), world_size=world_size, steps=STEPS, ga=ga, clip=clip)


def assert_params_equal(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    different = [n for n in a if not torch.equal(a[n], b[n])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def runs():
    """DP in (2, 3, 4) x stage (1, 2) for Muon, and DP=3 both stages for Shampoo and SOAP."""
    cache = {}

    def get(kind: str, world_size: int, stage: int):
        key = (kind, world_size, stage)
        if key not in cache and kind in MUON_FAMILY and world_size in MUON_FAMILY_WORLD_SIZES:
            configs = [make_config(world_size, stage=stage, optimizer=OPTIMIZERS[k]) for k in MUON_FAMILY]
            results = run_ranks(train_many, world_size, configs, STEPS, timeout=900)
            for index, k in enumerate(MUON_FAMILY):
                cache[(k, world_size, stage)] = [r[index] for r in results]
        if key not in cache:
            config = make_config(world_size, stage=stage, optimizer=OPTIMIZERS[kind])
            cache[key] = run_ranks(train, world_size, config, STEPS, timeout=600)
        return cache[key]

    return get


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_muon_is_bitwise_the_single_process_step(runs, world_size):
    results_by_stage = {stage: runs("muon", world_size, stage) for stage in (1, 2)}
    for stage, results in results_by_stage.items():
        for r in results[1:]:
            assert_params_equal(results[0]["params"], r["params"])  # every rank holds the same model
        replay = single_process_replay(OPTIMIZERS["muon"], merged_grads(results), clip=1.0)
        assert_params_equal(results[0]["params"], replay)
    assert_params_equal(results_by_stage[1][0]["params"], results_by_stage[2][0]["params"])


@pytest.mark.parametrize("stage", [1, 2])
def test_non_matrix_tensors_in_pieces_are_bitwise_the_single_process_step(stage):
    """The embedding and head (61 x 24, AdamW) in pieces of 500, 500 and 464 elements, at DP=3.

    Pieces start at offsets that are not multiples of a vector width, so CPU kernels' vector and
    tail paths meet different elements than in the whole tensor: AdamW must still agree bit for bit.
    """
    # The numel cost spreads the cheap AdamW pieces over the ranks (the point of this test).
    config = make_config(3, stage=stage, optimizer=OPTIMIZERS["muon"], canzona={"split_numel": 500, "cost_model": "numel"})
    results = run_ranks(train, 3, config, STEPS, timeout=600)
    owned = [name for r in results for name in r["owned"]]
    pieces = [name for name in owned if PIECE.match(name)]
    assert sorted(pieces) == sorted(f"{t}[{a}:{b}]" for t in ("embed_tokens.weight", "lm_head.weight")
                                    for a, b in ((0, 500), (500, 1000), (1000, 1464)))
    owners = {name: rank for rank, r in enumerate(results) for name in r["owned"]}
    spread = {t: {owners[p] for p in pieces if p.startswith(t)} for t in ("embed_tokens.weight", "lm_head.weight")}
    assert any(len(ranks) > 1 for ranks in spread.values()), f"no tensor is split across ranks: {spread}"
    replay = single_process_replay(OPTIMIZERS["muon"], merged_grads(results), clip=1.0, split_numel=500)
    assert_params_equal(results[0]["params"], replay)


@pytest.mark.parametrize("kind", ["shampoo", "soap"])
def test_shampoo_and_soap_are_bitwise_the_single_process_step(runs, kind):
    results_by_stage = {stage: runs(kind, 3, stage) for stage in (1, 2)}
    for results in results_by_stage.values():
        replay = single_process_replay(OPTIMIZERS[kind], merged_grads(results), clip=1.0)
        assert_params_equal(results[0]["params"], replay)
    assert_params_equal(results_by_stage[1][0]["params"], results_by_stage[2][0]["params"])


# Experts of the MoE test model are 32 x 16 (512 elements): at this split_numel every stack is
# planned as four pieces of one expert each, and one of the stacks has pieces on both ranks.
STACK_SPLIT_NUMEL = 512
STACK_RUNS = [(kind, stage, None) for kind in ("shampoo", "soap") for stage in (1, 2)] + \
    [(kind, 2, STACK_SPLIT_NUMEL) for kind in ("muon", "normuon", "adamuon", "shampoo", "soap")] + \
    [("muon", 1, STACK_SPLIT_NUMEL)]


@pytest.fixture(scope="module")
def stack_runs():
    """The model with two 3-D expert stacks at DP=2: ``STACK_RUNS`` engines in turn (one spawn)."""
    # Balanced on elements, so the stacks (4,096 of the model's 7,000 elements) must spread over the
    # ranks; on the CPU's roofline the launch floor keeps these tiny experts together.
    configs = [make_config(2, stage=stage, optimizer=OPTIMIZERS[kind],
                           canzona={} if split is None else {"split_numel": split, "cost_model": "numel"})
               for kind, stage, split in STACK_RUNS]
    results = run_ranks(train_many, 2, configs, STEPS, "moe", timeout=900)
    return {run: [r[index] for r in results] for index, run in enumerate(STACK_RUNS)}


def test_shampoo_and_soap_on_expert_stacks_are_bitwise_the_single_process_step(stack_runs):
    """Stacks whole, stages 1 and 2: each expert its own statistics, as in the single-process optimizer."""
    from tiny_model import make_moe_model

    for (kind, stage, split), ranked in stack_runs.items():
        if split is not None:
            continue
        replay = single_process_replay(OPTIMIZERS[kind], merged_grads(ranked), clip=1.0, model_factory=make_moe_model)
        assert_params_equal(ranked[0]["params"], replay)
        assert ranked[0]["params"]["experts_up"].dim() == 3


def test_expert_stacks_in_pieces_are_bitwise_the_single_process_step(stack_runs):
    """Stacks planned in pieces of whole experts, owned by both ranks: every matrix rule updates each
    piece exactly as the single-process optimizer updates the whole stack (clipping summed over the
    same items, ``item_bounds``)."""
    from tiny_model import make_moe_model

    spread = []  # per run and stack: whether both ranks own experts of it
    for (kind, stage, split), ranked in stack_runs.items():
        if split is None:
            continue
        owned = [set().union(*(step.keys() for step in r["grads"])) for r in ranked]
        for stack in ("experts_up", "experts_down"):
            pieces = [{n for n in names if n.startswith(f"{stack}[")} for names in owned]
            assert sum(map(len, pieces)) == 4, (kind, stage, stack, pieces)  # four experts, never whole
            spread.append(all(pieces))
        for r in ranked[1:]:
            assert_params_equal(ranked[0]["params"], r["params"])
        replay = single_process_replay(OPTIMIZERS[kind], merged_grads(ranked), clip=1.0, model_factory=make_moe_model,
                                       split_numel=split)
        assert_params_equal(ranked[0]["params"], replay)
    # Where the pieces go is the plan's choice; the runtime's path for a stack spread over ranks
    # (segments cutting a stack, the all-gather joining it) must have run at least once here.
    assert any(spread), spread


def test_transformers_qwen3_moe_stacks_in_pieces_are_bitwise_the_single_process_step():
    """transformers' own Qwen3-MoE (fused ``gate_up_proj`` / ``down_proj`` stacks, top-2 routing, so
    some experts get no tokens in a step) at DP=2, stage 2, its stacks in one-expert pieces: Muon and
    Shampoo equal the single-process optimizer bit for bit (one spawn)."""
    pytest.importorskip("transformers")
    from tiny_model import make_hf_moe_model

    kinds = ("muon", "shampoo")
    configs = [make_config(2, stage=2, optimizer=OPTIMIZERS[kind], canzona={"split_numel": 512, "cost_model": "numel"})
               for kind in kinds]
    results = run_ranks(train_many, 2, configs, STEPS, "hf_moe", timeout=900)
    for index, kind in enumerate(kinds):
        ranked = [r[index] for r in results]
        owned = [set().union(*(step.keys() for step in r["grads"])) for r in ranked]
        stack_pieces = [{n for n in names if ".mlp.experts." in n and "[" in n} for names in owned]
        assert sum(map(len, stack_pieces)) == 2 * 2 * 4 and all(stack_pieces), (kind, stack_pieces)
        replay = single_process_replay(OPTIMIZERS[kind], merged_grads(ranked), clip=1.0,
                                       model_factory=make_hf_moe_model, split_numel=512)
        assert_params_equal(ranked[0]["params"], replay)


@pytest.mark.parametrize("world_size", MUON_FAMILY_WORLD_SIZES)
@pytest.mark.parametrize("kind", ["normuon", "adamuon", "adamuon_original"])
def test_normuon_and_adamuon_are_bitwise_the_single_process_step(runs, kind, world_size):
    """Engines of the Muon spawns: every rank and both stages equal the single-process optimizer."""
    results_by_stage = {stage: runs(kind, world_size, stage) for stage in (1, 2)}
    for results in results_by_stage.values():
        for r in results[1:]:
            assert_params_equal(results[0]["params"], r["params"])
        replay = single_process_replay(OPTIMIZERS[kind], merged_grads(results), clip=1.0)
        assert_params_equal(results[0]["params"], replay)
    assert_params_equal(results_by_stage[1][0]["params"], results_by_stage[2][0]["params"])


def test_close_to_whole_batch_training(runs):
    """Only the summation order of the gradients differs: fp32 rounding, amplified by 10 steps.

    Newton-Schulz normalises the update, so a 1-ulp change in a gradient moves an update element
    by about 1e-6 relative; after 10 steps we allow 1e-4 absolute on weights of order 0.1.
    """
    results = runs("muon", 2, 2)
    reference = whole_batch_reference(OPTIMIZERS["muon"], 2, 2, clip=1.0)
    for name, value in reference.items():
        torch.testing.assert_close(results[0]["params"][name], value, rtol=0, atol=1e-4, msg=name)
