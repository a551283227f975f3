"""ZeRO stage 3 with owner placement against the single-process optimizers and plain torch, on gloo ranks.

One spawn per DP size (2, 3 and 4) trains a row of engines for 10 steps with clipping on: Muon,
NorMuon, AdaMuon, Shampoo and SOAP, gradient accumulation 1 and 3, fp32 and bf16, a model built under
``deepspeed.zero.Init`` beside the same model built normally, and a matrix larger than
``reduce_bucket_size``. For each engine:

- the parameters after the last step equal (torch.equal) the single-process ``ds_canzona.optim``
  optimizer fed the averaged gradients the owners saw, fp32 masters included;
- those averaged gradients are within a stated bound of the mean of per-rank gradients that
  plain torch computes without DeepSpeed (``_bound``: the runtime sums W ranks x GA micro-batches
  in another order and precision, and DeepSpeed's ZeRO-3 module hooks make autograd sum a
  tensor's gradient contributions in another order; nothing else may differ), and a wrong
  average (the sum, a micro-batch left out) falls outside that bound;
- the clipping norm is plain torch's ``clip_grad_norm_`` over those mean gradients (each tensor
  counted once), to float64-vs-fp32 rounding;
- every collective in the optimizer step is the one norm all-reduce (one instrumented engine).

One engine per spawn sets ``canzona.split_numel`` small, so the non-matrix tensors above it
(the embedding, the AdamW head) are owned in canonical pieces spread over the ranks: the same
checks hold per piece, and the replay's clipping norm is summed over the same pieces.
"""

from __future__ import annotations

import pytest
import torch

from distributed import run_ranks
from grad_reference import UNDERFLOW, UNIT_ROUNDOFF, Replay, merged_grads, rank_gradients, whole_grads
from test_zero_stage12 import PIECE, assert_params_equal
from tiny_model import make_model, make_moe_model
from zero3_workers import FROZEN_SAVE_STEPS, make_wide_model, train_runs
from zero_workers import make_config

STEPS = 10
CLIP = 1.0
OPTIMIZERS = {
    "muon": {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01, "ns_method": "gram"}},
    "shampoo": {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 3}},
    "soap": {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 3}},
    "normuon": {"type": "NorMuon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}},
    "adamuon": {"type": "AdaMuon", "params": {"lr": 0.003, "weight_decay": 0.01}},
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
MODEL_FACTORIES = {"tiny": make_model, "wide": make_wide_model, "moe": make_moe_model}
# The wide model's largest matrices (1536 elements) exceed this.
SMALL_BUCKET = 1000

# name: (optimizer, gradient accumulation, dtype, model, built under zero.Init, collectives logged)
CASES = {
    2: {
        "muon_fp32_ga1": ("muon", 1, "fp32", "tiny", False, False),
        "muon_fp32_ga3_wide": ("muon", 3, "fp32", "wide", False, True),
        "muon_fp32_ga3_wide_zero_init": ("muon", 3, "fp32", "wide", True, False),
        "shampoo_bf16_ga3": ("shampoo", 3, "bf16", "tiny", False, False),
        "soap_fp32_ga1": ("soap", 1, "fp32", "tiny", False, False),
        "normuon_fp32_ga1": ("normuon", 1, "fp32", "tiny", False, False),
        # Shampoo and SOAP on the model with 3-D expert stacks: per-expert statistics, owned whole.
        "shampoo_fp32_ga1_moe": ("shampoo", 1, "fp32", "moe", False, False),
        "soap_fp32_ga1_moe": ("soap", 1, "fp32", "moe", False, False),
        # The same stacks in pieces of one expert (512 elements, above PIECES_SPLIT_NUMEL), each owned alone.
        "shampoo_fp32_ga1_moe_pieces": ("shampoo", 1, "fp32", "moe", False, False),
        "normuon_fp32_ga1_moe_pieces": ("normuon", 1, "fp32", "moe", False, False),
    },
    3: {
        "muon_fp32_ga3": ("muon", 3, "fp32", "tiny", False, False),
        "muon_bf16_ga1": ("muon", 1, "bf16", "tiny", False, False),
        "shampoo_fp32_ga1": ("shampoo", 1, "fp32", "tiny", False, False),
        "soap_bf16_ga3": ("soap", 3, "bf16", "tiny", False, False),
        "muon_bf16_ga3_pieces": ("muon", 3, "bf16", "tiny", False, False),
        "muon_bf16_ga3_padded_pieces": ("muon", 3, "bf16", "tiny", False, False),
        "muon_bf16_ga3_allreduce_pieces": ("muon", 3, "bf16", "tiny", False, False),
        "muon_bf16_ga3_priced_pieces": ("muon", 3, "bf16", "tiny", False, False),
        "shampoo_fp32_ga1_grouped": ("shampoo", 1, "fp32", "tiny", False, False),
        "adamuon_bf16_ga3": ("adamuon", 3, "bf16", "tiny", False, False),
        "muon_bf16_ga3_leaf_blocks": ("muon", 3, "bf16", "tiny", False, False),
    },
    4: {
        "muon_fp32_ga1": ("muon", 1, "fp32", "tiny", False, False),
        "shampoo_fp32_ga1_pieces": ("shampoo", 1, "fp32", "tiny", False, False),
    },
}
# The collectives of the few-launch path (ds_canzona.zero.stage3_comm), which a backend other than
# gloo gets by default: (canzona section, zero_optimization) of the cases that take it. "padded"
# with the norms and biases (24 elements) persistent and the matrices fetched, gradients in buckets
# of 1000 elements (several items each, the embedding's pieces among them, some alone);
# "grouped" with DeepSpeed's default persistence threshold (1e5: every tensor of the tiny model
# persistent, so forward fetches nothing after the first) and bucket (5e8: one per backward);
# "grouped" with each transformer block a ZeRO-3 leaf module (DeepSpeed's coordinator fetches a
# block's parameters at once, the fewest fetch launches: docs/BENCHMARKS.md).
FEW_LAUNCHES = {
    "muon_bf16_ga3_padded_pieces": ({"collectives": "padded"},
                                    {"stage3_param_persistence_threshold": 100, "reduce_bucket_size": 1000}),
    "muon_bf16_ga3_allreduce_pieces": ({"collectives": "allreduce"},
                                       {"stage3_param_persistence_threshold": 100, "reduce_bucket_size": 1000}),
    "muon_bf16_ga3_priced_pieces": ({"collectives": "default"},
                                    {"stage3_param_persistence_threshold": 100, "reduce_bucket_size": 1000}),
    "shampoo_fp32_ga1_grouped": ({"collectives": "grouped"}, {}),
    "muon_bf16_ga3_leaf_blocks": ({"collectives": "grouped"},
                                  {"stage3_param_persistence_threshold": 100, "reduce_bucket_size": 1000,
                                   "leaf_module": {"classes": ["Block"]}}),
}
# The mode of "default" on a backend other than gloo (one operation per launch, priced), forced on gloo.
FORCED_MODE = {"muon_bf16_ga3_priced_pieces": "priced"}
# canzona.split_numel of the "_pieces" cases: the tiny model's embedding and AdamW head (61 x 24 =
# 1464 elements each) become 15 pieces of at most 100, its norms (24 elements) stay whole.
PIECES_SPLIT_NUMEL = 100
REFUSED = {
    "offload_param": ({"offload_param": {"device": "cpu"}}, "zero_optimization.offload_param"),
}


def _config(world_size: int, case: tuple, zero: dict | None = None, *, pieces: bool = False,
            name: str = "") -> dict:
    optimizer, ga, dtype, model, _, _ = case
    top = {"gradient_accumulation_steps": ga, "gradient_clipping": CLIP}
    if dtype == "bf16":
        top["bf16"] = {"enabled": True}
    canzona = {"split_numel": PIECES_SPLIT_NUMEL} if pieces else {}
    few_canzona, few_zero = FEW_LAUNCHES.get(name, ({}, {}))
    canzona.update(few_canzona)
    zero = {**few_zero, **(zero or {})}
    config = make_config(world_size, stage=3, optimizer=OPTIMIZERS[optimizer], canzona=canzona, **top)
    if model == "wide":
        config["zero_optimization"]["reduce_bucket_size"] = SMALL_BUCKET
    # DeepSpeed's default memory_efficient_linear swaps torch.nn.functional.linear for its own autograd
    # function (another bias-gradient kernel, so other roundings than the plain-torch reference).
    config["zero_optimization"]["memory_efficient_linear"] = False
    config["zero_optimization"].update(zero or {})
    return config


@pytest.fixture(scope="module")
def spawned():
    cache: dict[int, dict[str, list[dict]]] = {}

    def get(world_size: int) -> dict[str, list[dict]]:
        if world_size not in cache:
            cases = CASES[world_size]
            runs = [{"config": _config(world_size, case, pieces=name.endswith("_pieces"), name=name), "model": case[3],
                     "zero_init": case[4], "log": case[5], "steps": STEPS, "zero3_mode": FORCED_MODE.get(name)}
                    for name, case in cases.items()]
            names = list(cases)
            if world_size == 2:
                for name, (zero, _) in REFUSED.items():
                    runs.append({"config": _config(world_size, cases["muon_fp32_ga1"], zero), "steps": 1})
                    names.append(name)
            results = run_ranks(train_runs, world_size, runs, timeout=900)
            cache[world_size] = {name: [r[i] for r in results] for i, name in enumerate(names)}
        return cache[world_size]

    return get


# DeepSpeed's ZeRO-3 module hooks put extra autograd nodes around every module, so autograd sums
# the gradient contributions of a tensor used several times (the normed input of q, k and v) in
# another order than plain torch does: each rank's own gradient already differs from plain
# torch's by a few roundings of the backward's dtype. Measured on these models: at most 2.2e-7
# of a tensor's largest gradient entry in fp32; the allowance is far above that and far below
# what a wrong average moves (a micro-batch left out or counted twice, a wrong divisor: checked).
BACKWARD_ORDER = {torch.float32: 2.0 ** -16, torch.bfloat16: 2.0 ** -4}


# Relative difference allowed between the runtime's clipping norm and plain torch's: the
# gradients' own (bf16 backward order: measured 1.6e-4; fp32: below 1e-6).
NORM_TOLERANCE = {torch.float32: 1e-5, torch.bfloat16: 2e-3}


def _bound(per_micro: list[dict[str, torch.Tensor]], *, world_size: int, dtype: torch.dtype) -> dict:
    """Elementwise bound on |runtime's average - fp32 mean| of per-(rank, micro-batch) gradients.

    The runtime sums n = W * GA gradients (a reduce over ranks per micro-batch in the parameter
    dtype, accumulated over micro-batches on the owner in it) in some order: at most n - 1
    roundings of the parameter dtype, plus the fp32 reference's own (n - 1) and the divisions, so
    ((n - 1) (u + u_32) + 4 u_32) * sum |g| / W (1 + 1e-3), plus n subnormal half-spacings; and
    the backward-order allowance above, relative to the tensor's largest mean entry.
    """
    n = len(per_micro)
    u, u32 = UNIT_ROUNDOFF[dtype], UNIT_ROUNDOFF[torch.float32]
    relative = ((n - 1) * (u + u32) + 4 * u32) * (1 + 1e-3)
    bound = {}
    for name in per_micro[0]:
        magnitude = sum(g[name].float().abs() for g in per_micro) / world_size
        mean = sum(g[name].float() for g in per_micro) / world_size
        bound[name] = relative * magnitude + n * UNDERFLOW[dtype] + BACKWARD_ORDER[dtype] * mean.abs().max()
    return bound


def _outside(grads: dict, want: dict, bound: dict) -> dict[str, int]:
    return {n: bad for n, m in want.items() if (bad := int(((grads[n] - m).abs() > bound[n]).sum()))}


def _check(name: str, results: list[dict], world_size: int) -> None:
    optimizer, ga, dtype_name, model, _, _ = CASES[world_size][name]
    dtype = DTYPES[dtype_name]
    split_numel = PIECES_SPLIT_NUMEL if name.endswith("_pieces") else None
    for r in results:
        assert "init_error" not in r, r
        assert r["skipped"] == 0
    # One plan on every rank; each item (a tensor or a piece) lives on its owner only: a rank's
    # shard of a tensor is the items of it that it owns.
    assert len({r["plan_digest"] for r in results}) == 1
    owners, item_tensor = results[0]["owners"], results[0]["item_tensor"]
    item_numel = {item: _item_numel(item, results[0]["params"][tensor]) for item, tensor in item_tensor.items()}
    if split_numel is not None:
        pieces = [item for item, tensor in item_tensor.items() if item != tensor]
        stacks = {"experts_up", "experts_down"} if model == "moe" else set()
        assert {item_tensor[p] for p in pieces} == {"embed_tokens.weight", "lm_head.weight"} | stacks, pieces
        assert len({owners[p] for p in pieces}) == world_size  # spread over every rank
    for rank, r in enumerate(results):
        for tensor in r["local_shard_numel"]:
            mine = sum(n for item, n in item_numel.items() if item_tensor[item] == tensor and owners[item] == rank)
            assert r["local_shard_numel"][tensor] == mine, (tensor, rank)
        assert set(r["masters"]) == {t for t, o in owners.items() if o == rank}

    replay = Replay(OPTIMIZERS[optimizer], MODEL_FACTORIES[model], clip=CLIP, param_dtype=dtype,
                    split_numel=split_numel)
    shapes = {n: p.shape for n, p in results[0]["params"].items()}
    for step, items in enumerate(merged_grads(results)):
        assert set(items) == set(owners)
        grads = whole_grads(items, shapes)
        model_now = replay.model_in(dtype)
        per_micro = [rank_gradients(model_now, step=step, rank=rank, world_size=world_size, ga=ga, micros=[micro])
                     for rank in range(world_size) for micro in range(ga)]
        mean = {n: sum(g[n].float() for g in per_micro) / world_size for n in per_micro[0]}
        bound = _bound(per_micro, world_size=world_size, dtype=dtype)
        outside = _outside(grads, mean, bound)
        assert not outside, f"{name} step {step}: averaged gradient outside the bound: {outside}"
        # The bound rejects wrong averages: the sum, and a micro-batch (of one rank) left out.
        assert _outside(grads, {n: m * world_size for n, m in mean.items()}, bound)
        left_out = {n: m - per_micro[-1][n].float() / world_size for n, m in mean.items()}
        assert _outside(grads, left_out, bound)
        # The clipping norm: plain torch's clip_grad_norm_ of the mean gradients (each tensor once).
        tensors = [torch.nn.Parameter(torch.zeros_like(m)) for m in mean.values()]
        for t, m in zip(tensors, mean.values()):
            t.grad = m.clone()
        torch_norm = float(torch.nn.utils.clip_grad_norm_(tensors, CLIP))
        runtime_norm = results[0]["norms"][step]
        # Within the gradients' own difference from plain torch (NORM_TOLERANCE), and to fp32
        # rounding from clip_grad_norm_ of the very gradients the owners saw.
        assert abs(runtime_norm - torch_norm) <= NORM_TOLERANCE[dtype] * torch_norm, (name, step, runtime_norm,
                                                                                       torch_norm)
        own = [torch.nn.Parameter(torch.zeros_like(g)) for g in grads.values()]
        for t, g in zip(own, grads.values()):
            t.grad = g.clone()
        own_norm = float(torch.nn.utils.clip_grad_norm_(own, CLIP))
        assert abs(runtime_norm - own_norm) <= 1e-6 * own_norm, (name, step, runtime_norm, own_norm)
        replay.step(items)
    assert_params_equal(results[0]["params"], replay.params())
    masters = {n: m for r in results for n, m in r["masters"].items()}
    assert_params_equal(masters, _item_values(replay.params(torch.float32), item_tensor, masters))


def _item_numel(item: str, tensor: torch.Tensor) -> int:
    match = PIECE.match(item)
    return int(match["stop"]) - int(match["start"]) if match else tensor.numel()


def _item_values(params: dict, item_tensor: dict, items) -> dict[str, torch.Tensor]:
    """The values of plan items (whole tensors, or pieces "name[start:stop]") from whole tensors, each
    shaped like ``items[item]`` (a piece of a non-matrix tensor is 1-D, one of a stack its experts)."""
    values = {}
    for item, like in items.items():
        match = PIECE.match(item)
        tensor = params[item_tensor[item]]
        values[item] = tensor.reshape(-1)[int(match["start"]):int(match["stop"])].view(like.shape) if match else tensor
    return values


@pytest.mark.parametrize("world_size,name", [(ws, name) for ws, cases in CASES.items() for name in cases])
def test_stage3_equals_single_process_and_plain_torch(spawned, one_thread, world_size, name):
    _check(name, spawned(world_size)[name], world_size)


def test_few_launch_cases_ran_their_collectives_and_kept_small_tensors_resident(spawned):
    """The cases above that take the few-launch path did: their mode, and DeepSpeed's persistence choice."""
    results = spawned(3)
    for name in FEW_LAUNCHES:
        for r in results[name]:
            assert r["collectives"] == FORCED_MODE.get(name, FEW_LAUNCHES[name][0]["collectives"])
            numel = {n: p.numel() for n, p in r["params"].items()}
            threshold = FEW_LAUNCHES[name][1].get("stage3_param_persistence_threshold", 100_000)
            assert r["persistent"] == sorted(n for n, k in numel.items() if k <= threshold), name
            assert r["persistent"], name
            leaves = FEW_LAUNCHES[name][1].get("leaf_module", {}).get("classes")
            assert bool(r["leaf_modules"]) == bool(leaves), name  # the blocks, where the case names them
    # Per form, the launches its cases ran (ds_canzona.zero.CommCounter's kinds: fetches, gradient
    # buckets, the norm's all-reduce); priced mixes them, one operation each.
    ran = {name: results[name][0]["comm_kinds"] for name in FEW_LAUNCHES}
    assert ran["muon_bf16_ga3_padded_pieces"] == ["all_gather_into_tensor", "all_reduce", "reduce_scatter_tensor"]
    assert ran["muon_bf16_ga3_allreduce_pieces"] == ["all_reduce", "all_reduce_fetch", "all_reduce_gradients"]
    assert ran["shampoo_fp32_ga1_grouped"] == ["all_reduce", "broadcast", "reduce"]
    # Priced at DP=3: a launch of one piece is its broadcast / reduce, the others all-reduced (at
    # three ranks the padding of these launches costs more than the all-reduce's second pass).
    assert ran["muon_bf16_ga3_priced_pieces"] == ["all_reduce", "all_reduce_fetch", "all_reduce_gradients",
                                                  "broadcast", "reduce"]
    # gloo's default is one collective per piece and item, nothing of the owners' persistent.
    for r in results["muon_fp32_ga3"]:
        assert r["collectives"] == "per_piece" and r["persistent"] == []


def test_zero_init_model_gets_the_same_plan_and_result_and_large_matrices_get_muon(spawned):
    results = spawned(2)
    normal, zero_init = results["muon_fp32_ga3_wide"], results["muon_fp32_ga3_wide_zero_init"]
    for a, b in zip(normal, zero_init):
        assert a["plan_digest"] == b["plan_digest"]
        assert a["kinds"] == b["kinds"]
        assert_params_equal(a["params"], b["params"])
    kinds = normal[0]["kinds"]
    shapes = {n: p.shape for n, p in normal[0]["params"].items()}
    large = [n for n, s in shapes.items() if s.numel() > SMALL_BUCKET and kinds[n] != "adamw"]
    assert "layers.0.up_proj.weight" in large and all(kinds[n] == "muon" for n in large)
    assert kinds["layers.0.up_proj.weight"] == "muon" and kinds["embed_tokens.weight"] == "adamw"


def test_step_runs_no_collective_but_the_norm_all_reduce(spawned):
    for r in spawned(2)["muon_fp32_ga3_wide"]:
        step_calls = [(kind, n) for phase, kind, n in r["calls"] if phase == "step"]
        assert step_calls == [("all_reduce", 8 * r["n_items"])] * STEPS, step_calls
        around = {kind for phase, kind, _ in r["calls"] if phase == "forward_backward"}
        # Parameters are fetched by broadcasts from their owners, gradients reduced to them.
        assert around == {"broadcast", "reduce"}, around


def test_unsupported_stage3_features_are_refused_at_init(spawned):
    results = spawned(2)
    for name, (_, key) in REFUSED.items():
        for r in results[name]:
            assert "init_error" in r and key in r["init_error"], (name, r)


# --------------------------------------------------------------------------- checkpoints

SAVE_STEPS, RESUME_STEPS = 3, 2
# The stage-3 resume's split_numel: other pieces than the save's 100. It also takes the grouped
# collectives with DeepSpeed's default persistence threshold, so the load's new values and those of
# each later step reach the persistent parameters (all of the tiny model's; the LoRA model's
# adapters and norms) through the refresh after the load and after each step.
RESUME_SPLIT_NUMEL = 300
RESUME_CANZONA = {"split_numel": RESUME_SPLIT_NUMEL, "collectives": "grouped"}


@pytest.fixture(scope="module")
def frozen_checkpoints(tmp_path_factory):
    """tests/zero3_workers.py ``frozen_checkpoint_runs`` at DP=2: (its results, save dir, export dir)."""
    from zero3_workers import PERSISTENCE_THRESHOLD, frozen_checkpoint_runs

    workdir = tmp_path_factory.mktemp("zero3_frozen_ckpt")
    save_dir, export_dir = str(workdir / "ckpt"), str(workdir / "export")
    stage3 = make_config(2, stage=3, optimizer=OPTIMIZERS["muon"])
    stage3["zero_optimization"]["stage3_param_persistence_threshold"] = PERSISTENCE_THRESHOLD
    results = run_ranks(frozen_checkpoint_runs, 2, stage3, make_config(2, stage=2, optimizer=OPTIMIZERS["muon"]),
                        save_dir, export_dir, timeout=600)
    return results, save_dir, export_dir


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, frozen_checkpoints):
    from zero3_workers import checkpoint_resume, checkpoint_save

    workdir = tmp_path_factory.mktemp("zero3_ckpt")
    save_dir, export_dir = str(workdir / "ckpt"), str(workdir / "export")
    muon = OPTIMIZERS["muon"]
    # Saved with the AdamW tensors in pieces of 100 elements; loaded whole at stage 2 and in pieces
    # of 300 at stage 3: every item is read from the saved items that cover its range.
    saved = run_ranks(checkpoint_save, 4, make_config(4, stage=3, optimizer=muon, canzona={"split_numel": 100}),
                      save_dir, export_dir, SAVE_STEPS, timeout=600)
    # The stage-3 DP=3 ranks also load the DP=2 checkpoint with frozen parameters (one spawn for both).
    _, frozen_dir, _ = frozen_checkpoints
    resumed = {
        (stage, ws): run_ranks(checkpoint_resume, ws, make_config(ws, stage=stage, optimizer=muon, canzona=canzona),
                               save_dir, SAVE_STEPS, RESUME_STEPS, frozen_dir if stage == 3 else None, timeout=600)
        for stage, ws, canzona in ((2, 2, None), (3, 3, RESUME_CANZONA))
    }
    return saved, resumed, export_dir


def test_stage3_torch_state_api_and_deepspeeds_zero_to_fp32(checkpoints):
    """At stage 3 too: engine.optimizer.state_dict() is each rank's owned state by name, and DeepSpeed's
    get_fp32_state_dict_from_zero_checkpoint reads the checkpoint as the consolidated export holds it."""
    from ds_canzona.consolidate import load_consolidated_model

    saved, _, export_dir = checkpoints
    for rank, result in enumerate(saved):
        described, owned = result["described"], result["owned"]
        assert (described["rank"], described["world_size"]) == (rank, len(saved))
        assert described["state"].keys() == owned.keys()
        for name, entry in described["state"].items():
            assert entry.keys() == owned[name].keys() - {"master"}, name
            assert all(torch.equal(entry[k], owned[name][k]) for k in entry), name
    reading, exported = saved[0]["deepspeeds_reading"], load_consolidated_model(export_dir)
    assert reading.keys() == exported.keys()
    assert all(torch.equal(reading[k], exported[k]) for k in reading)


@pytest.mark.parametrize("stage,world_size", [(2, 2), (3, 3)])
def test_stage3_checkpoint_loads_at_other_stages_and_sizes_and_training_continues_exactly(
        checkpoints, one_thread, stage, world_size):
    """Saved at stage 3 DP=4 (AdamW tensors in pieces); loaded at stage 2 DP=2 (whole) and stage 3 DP=3
    (other pieces). The loaded masters and optimizer state equal the saved ones and the consolidated
    export (torch.equal), and the next steps equal the single-process optimizer started from the
    consolidated export and fed the owners' gradients."""
    from ds_canzona.consolidate import load_consolidated_model, load_consolidated_optimizer

    saved, resumed, export_dir = checkpoints
    results = resumed[(stage, world_size)]
    assert all(r["collectives"] == ("grouped" if stage == 3 else None) for r in results)
    saved_owned = _joined_pieces({n: s for r in saved for n, s in r["owned"].items()})
    loaded_owned = _joined_pieces({n: s for r in results for n, s in r["owned"].items()})
    assert any(PIECE.match(n) for r in saved for n in r["owned"])
    assert set(loaded_owned) == set(saved_owned)
    for name, state in saved_owned.items():
        assert set(loaded_owned[name]) == set(state), name
        for key, value in state.items():
            got = loaded_owned[name][key]
            assert torch.equal(got, value) if torch.is_tensor(value) else got == value, (name, key)
    assert_params_equal(results[0]["params"], saved[0]["params"])
    assert results[0]["global_steps"] == SAVE_STEPS

    # The single-process optimizer from the consolidated export, fed the resumed run's gradients.
    replay = Replay(OPTIMIZERS["muon"], make_model, clip=1.0, split_numel=RESUME_SPLIT_NUMEL if stage == 3 else None)
    exported = load_consolidated_model(export_dir)
    with torch.no_grad():
        for name, param in replay.model.named_parameters():
            param.copy_(exported[name])
    replay.optimizer.load_state_dict_by_name(load_consolidated_optimizer(export_dir))
    assert_params_equal(replay.params(), saved[0]["params"])
    for grads in merged_grads(results):
        replay.step(grads)
    assert_params_equal(results[0]["final"], replay.params())


def _joined_pieces(owned: dict[str, dict]) -> dict[str, dict]:
    """Per-item states (master and optimizer state) joined per tensor: pieces' tensors concatenated
    in element order; every state tensor of an item's size is compared flat (a piece is flat, the
    same tensor owned whole has its shape); other entries must agree across pieces."""
    parts: dict[str, list[tuple[int, dict]]] = {}
    for item, state in owned.items():
        match = PIECE.match(item)
        parts.setdefault(match["tensor"] if match else item, []).append((int(match["start"]) if match else 0, state))
    joined = {}
    for tensor, pieces in parts.items():
        pieces.sort(key=lambda part: part[0])
        first = pieces[0][1]
        state = {}
        for key, value in first.items():
            if torch.is_tensor(value) and value.numel() == first["master"].numel():
                state[key] = torch.cat([s[key].reshape(-1) for _, s in pieces])
            else:
                assert all(torch.equal(s[key], value) if torch.is_tensor(value) else s[key] == value
                           for _, s in pieces), (tensor, key)
                state[key] = value
        joined[tensor] = state
    return joined


def _frozen_names(model) -> list[str]:
    """The state_dict names of the frozen parameters (a tied one under each of its names)."""
    return [n for n, p in model.state_dict(keep_vars=True).items() if isinstance(p, torch.nn.Parameter)
            and not p.requires_grad]


def _replay_from_export(export_dir: str, results: list[dict], split_numel: int | None = None) -> dict[str, torch.Tensor]:
    """The single-process optimizer started from the consolidated export (frozen parameters
    included) and fed each step's averaged gradients of ``results`` (one dict per rank)."""
    from ds_canzona.consolidate import load_consolidated_model, load_consolidated_optimizer
    from zero3_workers import make_lora_model

    replay = Replay(OPTIMIZERS["muon"], make_lora_model, clip=CLIP, split_numel=split_numel)
    exported = load_consolidated_model(export_dir)
    with torch.no_grad():
        for name, param in replay.model.named_parameters():
            param.copy_(exported[name])
    replay.optimizer.load_state_dict_by_name(load_consolidated_optimizer(export_dir))
    for grads in merged_grads(results):
        replay.step(grads)
    return replay.params()


def test_stage3_checkpoint_holds_frozen_parameters_whole_and_can_leave_them_out(frozen_checkpoints, one_thread):
    """A LoRA model at stage 3 DP=2 (base weights frozen, on DeepSpeed's even layout): the manifest
    holds every frozen parameter whole, equal to the value it was built with, also when saved in the
    middle of an accumulation with some of them gathered; with exclude_frozen_parameters=True it holds
    none, and the load keeps the engine's own frozen values. A save whose ranks disagree on the frozen
    parameters, or where one rank fails to copy one, raises on every rank and leaves them in step."""
    from ds_canzona.zero.checkpoint import read_meta
    from zero3_workers import make_lora_model

    results, save_dir, _ = frozen_checkpoints
    built, other = make_lora_model(), make_lora_model(seed=5)
    frozen = _frozen_names(built)
    assert "frozen_scale" in frozen and "layers.0.q_proj.base.weight" in frozen and "lm_head.weight" in frozen
    meta = read_meta(f"{save_dir}/frozen")
    assert not meta["frozen_excluded"] and sorted(meta["module_extra"]) == sorted(frozen)
    built_values = built.state_dict()
    for name in frozen:
        assert torch.equal(meta["module_extra"][name], built_values[name]), name

    excluded = read_meta(f"{save_dir}/no_frozen")
    assert excluded["frozen_excluded"] and excluded["module_extra"] == {}
    loaded = results[0]["no_frozen"]
    saved = results[0]["saved"]
    other_values = dict(other.named_parameters())
    for name, value in loaded.items():
        assert torch.equal(value, other_values[name] if name in frozen else saved[name]), name

    # Saved after a forward and backward: a persistent frozen parameter still gathered then (the root
    # module's frozen_scale) was read as it was, the others were gathered for the save.
    gathered = results[0]["gathered_at_mid_save"]
    assert all(r["gathered_at_mid_save"] == gathered for r in results)
    assert "frozen_scale" in gathered and "layers.0.q_proj.base.weight" not in gathered
    # Failed saves: the same error on every rank (none waits in a gather the others skipped).
    for r in results:
        assert "ranks hold different ZeRO-3 frozen parameters" in r["failed_saves"]["lists"]
        assert "gathering the ZeRO-3 frozen parameters failed on rank" in r["failed_saves"]["copy"]
    assert "MemoryError: injected" in results[0]["failed_saves"]["copy"]
    assert "rank(s) [0]" in results[1]["failed_saves"]["copy"]
    mid = read_meta(f"{save_dir}/mid")["module_extra"]
    assert sorted(mid) == sorted(frozen)
    for name in frozen:
        assert torch.equal(mid[name], other.state_dict()[name]), name


def test_stage3_checkpoint_with_frozen_parameters_loads_at_stage3_and_stage2_and_training_continues_exactly(
        frozen_checkpoints, checkpoints, one_thread):
    """The stage-3 DP=2 checkpoint with frozen parameters, loaded into engines whose values (frozen ones
    included) differ: every parameter, gathered whole, equals the saved one (torch.equal). Stage 3 at
    DP=2 then continues exactly like the run that did not stop; stage 2 at DP=2 and stage 3 at DP=3
    exactly like the single-process optimizer started from the consolidated export and fed their
    owners' gradients. A stage-2 checkpoint saved from the stage-2 load loads back at stage 3 DP=2
    (its frozen values into DeepSpeed's even partitions) and also continues like the run that did not
    stop."""
    from zero3_workers import make_lora_model

    results, _, export_dir = frozen_checkpoints
    saved, uninterrupted = results[0]["saved"], results[0]["uninterrupted"]
    # Every loading engine starts from these values: each parameter differs from the saved one.
    other = dict(make_lora_model(seed=5).named_parameters())
    assert all(not torch.equal(saved[n], other[n]) for n in saved)

    for key in ("stage3", "stage2", "stage3_from_stage2"):
        for r in results:
            assert_params_equal(r[key]["loaded"], saved)
            assert r[key]["global_steps"] == FROZEN_SAVE_STEPS
    for key in ("stage3", "stage3_from_stage2"):
        for r in results:
            assert_params_equal(r[key]["final"], uninterrupted)
    stage2 = [r["stage2"] for r in results]
    assert_params_equal(stage2[0]["final"], _replay_from_export(export_dir, stage2))

    _, resumed, _ = checkpoints
    dp3 = [r["frozen"] for r in resumed[(3, 3)]]
    for r in dp3:
        assert_params_equal(r["loaded"], saved)
        assert r["global_steps"] == FROZEN_SAVE_STEPS
    assert_params_equal(dp3[0]["final"], _replay_from_export(export_dir, dp3, split_numel=RESUME_SPLIT_NUMEL))


@pytest.mark.parametrize("version", ["0.18.9", "0.20.0", "1.19.0"])
def test_stage3_is_refused_on_deepspeed_releases_it_was_not_checked_against(version):
    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.zero.versions import check_stage3_version

    with pytest.raises(CanzonaConfigError, match=f"zero_optimization.stage 3 .* found {version}"):
        check_stage3_version(version)
    for checked in ("0.19.0", "0.19.7", "0.19.8+local"):  # scripts/compat.sh ran stage 3 on each
        check_stage3_version(checked)
