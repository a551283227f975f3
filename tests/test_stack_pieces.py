"""3-D expert stacks planned in pieces of whole experts: the items, the math, the state (one process).

A stack ``[experts, rows, cols]`` above ``split_numel`` elements is planned as pieces of whole
experts (``ds_canzona.plan.stack_piece_bounds``). That is only sound because every matrix rule
updates each expert of a stack on its own; these tests hold each rule to that, bit for bit, and
check that a stack's state cuts and joins at expert boundaries (how a checkpoint saved with the
stack whole loads into pieces, and back). The distributed runs are in tests/test_zero_stage12.py.
"""

from __future__ import annotations

import pytest
import torch

from ds_canzona.optim import SOAP, AdaMuon, Muon, NorMuon, Shampoo
from ds_canzona.optim.base import join_stack_states, rule_for_group, slice_stack_state
from ds_canzona.plan import ParamSpec, item_bounds, plan_dp_partitions
from ds_canzona.plan.dp import expand_pieces, stack_piece_bounds

RULES = [
    (Muon, {"lr": 0.02, "ns_method": "gram"}),
    (Muon, {"lr": 0.02, "ns_method": "standard", "nesterov": False}),
    (NorMuon, {"lr": 0.02}),
    (NorMuon, {"lr": 0.02, "lr_scaling": "match_rms_adamw"}),
    (AdaMuon, {"lr": 0.003}),
    (AdaMuon, {"lr": 0.003, "lr_scaling": "original", "sign_momentum": False}),
    (Shampoo, {"lr": 0.003, "precondition_frequency": 2}),
    (Shampoo, {"lr": 0.003, "precondition_frequency": 2, "max_preconditioner_dim": 8}),
    (SOAP, {"lr": 0.003, "precondition_frequency": 2}),
]
STEPS = 5


def test_item_bounds_cut_stacks_at_expert_boundaries():
    # 5 experts of 12 x 8 = 96 elements: two experts fit in 200, so pieces of 2, 2 and 1.
    assert stack_piece_bounds((5, 12, 8), 200) == [(0, 192), (192, 384), (384, 480)]
    assert item_bounds((5, 12, 8), True, 200) == [(0, 192), (192, 384), (384, 480)]
    assert item_bounds((5, 12, 8), True, 50) == [(i * 96, (i + 1) * 96) for i in range(5)]  # at least one expert
    assert item_bounds((5, 12, 8), True, 480) == item_bounds((5, 12, 8), True, None) == [(0, 480)]
    assert item_bounds((1, 12, 8), True, 50) == [(0, 96)]  # one expert: whole
    assert item_bounds((48, 10), True, 50) == [(0, 480)]  # a 2-D matrix is never cut
    assert item_bounds((480,), False, 200) == [(0, 200), (200, 400), (400, 480)]


def test_the_plan_items_of_a_stack_are_its_experts():
    specs = [ParamSpec(name="experts", shape=(5, 12, 8), matrix=True), ParamSpec(name="w", shape=(12, 8), matrix=True)]
    items, pieces = expand_pieces(specs, 200)
    assert [(s.name, s.shape, s.matrix) for s in items] == [
        ("experts[0:192]", (2, 12, 8), True), ("experts[192:384]", (2, 12, 8), True),
        ("experts[384:480]", (1, 12, 8), True), ("w", (12, 8), True)]
    assert pieces == ((0, 0, 192), (0, 192, 384), (0, 384, 480), (1, 0, 96))
    # A stack a rank's buffer holds only part of (a tensor-parallel slice) stays whole.
    items, _ = expand_pieces(specs, 200, held_numels=[240, 96])
    assert [s.name for s in items] == ["experts", "w"]
    plan = plan_dp_partitions(specs, world_size=3, bucket_numel=10_000, split_numel=200)
    assert [s.name for s in plan.specs][:3] == ["experts[0:192]", "experts[192:384]", "experts[384:480]"]


@pytest.mark.parametrize("shape", [(5, 12, 8), (5, 8, 12)])
@pytest.mark.parametrize("rule_class,options", RULES, ids=lambda value: getattr(value, "__name__", ""))
def test_each_piece_of_a_stack_takes_the_update_the_whole_stack_gives_it(rule_class, options, shape):
    """Bit for bit over several steps (refreshes included), and the state joins and cuts exactly."""
    torch.manual_seed(0)
    weights = torch.randn(shape) / 3
    grads = [torch.randn(shape) for _ in range(STEPS)]
    rule = rule_for_group(rule_class([torch.nn.Parameter(weights.clone())], **options).param_groups[0])
    per_expert = shape[1] * shape[2]
    bounds = [(start // per_expert, stop // per_expert) for start, stop in stack_piece_bounds(shape, 2 * per_expert)]
    assert bounds == [(0, 2), (2, 4), (4, 5)]

    whole = weights.clone()
    whole_state = rule.init_state(whole)
    pieces = [weights[a:b].clone() for a, b in bounds]
    states = [rule.init_state(piece) for piece in pieces]
    for grad in grads:
        rule.update_([whole], [grad.clone()], [whole_state], lr=options["lr"], known_finite=True)
        rule.update_(pieces, [grad[a:b].clone() for a, b in bounds], states, lr=options["lr"], known_finite=True)
    assert torch.equal(torch.cat(pieces), whole)

    joined = join_stack_states([(b - a, state) for (a, b), state in zip(bounds, states)])
    assert joined.keys() == whole_state.keys()
    for key, value in whole_state.items():
        assert torch.equal(joined[key], value), key
    for (a, b), state in zip(bounds, states):
        cut = slice_stack_state(whole_state, shape[0], a, b)
        assert cut.keys() == state.keys()
        for key, value in state.items():
            assert torch.equal(cut[key], value), key


def test_the_stack_pieces_command_compares_whole_and_pieces(tmp_path, capsys):
    """``python -m ds_canzona.bench stack-pieces`` on the MoE cell whose whole stacks set a step 14% over
    LPT: in pieces its busiest rank's cost is lower, and a shape without stacks is refused."""
    pytest.importorskip("transformers")
    import json

    from ds_canzona.bench.__main__ import COMMANDS
    from ds_canzona.cli import dispatch

    output = tmp_path / "stacks.json"
    assert dispatch("bench", COMMANDS, ["stack-pieces", "--shapes", "qwen3moe16-h2048-mi1408-l24", "--dp", "32",
                                        "--pricings", "gram", "--json", str(output)]) == 0
    assert "| qwen3moe16-h2048-mi1408-l24 | gram | 32 |" in capsys.readouterr().out
    (row,) = json.loads(output.read_text())["rows"]
    assert row["items_pieces"] > row["items_whole"]
    assert row["cost_whole_over_lpt"] > 1.1 and row["cost_pieces_over_whole"] < 0.95
    with pytest.raises(SystemExit, match="stackless"):
        dispatch("bench", COMMANDS, ["stack-pieces", "--shapes", "dense-h2048-i5632-l24"])
