"""Checkpoints: any plan loads any other plan's checkpoint, bit for bit; crashes lose nothing.

One DP=4 run (stage 2, the AdamW embedding in pieces of 400 elements) trains 3 steps with every
optimizer kind and WarmupLR and saves. Then, at DP=2 (stage 1, other alpha and bucket size, every
tensor whole) and DP=3 (stage 2, start-index cuts, other bucket size, pieces of 500), each in one
spawned run:

* bad copies of the checkpoint (truncated, missing and mismatched shard) and a different model
  fail with a clear error on every rank, and leave the engine untouched;
* the load gathers, by name, exactly the saved masters and optimizer state (torch.equal), plus
  buffers, frozen and tied parameters, lr scheduler, lrs, counters, client state and a dynamic
  loss scaler's state;
* 5 more steps equal 5 steps of an engine started at that size from the same state handed over
  directly (the consolidated files), not through load_checkpoint;
* a save at that size after 2 of them, loaded into a fresh engine, continues exactly as the run
  that never stopped (stage 1 at DP=2, stage 2 at DP=3);
* the DP=2 save, consolidated, drives the single-process optimizer to the same parameters;
* DeepSpeed's own tools read the DP=4 and DP=2 saves: its zero_to_fp32 functions (wrapped by
  ``import ds_canzona``) and the zero_to_fp32.py / zero_to_torch.py each save leaves beside its tags;
* ``engine.optimizer.state_dict()`` (and the wrapped optimizer's) is each rank's owned state.

Failures (own processes, killed on purpose): SIGKILL during a save leaves the previous
checkpoint, which resumes losing no committed step; a rank SIGKILLed in training, and one that
hangs, make the others fail within canzona.comm_timeout_s.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time

import pytest
import torch
import torch.multiprocessing as mp

from checkpoint_workers import (SCALER_STATE, ckpt_config, crash_during_save, failure_entry, hang_in_training,
                                load_owned, make_ckpt_model, make_optimizer, reshard_run, resume_then_die, save_run,
                                stack_reshard_run)
from distributed import free_port, run_ranks
from zero_workers import make_config

from ds_canzona.consolidate import (consolidate_checkpoint, fp32_state_dict_from_checkpoint, load_consolidated_model,
                                    load_consolidated_optimizer, optimizer_state_from_checkpoint)
from ds_canzona.zero.checkpoint import (FORMAT, LATEST_FILE, META_FILE, Checkpoint, CheckpointError, check_same_model,
                                        read_meta)

SAVE_STEPS = 3
SAVE_SPLIT = 400  # the 61 x 24 embedding (tied head) is saved in 4 pieces
RESHARD = {
    2: {"stage": 1, "alpha": 0.0, "bucket_numel": 6000},
    3: {"stage": 2, "alpha": 0.5, "bucket_numel": 2500, "strategy": "start_index", "split_numel": 500},
}
PIECE = re.compile(r"^(?P<tensor>.+)\[(?P<start>\d+):(?P<stop>\d+)\]$")


def merged_owned(states: list[dict]) -> dict:
    """Per-rank {name: state} dicts as one; every tensor must have exactly one owner."""
    out = {}
    for owned in states:
        assert not set(out) & set(owned), "a tensor is owned by two ranks"
        out.update(owned)
    return out


def by_tensor(items: dict) -> dict:
    """{item name: {key: value}} per whole tensor: pieces ("name[a:b]") joined in element order.

    Every tensor shaped like its master (the master, elementwise state) is flattened, so whole and
    joined tensors compare element for element; the rest (step counters, factors) must agree
    across the pieces of a tensor.
    """
    parts: dict[str, list[tuple[int, dict]]] = {}
    for name, fields in items.items():
        match = PIECE.match(name)
        tensor, start = (match["tensor"], int(match["start"])) if match else (name, 0)
        parts.setdefault(tensor, []).append((start, fields))
    out = {}
    for tensor, pieces in parts.items():
        pieces.sort(key=lambda piece: piece[0])
        joined: dict = {}
        for _, fields in pieces:
            shape = fields["master"].shape
            for key, value in fields.items():
                if torch.is_tensor(value) and value.dim() > 0 and value.shape == shape:
                    joined.setdefault(key, []).append(value.reshape(-1))
                elif key in joined:
                    assert torch.equal(joined[key], value), f"{tensor}[{key}] differs between its pieces"
                else:
                    joined[key] = value
        out[tensor] = {key: torch.cat(value) if isinstance(value, list) else value for key, value in joined.items()}
    return out


def assert_equal_dicts(a: dict, b: dict, what: str) -> None:
    assert a.keys() == b.keys(), f"{what}: names differ: {sorted(set(a) ^ set(b))[:5]}"
    for name in a:
        if isinstance(a[name], dict):
            assert_equal_dicts(a[name], b[name], f"{what}[{name}]")
        else:
            assert torch.equal(a[name], b[name]), f"{what}: {name} differs"


def shard_path(directory: str, rank: int) -> str:
    meta = read_meta(directory)
    return os.path.join(directory, meta["files"][rank]["name"])


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("ckpt")


@pytest.fixture(scope="module")
def saved(workdir):
    save_dir = str(workdir / "dp4")
    results = run_ranks(save_run, 4, ckpt_config(4, split_numel=SAVE_SPLIT), save_dir, SAVE_STEPS, timeout=600)
    return save_dir, results


@pytest.fixture(scope="module")
def export(saved, workdir):
    out = str(workdir / "export")
    consolidate_checkpoint(saved[0], out, optimizer_states=True)
    return out


@pytest.fixture(scope="module")
def bad_copies(saved, workdir):
    save_dir = saved[0]
    copies = {}
    for label in ("truncated", "missing", "mismatched"):
        copy = str(workdir / f"bad_{label}")
        shutil.copytree(save_dir, copy)
        copies[label] = copy
    tag = os.path.join(copies["truncated"], "dp4")
    path = shard_path(tag, 1)
    with open(path, "r+b") as f:
        f.truncate(os.path.getsize(path) // 2)
    os.remove(shard_path(os.path.join(copies["missing"], "dp4"), 2))
    # the same rank's file of another save: same size, another save id in its header
    shutil.copyfile(shard_path(os.path.join(save_dir, "scaler"), 3),
                    shard_path(os.path.join(copies["mismatched"], "dp4"), 3))
    return copies


@pytest.fixture(scope="module")
def resharded(saved, export, bad_copies, workdir):
    cache = {}

    def get(world_size: int) -> list[dict]:
        if world_size not in cache:
            settings = dict(RESHARD[world_size])
            config = ckpt_config(world_size, stage=settings.pop("stage"), **settings)
            wrong = make_config(world_size) if world_size == 3 else None
            mid = str(workdir / f"mid{world_size}")
            cache[world_size] = run_ranks(reshard_run, world_size, config, saved[0], bad_copies, export, mid, wrong,
                                          timeout=600)
        return cache[world_size]

    return get


# ----------------------------------------------------------------------------- resharding


@pytest.mark.parametrize("world_size", [2, 3])
def test_load_at_another_world_size_is_bitwise(saved, resharded, world_size):
    before, after = saved[1], resharded(world_size)
    saved_items = merged_owned([r["owned"] for r in before])
    assert any(PIECE.match(name) for name in saved_items), "the saving run should hold pieces"
    assert_equal_dicts(by_tensor(merged_owned([r["loaded"]["owned"] for r in after])), by_tensor(saved_items),
                       "masters and optimizer state")
    for r in after:
        loaded = r["loaded"]
        assert_equal_dicts(loaded["module"], before[0]["module"], "module state")  # buffers, frozen, tied
        assert loaded["scheduler"] == before[0]["scheduler"]
        assert loaded["lrs"] == before[0]["lrs"]
        assert loaded["counters"] == before[0]["counters"]
        assert r["client_state"]["note"] == "hello" and torch.equal(r["client_state"]["ids"], torch.arange(3))
        assert r["scaler"] == SCALER_STATE


@pytest.mark.parametrize("world_size", [2, 3])
def test_a_load_at_another_global_batch_warns_once_on_rank_0(saved, resharded, world_size, workdir):
    """Saved at DP=4 with micro-batch 2 x 2 accumulation steps (16); the same config file at 2 or 3 ranks."""
    assert read_meta(os.path.join(saved[0], "dp4"))["batch"] == {
        "train_batch_size": 16, "micro_batch_per_gpu": 2, "gradient_accumulation_steps": 2, "data_parallel_size": 4}
    results = resharded(world_size)
    warnings = [[m for m in r["load_warnings"] if "global batch" in m] for r in results]
    assert len(warnings[0]) == 1 and not any(warnings[1:]), warnings
    text = warnings[0][0]
    assert ("this checkpoint was trained with a global batch of 16 samples per optimizer step (4 ranks x "
            "micro-batch 2 x 2 accumulation steps); this run takes "
            f"{4 * world_size} ({world_size} ranks x micro-batch 2 x 2 accumulation steps)") in text, text
    keep = {2: "To keep 16: set train_micro_batch_size_per_gpu 2 and gradient_accumulation_steps 4 "
               "(2 x 4 x 2 ranks = 16",
            3: "To keep 16: 16 is not a multiple of 3 ranks, so no micro-batch and accumulation keep it at this "
               "size: the nearest global batches are 15 and 18"}
    assert keep[world_size] in text, text
    assert all(not r["same_size_load_warnings"] for r in results), "same batch: no warning"
    # one line on rank 0 says where the save went
    mid = os.path.join(str(workdir / f"mid{world_size}"), "mid")
    assert results[0]["save_printed"] == (f"ds_canzona: saved checkpoint 'mid' to {mid} ({world_size} shard files, "
                                          "latest updated)\n")
    assert all(r["save_printed"] == "" for r in results[1:])


def test_batch_warning_text():
    """The case a user met (8 -> 12 going from 2 to 3 ranks), the way back, and a manifest without the record."""
    from ds_canzona.zero.checkpoint.batch import batch_change_warning, batch_record

    def record(ranks, micro=4, accumulation=1):
        return batch_record(train_batch_size=ranks * micro * accumulation, micro_batch=micro,
                            accumulation=accumulation, ranks=ranks)

    assert batch_change_warning(record(2), 2, record(3)) == (
        "ds_canzona: this checkpoint was trained with a global batch of 8 samples per optimizer step (2 ranks x "
        "micro-batch 4 x 1 accumulation steps); this run takes 12 (3 ranks x micro-batch 4 x 1 accumulation steps), "
        "so every step from here on sees more data than before. To keep 8: 8 is not a multiple of 3 ranks, so no "
        "micro-batch and accumulation keep it at this size: the nearest global batches are 6 and 9, or resume at a "
        "world size that divides 8")
    assert batch_change_warning(record(3), 3, record(2)).endswith(
        "sees less data than before. To keep 12: set train_micro_batch_size_per_gpu 3 and gradient_accumulation_steps "
        "2 (3 x 2 x 2 ranks = 12; with the HF Trainer: per_device_train_batch_size and gradient_accumulation_steps), "
        "or set train_batch_size 12 and leave gradient_accumulation_steps out so that DeepSpeed derives it")
    assert batch_change_warning(record(2), 2, record(4, micro=2)) is None  # same batch at another world size
    old = batch_change_warning(None, 3, record(2))
    assert "saved at 3 data-parallel ranks and is loaded at 2" in old and "does not record its global batch" in old
    assert batch_change_warning(None, 2, record(2)) is None


@pytest.mark.parametrize("world_size", [2, 3])
def test_continuing_equals_a_run_started_at_that_size(resharded, world_size):
    results = resharded(world_size)
    for r in results:
        assert_equal_dicts(r["continued"], r["reference"], "continued vs started from the same state")
        assert_equal_dicts(r["continued"], results[0]["continued"], "ranks agree")


@pytest.mark.parametrize("world_size", [2, 3])
def test_same_world_size_resume_equals_not_stopping(resharded, world_size):
    """DP=2 runs stage 1, DP=3 stage 2: save, load into a fresh engine, continue."""
    for r in resharded(world_size):
        assert_equal_dicts(r["resumed"], r["continued"], "resumed vs never stopped")


def test_single_process_continues_from_the_consolidated_export(resharded, workdir):
    from ds_canzona.optim.clipping import clip_coefficient, tensor_sq_norm

    results = resharded(2)
    out = str(workdir / "export_mid2")
    consolidate_checkpoint(str(workdir / "mid2"), out, optimizer_states=True)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the ranks: BLAS blocking depends on the thread count
    try:
        model = make_ckpt_model(seed=7)
        model.load_state_dict(load_consolidated_model(out), strict=True)
        optimizer = make_optimizer(model)
        optimizer.load_state_dict_by_name(load_consolidated_optimizer(out))
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        for s in range(len(results[0]["captured"])):
            grads = {}
            for r in results:
                grads.update(r["captured"][s]["grads"])
            ordered = [grads[n].clone() for n, _ in named]
            _, coefficient = clip_coefficient(torch.stack([tensor_sq_norm(g) for g in ordered]), 1.0)
            for (_, p), g in zip(named, ordered):
                p.grad = g.mul_(coefficient) if coefficient < 1.0 else g
            for group, lr in zip(optimizer.param_groups, results[0]["captured"][s]["lrs"]):
                group["lr"] = lr
            optimizer.step()
    finally:
        torch.set_num_threads(threads)
    assert_equal_dicts({n: p.detach() for n, p in model.named_parameters()}, results[0]["continued"],
                       "single process vs DP=2")


def test_pieces_load_from_a_whole_tensor_checkpoint(resharded, workdir):
    """DP=2 saved every tensor whole (mid2); DP=3 with pieces of 300 reads its pieces out of them."""
    resharded(2)  # writes mid2
    out = str(workdir / "export_mid2_pieces")
    consolidate_checkpoint(str(workdir / "mid2"), out, optimizer_states=True)
    model, states = load_consolidated_model(out), load_consolidated_optimizer(out)
    loaded = merged_owned(run_ranks(load_owned, 3, ckpt_config(3, split_numel=300), str(workdir / "mid2"),
                                    timeout=600))
    assert any(PIECE.match(name) for name in loaded)
    expected = {n: {"master": model[n], **s} for n, s in states.items()}
    assert_equal_dicts(by_tensor(loaded), by_tensor(expected), "pieces read from whole tensors")


# ----------------------------------------------------------------------------- DeepSpeed's own tools


def test_deepspeeds_zero_to_fp32_functions_read_our_checkpoints(saved, resharded, workdir):
    """get_fp32_state_dict_from_zero_checkpoint & co. (wrapped by import ds_canzona) on a DP=4 and a DP=2 save."""
    import deepspeed.utils.zero_to_fp32 as zero_to_fp32
    from ds_canzona.zero.checkpoint import META_FILE, CheckpointError
    from ds_canzona.zero.deepspeed_tools import _MANIFEST

    assert _MANIFEST == META_FILE
    save_dir, results = saved
    # The engine's own parameters at the save (fp32 model: they are the masters), DeepSpeed's reading of them.
    theirs = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir)  # tag from 'latest'
    engine_module = results[0]["module"]
    assert theirs.keys() == engine_module.keys()
    assert all(torch.equal(theirs[k], engine_module[k]) for k in theirs)
    lazy = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="dp4", lazy_mode=True)
    assert all(torch.equal(lazy[k].contiguous(), theirs[k]) for k in theirs)

    resharded(2)  # writes mid2 from a 2-rank engine
    mid2 = str(workdir / "mid2")
    model = zero_to_fp32.load_state_dict_from_zero_checkpoint(make_ckpt_model(seed=5), mid2)
    ours = fp32_state_dict_from_checkpoint(mid2)
    assert_equal_dicts(model.state_dict(), ours, "load_state_dict_from_zero_checkpoint")
    out = str(workdir / "deepspeed_convert")
    zero_to_fp32.convert_zero_checkpoint_to_fp32_state_dict(mid2, out, max_shard_size="4KB")
    with open(os.path.join(out, "pytorch_model.bin.index.json")) as f:
        files = set(json.load(f)["weight_map"].values())
    converted = {k: v for name in files for k, v in torch.load(os.path.join(out, name), weights_only=True).items()}
    assert len(files) > 1 and converted.keys() == ours.keys()
    assert_equal_dicts(converted, ours, "convert_zero_checkpoint_to_fp32_state_dict")

    with pytest.raises(CheckpointError, match="exclude_frozen_parameters"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(mid2, exclude_frozen_parameters=True)
    # A folder of DeepSpeed's own format (here: none at all) still goes to DeepSpeed's code.
    os.makedirs(workdir / "not_ours" / "tag", exist_ok=True)
    with pytest.raises(FileNotFoundError, match="model_states"):
        zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(str(workdir / "not_ours"), tag="tag")


def test_the_recovery_scripts_in_the_save_dir_take_deepspeeds_command_line(resharded, workdir):
    """python <save_dir>/zero_to_fp32.py SAVE_DIR OUT, as for a DeepSpeed checkpoint; zero_to_torch.py too."""
    import subprocess
    import sys

    from safetensors.torch import load_file
    from ds_canzona.zero.deepspeed_tools import main

    resharded(2)
    mid2 = str(workdir / "mid2")
    assert all(os.access(os.path.join(mid2, name), os.X_OK) for name in ("zero_to_fp32.py", "zero_to_torch.py"))
    out = str(workdir / "script_fp32")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([root, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, os.path.join(mid2, "zero_to_fp32.py"), mid2, out, "--safe_serialization"],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    ours = fp32_state_dict_from_checkpoint(mid2)
    assert_equal_dicts(load_file(os.path.join(out, "model.safetensors")), ours, "zero_to_fp32.py")
    # zero_to_torch.py's entry, in this process (the command line above is the same code).
    out_bf16 = str(workdir / "script_bf16")
    assert main("torch", [mid2, out_bf16, "--dtype", "bf16", "-t", "mid"]) == 0
    bf16 = torch.load(os.path.join(out_bf16, "pytorch_model.bin"), weights_only=True)
    assert_equal_dicts(bf16, {k: v.bfloat16() if v.is_floating_point() else v for k, v in ours.items()},
                       "zero_to_torch.py --dtype bf16")


def test_the_torch_state_api_describes_each_ranks_owned_state(saved):
    """engine.optimizer.state_dict() and engine.optimizer.optimizer.state_dict(): this rank's owned state, by name."""
    _, results = saved
    every_name = set()
    for rank, result in enumerate(results):
        api, owned = result["torch_state_api"], result["owned"]
        for which in ("runtime", "basic"):
            described = api[which]
            assert (described["rank"], described["world_size"]) == (rank, len(results))
            assert described["state"].keys() == owned.keys()
            for name, entry in described["state"].items():
                assert entry.keys() == owned[name].keys() - {"master"}, name
                assert all(torch.equal(entry[k], owned[name][k]) for k in entry), name
            grouped = [name for group in described["param_groups"] for name in group["params"]]
            assert sorted(grouped) == sorted(owned)
            kinds = {group["kind"] for group in described["param_groups"] if group["params"]}
            assert kinds <= {"muon", "normuon", "adamuon", "shampoo", "soap", "adamw"} and kinds
        every_name |= set(api["runtime"]["state"])
        # DeepSpeed's names where the meaning is the same.
        keys = {k for entry in api["runtime"]["state"].values() for k in entry}
        assert keys >= {"step", "exp_avg", "exp_avg_sq"}, keys
        assert all(refusal and "engine.load_checkpoint" in refusal for refusal in api["load_refusals"])
    # Every rank's owned items together are the whole model's, each once.
    assert sum(len(r["torch_state_api"]["runtime"]["state"]) for r in results) == len(every_name)
    described = [entry for r in results for entry in r["torch_state_api"]["runtime"]["state"].values()]
    assert any("momentum_buffer" in entry for entry in described)


def test_bad_checkpoints_fail_on_every_rank(resharded, bad_copies):
    results = resharded(2)
    needles = {"truncated": "canzona_rank00001-", "missing": "canzona_rank00002-", "mismatched": "canzona_rank00003-"}
    for label in ("truncated", "missing", "mismatched", "different_model"):
        messages = [r["errors"][label] for r in results]
        assert all(m is not None for m in messages), f"{label}: a rank loaded it: {messages}"
        if label == "different_model":
            assert all("different model" in m and "differ in shape" in m for m in messages), messages
        else:  # the rank that reads the file names it; the others name that rank
            assert any(f"bad_{label}" in m and needles[label] in m for m in messages), (label, messages)
    assert all(r["untouched"] for r in results), "a failed load changed the engine"
    other_kinds = [r["errors"]["other_kinds"] for r in resharded(3)]
    assert all(m is not None and "kinds" in m for m in other_kinds), other_kinds


# ----------------------------------------------------------------------------- consolidation, in this process


def test_consolidated_export_is_the_saved_state(saved, export):
    results = saved[1]
    owned = by_tensor(merged_owned([r["owned"] for r in results]))
    model = load_consolidated_model(export)
    module = results[0]["module"]
    assert model.keys() == module.keys()  # trained, tied alias, frozen, buffer
    for name, tensor in model.items():
        if name in owned:  # pieces joined again, in the tensor's shape
            assert list(tensor.shape) == list(module[name].shape), name
            assert torch.equal(tensor.reshape(-1), owned[name]["master"].reshape(-1)), name
        else:
            assert torch.equal(tensor, module[name]), name
    assert torch.equal(model["lm_head.weight"], model["embed_tokens.weight"])
    states = load_consolidated_optimizer(export)
    assert states["embed_tokens.weight"]["exp_avg"].shape == module["embed_tokens.weight"].shape
    with_masters = {n: {"master": model[n], **s} for n, s in states.items()}
    assert_equal_dicts(by_tensor(with_masters), owned, "optimizer state")
    kinds = {k for s in states.values() for k in s}
    assert {"momentum_buffer", "left_root.0.0", "left_basis", "exp_avg_sq", "row_second_moment",
            "second_moment"} <= kinds
    assert_equal_dicts(fp32_state_dict_from_checkpoint(saved[0]), model, "in-memory export")
    assert_equal_dicts(optimizer_state_from_checkpoint(saved[0], "dp4"), states, "in-memory optimizer state")


def test_sharded_export_and_cli(saved, export, workdir, capsys):
    from ds_canzona.cli import main

    out = str(workdir / "export_cli")
    assert main(["consolidate", saved[0], out, "--optimizer-states", "--max-shard-size", "20KB"]) == 0
    files = os.listdir(out)
    assert "model.safetensors.index.json" in files and "optimizer.safetensors.index.json" in files
    assert len([f for f in files if f.startswith("model-")]) > 1
    assert_equal_dicts(load_consolidated_model(out), load_consolidated_model(export), "sharded model")
    assert_equal_dicts(load_consolidated_optimizer(out), load_consolidated_optimizer(export), "sharded optimizer")
    # a plain torch module has no HuggingFace config: the output says what to add for from_pretrained
    printed = capsys.readouterr().out
    assert "config.json" not in files
    assert "note: the checkpoint holds no HuggingFace config" in printed and "add the model's config.json" in printed
    # a second, unsharded export into the same directory replaces the shards
    assert main(["consolidate", os.path.join(saved[0], "dp4"), out]) == 0
    assert "model.safetensors" in os.listdir(out) and "model.safetensors.index.json" not in os.listdir(out)
    capsys.readouterr()
    assert main(["consolidate", str(workdir / "nowhere"), out]) == 2
    assert "checkpoint directory is missing" in capsys.readouterr().err


def test_broken_checkpoints_name_the_file(saved, bad_copies, workdir):
    for label, needle in (("truncated", "canzona_rank00001-"), ("missing", "canzona_rank00002-"),
                          ("mismatched", "canzona_rank00003-")):
        with pytest.raises(CheckpointError, match=needle):
            consolidate_checkpoint(bad_copies[label], str(workdir / "unused"))
    # same size, corrupt header
    corrupt = str(workdir / "bad_header")
    shutil.copytree(saved[0], corrupt)
    path = shard_path(os.path.join(corrupt, "dp4"), 0)
    with open(path, "r+b") as f:
        f.write(b"\xff" * 16)
    with pytest.raises(CheckpointError, match="truncated or corrupt.*canzona_rank00000-"):
        Checkpoint.open(corrupt).validate()
    # an incomplete save: shards without a manifest
    os.remove(os.path.join(corrupt, "dp4", META_FILE))
    with pytest.raises(CheckpointError, match="manifest is missing"):
        Checkpoint.open(corrupt)
    # a 'latest' that points outside the directory
    with open(os.path.join(corrupt, LATEST_FILE), "w") as f:
        f.write("../dp4")
    with pytest.raises(CheckpointError, match="invalid checkpoint tag"):
        Checkpoint.open(corrupt)
    meta = read_meta(os.path.join(saved[0], "dp4"))
    whole = Checkpoint.open(saved[0], "dp4")
    shapes = {name: whole.tensor_shape(name) for name in whole.tensor_names}  # pieces joined
    shapes["layers.0.q_proj.weight"] = [25, 24]
    shapes["extra.weight"] = [3]
    del shapes["norm.weight"]
    with pytest.raises(CheckpointError, match=r"different model.*extra\.weight.*norm\.weight.*q_proj"):
        check_same_model(meta, shapes, "X")


class _OpensAFile:
    """Unpickling this would create a file: a stand-in for code a checkpoint must never run."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_manifest_is_never_unpickled_into_code(saved, workdir):
    evil = str(workdir / "evil")
    shutil.copytree(saved[0], evil)
    marker = str(workdir / "code_ran")
    meta_path = os.path.join(evil, "dp4", META_FILE)
    meta = read_meta(os.path.join(saved[0], "dp4"))
    meta["client_state"] = {"x": _OpensAFile(marker)}
    torch.save(meta, meta_path)
    with pytest.raises(CheckpointError, match="not plain data"):
        Checkpoint.open(evil)
    assert not os.path.exists(marker)
    torch.save({"format": "something else"}, meta_path)
    with pytest.raises(CheckpointError, match=f"not a {FORMAT}"):
        read_meta(os.path.join(evil, "dp4"))


# ----------------------------------------------------------------------------- failures


def run_with_failures(fn, world_size: int, outdir: str, *args, timeout: float, hung_rank: int | None = None) -> dict:
    """Spawn ranks that are expected to die; exit codes and exit times (a hung rank is killed at the end)."""
    context = mp.get_context("spawn")
    port = free_port()
    procs = [context.Process(target=failure_entry, args=(r, world_size, port, outdir, fn, args + (outdir,)))
             for r in range(world_size)]
    for p in procs:
        p.start()
    exited: dict[int, float] = {}
    deadline = time.monotonic() + timeout
    try:
        while len(exited) < world_size and time.monotonic() < deadline:
            for r, p in enumerate(procs):
                if r not in exited and not p.is_alive():
                    exited[r] = time.time()
            if hung_rank is not None and all(r in exited for r in range(world_size) if r != hung_rank):
                break
            time.sleep(0.1)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join()
    return {"exitcode": [p.exitcode for p in procs], "exited": exited}


def _killed_at(outdir: str) -> float:
    with open(os.path.join(outdir, "killed")) as f:
        return float(f.read())


def _error(outdir: str, rank: int) -> tuple[float, str]:
    with open(os.path.join(outdir, f"rank{rank}.err")) as f:
        when, _, text = f.read().partition("\n")
    return float(when), text


BOUND_S = 20.0


def _bf16_supported() -> bool:
    from deepspeed.accelerator import get_accelerator
    return get_accelerator().is_bf16_supported()


@pytest.mark.skipif(not _bf16_supported(), reason="DeepSpeed's accelerator reports no bf16 on this machine")
def test_sigkill_during_save_keeps_the_previous_checkpoint(workdir):
    save_dir, outdir = str(workdir / "crash"), str(workdir / "crash_out")
    os.makedirs(outdir)
    # bf16: the fp32 masters are not the parameters, so loading must refresh the bf16 copies
    config = ckpt_config(2, comm_timeout_s=BOUND_S, top={"bf16": {"enabled": True}})
    run = run_with_failures(crash_during_save, 2, outdir, config, save_dir, timeout=300)
    killed = _killed_at(outdir)
    assert run["exitcode"][1] == -9
    assert run["exitcode"][0] != 0 and run["exited"][0] - killed < BOUND_S + 15
    assert _error(outdir, 0)[0] - killed < BOUND_S + 2

    # the tag that was being overwritten is still the committed one, whole
    ckpt = Checkpoint.open(save_dir)
    ckpt.validate()
    assert ckpt.meta["engine"]["global_steps"] == 3
    with open(os.path.join(save_dir, LATEST_FILE)) as f:
        assert f.read() == "last"

    # resume in new processes: nothing committed is lost; then a rank dies in training
    resumed_out = str(workdir / "resume_out")
    os.makedirs(resumed_out)
    run = run_with_failures(resume_then_die, 2, resumed_out, config, save_dir, timeout=300)
    for r in range(2):
        resumed = torch.load(os.path.join(resumed_out, f"resumed{r}.pt"))
        assert resumed["global_steps"] == 3
        assert_equal_dicts(resumed["owned"], torch.load(os.path.join(outdir, f"committed{r}.pt")), "committed state")
        assert_equal_dicts(torch.load(os.path.join(resumed_out, f"resumed_step5_{r}.pt")),
                           torch.load(os.path.join(outdir, f"step5_{r}.pt")), "steps 3-4 redone")
    killed = _killed_at(resumed_out)
    assert run["exitcode"][1] == -9
    assert run["exitcode"][0] != 0 and run["exited"][0] - killed < BOUND_S + 15
    assert _error(resumed_out, 0)[0] - killed < BOUND_S + 2


def test_a_hung_rank_makes_the_others_fail_within_comm_timeout(workdir):
    outdir = str(workdir / "hang_out")
    os.makedirs(outdir)
    timeout_s = 6.0
    config = ckpt_config(2, comm_timeout_s=timeout_s)
    run = run_with_failures(hang_in_training, 2, outdir, config, timeout=300, hung_rank=1)
    stopped = _killed_at(outdir)
    when, text = _error(outdir, 0)
    assert run["exitcode"][0] != 0
    assert "Timed out" in text or "timeout" in text.lower(), text[-2000:]
    assert timeout_s - 1 < when - stopped < timeout_s + 5
    assert run["exited"][0] - stopped < timeout_s + 15


def test_expert_stacks_load_across_whole_and_pieces(workdir):
    """The MoE model's 3-D stacks saved whole load into pieces of whole experts, and back, at DP=2:
    resuming is bit for bit not stopping, for rules with state along the experts (NorMuon's row
    moments, the momentum) and per expert by key (Shampoo's statistics and roots, SOAP's bases).

    Clipping is off: whole and in pieces, the clipping norm sums the same squares in another
    grouping, which may move its last bit."""
    optimizers = {
        "normuon": {"type": "NorMuon", "params": {"lr": 0.02, "adam_lr": 0.003}},
        "shampoo": {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}},
        "soap": {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}},
    }
    whole = {"split_numel": 0}
    pieces = {"split_numel": 512, "cost_model": "numel"}  # four one-expert pieces per stack (see test_zero_stage12)
    runs = [(kind, a, b) for kind in optimizers for a, b in ((whole, pieces), (pieces, whole))]
    configs = [tuple(make_config(2, optimizer=optimizers[kind], canzona=dict(side), gradient_clipping=0.0)
                     for side in (a, b)) for kind, a, b in runs]
    results = run_ranks(stack_reshard_run, 2, configs, str(workdir / "stacks"), 2, timeout=600)
    for index, (kind, save_side, _) in enumerate(runs):
        ranked = [r[index] for r in results]
        split_side = "loaded_items" if save_side is whole else "saved_items"
        items = [name for r in ranked for name in r[split_side]]
        assert sum(name.startswith("experts_up[") for name in items) == 4, (kind, items)
        assert_equal_dicts(ranked[0]["resumed"], ranked[0]["going_on"], f"{kind}: resumed vs not stopping")
