"""The consolidated export of a HuggingFace model loads with ``from_pretrained`` as the trained model.

A tiny transformers Qwen3 trains 2 steps on 2 gloo ranks (ZeRO-2, Muon, fp32) and saves; then
``ds-canzona consolidate`` writes the export and ``Qwen3ForCausalLM.from_pretrained(OUT)`` must
give the live model's weights and its eval loss, bit for bit: the weights are the fp32 masters,
which are the fp32 parameters, and the forward runs the same code on one thread as the rank did.

The whole run happens under umask 027, so every file the save and the export write must be 0640:
the ordinary umask-respecting mode, not safetensors' own 0600.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from checkpoint_workers import EVAL_SEED, QWEN3_TINY, eval_loss, hf_export_run
from distributed import run_ranks
from zero_workers import make_config

pytest.importorskip("transformers")

UMASK = 0o027


def modes(directory: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(directory, name)).st_mode & 0o777 for name in os.listdir(directory)}


def test_consolidated_export_loads_with_from_pretrained(tmp_path, capsys):
    from transformers import Qwen3ForCausalLM

    from ds_canzona.cli import main

    save_dir, out = str(tmp_path / "ckpt"), str(tmp_path / "export")
    previous = os.umask(UMASK)  # spawned ranks inherit it
    try:
        live = run_ranks(hf_export_run, 2, make_config(2), save_dir, 2, timeout=600)[0]
        capsys.readouterr()
        assert main(["consolidate", save_dir, out]) == 0
    finally:
        os.umask(previous)
    printed = capsys.readouterr().out
    assert "note:" not in printed, printed
    assert {"model.safetensors", "config.json", "generation_config.json", "training_state.json"} <= set(
        os.listdir(out))

    with open(os.path.join(out, "config.json")) as f:
        settings = json.load(f)
    # the exported masters' dtype, as save_pretrained records it ("torch_dtype" before transformers 5)
    assert settings.get("dtype", settings.get("torch_dtype")) == "float32"

    expected = 0o666 & ~UMASK
    written = {**modes(save_dir), **modes(os.path.join(save_dir, "hf")), **modes(out)}
    written.pop("hf")  # the tag directory
    # The recovery scripts with DeepSpeed's command line are executable, as a new executable would be.
    scripts = {name: written.pop(name) for name in ("zero_to_fp32.py", "zero_to_torch.py")}
    assert scripts == dict.fromkeys(scripts, 0o777 & ~UMASK), {k: oct(v) for k, v in scripts.items()}
    assert written and all(mode == expected for mode in written.values()), {k: oct(v) for k, v in written.items()}

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as the rank: BLAS blocking depends on the thread count
    try:
        model = Qwen3ForCausalLM.from_pretrained(out)
        loss = eval_loss(model)
    finally:
        torch.set_num_threads(threads)
    assert {k: model.config.to_dict()[k] for k in QWEN3_TINY} == QWEN3_TINY  # the trained model, not the 8B default
    assert model.generation_config.eos_token_id == QWEN3_TINY["eos_token_id"]
    weights = model.state_dict()
    assert weights.keys() == live["weights"].keys()
    assert all(torch.equal(weights[k], live["weights"][k]) for k in weights)
    assert torch.equal(loss, live["loss"]), (f"eval loss on batch {EVAL_SEED}: exported {loss.item()!r}, "
                                             f"live {live['loss'].item()!r}")
