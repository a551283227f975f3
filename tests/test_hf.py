"""The HuggingFace Trainer with ds_canzona, through the Trainer's own code (transformers 5.x, accelerate).

- Every shipped config, made into TrainingArguments the documented way
  (``ds_canzona.hf.training_arguments(path, ...)``), goes through the Trainer's whole config
  processing (TrainingArguments' ``trainer_config_process``, ``trainer_config_finalize``,
  accelerate's ``deepspeed_config_process``) up to ``deepspeed.initialize``, which is replaced by
  a stub that keeps the config it receives: no "auto" may be left, the ``canzona`` section and
  DeepSpeed's config model must accept it. One process, no model download.
- ``"kernels": "auto"`` is what collided with the Trainer's placeholders; shown here so that the
  reason for the value's name stays checked.
- On two gloo ranks: ``deepspeed.initialize(config=<HJSON path>)`` builds ds_canzona's optimizer
  (DeepSpeed reads HJSON paths itself); a plain Trainer script without ``use_cpu=True`` on this CPU-only machine
  stops at ``deepspeed.initialize`` with one error saying the fix (both ways the mismatch shows:
  a filled ``train_batch_size``, and a config without one); then the documented HJSON way trains
  two steps with the config's optimizer values, on both ranks, with no warning about the lr
  scheduler stepping before the optimizer; then ``zero2_muon_offload.hjson`` the same way, in
  the same spawn: ds_canzona's optimizer with its masters on the host, the losses and weights
  equal to the run without offload bit for bit, and the Trainer's checkpoint written.
- At stage 3 the same with ``zero3_muon.hjson``, then ``zero3_muon_offload.hjson`` beside it.
"""

from __future__ import annotations

import copy
import json
import warnings
from pathlib import Path

import pytest

from distributed import run_ranks
from test_configs import find_autos

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "ds_configs"
CONFIG_FILES = sorted(p for p in CONFIG_DIR.iterdir() if p.suffix in (".json", ".hjson"))
TINY_MODEL = REPO / "examples" / "configs" / "qwen3-tiny.json"


class _Captured(Exception):
    """Raised by the deepspeed.initialize stand-in once it has the config."""


def _tiny_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**json.loads(TINY_MODEL.read_text())))


def _tiny_trainer(arguments, *, blocks: int = 64):
    from transformers import Trainer

    from ds_canzona.data_utils import BlockDataset, load_corpus, token_blocks

    model = _tiny_model()
    dataset = BlockDataset(token_blocks(load_corpus(), 32)[:blocks])
    return Trainer(model=model, args=arguments, train_dataset=dataset)


def _reset_accelerate() -> None:
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)


def trainer_config_processing(rank: int, world_size: int, paths: list[str], outdir: str) -> dict:
    """Each config through TrainingArguments and Trainer.train up to deepspeed.initialize."""
    import deepspeed
    import ds_canzona  # noqa: F401
    from transformers import TrainingArguments

    from ds_canzona.hf import load_ds_config, training_arguments

    def keep_config(**kwargs):
        results[current]["config"] = copy.deepcopy(kwargs.get("config_params") or kwargs.get("config"))
        raise _Captured

    deepspeed.initialize = keep_config
    results: dict = {}
    common = dict(output_dir=outdir, max_steps=2, report_to="none", save_strategy="no", disable_tqdm=True)
    for current in paths:
        results[current] = {}
        _reset_accelerate()
        try:
            arguments = training_arguments(current, **common)
            results[current]["arguments"] = {field: getattr(arguments, field) for field in (
                "learning_rate", "adam_beta1", "adam_beta2", "adam_epsilon", "weight_decay", "max_grad_norm",
                "per_device_train_batch_size", "bf16", "fp16")}
            _tiny_trainer(arguments).train()
        except _Captured:
            pass
        except Exception as error:  # reported, and failed, by the test
            results[current]["error"] = f"{type(error).__name__}: {error}"

    # The collision that gave canzona.kernels its value name: any "auto" is the Trainer's.
    current = "kernels-auto"
    results[current] = {}
    _reset_accelerate()
    config = load_ds_config(CONFIG_DIR / "zero2_muon.json")
    config["canzona"]["kernels"] = "auto"
    try:
        _tiny_trainer(TrainingArguments(deepspeed=config, use_cpu=True, **common)).train()
    except _Captured:
        pass
    except Exception as error:
        results[current]["error"] = f"{type(error).__name__}: {error}"
    return results


def test_every_shipped_config_passes_the_trainers_config_processing(tmp_path: Path):
    import deepspeed  # noqa: F401  (before ds_canzona.config)
    from deepspeed.runtime.config import DeepSpeedConfig

    from ds_canzona.config import parse_canzona_section
    from ds_canzona.hf import load_ds_config

    [results] = run_ranks(trainer_config_processing, 1, [str(p) for p in CONFIG_FILES], str(tmp_path), timeout=300)
    for path in CONFIG_FILES:
        result = results[str(path)]
        assert "error" not in result, f"{path.name}: {result['error']}"
        config = result["config"]
        assert find_autos(config) == [], f"{path.name}: 'auto' left for DeepSpeed"
        canzona = parse_canzona_section(config)
        assert canzona is not None and canzona.kernels in ("default", "triton", "torch")
        DeepSpeedConfig(copy.deepcopy(config))
        raw = load_ds_config(path)
        params = raw["optimizer"]["params"]
        arguments = result["arguments"]
        if params.get("lr", "auto") != "auto":
            assert arguments["learning_rate"] == params["lr"] == config["optimizer"]["params"]["lr"]
        if params.get("betas", "auto") != "auto":
            assert [arguments["adam_beta1"], arguments["adam_beta2"]] == list(params["betas"])
        if params.get("weight_decay", "auto") != "auto":
            assert arguments["weight_decay"] == params["weight_decay"]
        if isinstance(raw.get("train_micro_batch_size_per_gpu"), int):
            assert arguments["per_device_train_batch_size"] == raw["train_micro_batch_size_per_gpu"]
        assert arguments["bf16"] == bool((raw.get("bf16") or {}).get("enabled") is True)
        assert arguments["fp16"] == bool((raw.get("fp16") or {}).get("enabled") is True)
    collision = results["kernels-auto"].get("error", "")
    assert "canzona.kernels` not found in kwargs" in collision, collision


def test_training_arguments_takes_values_from_the_config_and_refuses_conflicts():
    from ds_canzona.hf import ConfigFileError, check_trainer_config, load_ds_config, trainer_values_from_config

    config = load_ds_config(CONFIG_DIR / "zero2_muon.hjson")
    values = trainer_values_from_config(config, {})
    assert values["learning_rate"] == 0.02 and values["weight_decay"] == 0.01
    assert (values["adam_beta1"], values["adam_beta2"]) == (0.9, 0.95)
    assert values["per_device_train_batch_size"] == 4 and values["max_grad_norm"] == 1.0
    assert "learning_rate" not in trainer_values_from_config(config, {"learning_rate": 0.02})
    with pytest.raises(ConfigFileError, match=r"learning_rate=0\.1.*'optimizer\.params\.lr': 0\.02"):
        trainer_values_from_config(config, {"learning_rate": 0.1})
    json_config = load_ds_config(CONFIG_DIR / "zero2_muon.json")
    assert "learning_rate" not in trainer_values_from_config(json_config, {}), "'auto' is left to the Trainer"
    with pytest.raises(ConfigFileError, match="'canzona.kernels': write \"default\""):
        check_trainer_config({**json_config, "canzona": {"kernels": "auto"}})


def trainer_on_two_ranks(rank: int, world_size: int, outdir: str) -> dict:
    import ds_canzona  # noqa: F401
    from transformers import TrainingArguments

    from ds_canzona.config import CanzonaConfigError
    from ds_canzona.hf import load_ds_config, training_arguments

    import deepspeed

    # README "Use it": DeepSpeed reads the HJSON path itself.
    engine, _, _, _ = deepspeed.initialize(model=_tiny_model(), config=str(CONFIG_DIR / "zero2_muon.hjson"))
    from_path = type(engine.optimizer).__module__
    del engine

    common = dict(max_steps=2, report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
                  lr_scheduler_type="constant")
    refusals = []
    # A plain Trainer script, as on a GPU machine: the Trainer fills train_batch_size (JSON
    # config), or the config has none (HJSON config, its values given to the Trainer by hand).
    hjson = load_ds_config(CONFIG_DIR / "zero2_muon.hjson")
    plain = [
        (CONFIG_DIR / "zero2_muon.json", dict(learning_rate=0.02, per_device_train_batch_size=4)),
        (hjson, dict(learning_rate=0.02, weight_decay=0.01, adam_beta2=0.95, per_device_train_batch_size=4)),
    ]
    for config, values in plain:
        _reset_accelerate()
        arguments = TrainingArguments(output_dir=f"{outdir}/plain", deepspeed=config, **values, **common)
        try:
            _tiny_trainer(arguments).train()
            refusals.append("trained")
        except CanzonaConfigError as error:
            refusals.append(str(error))

    # The documented way: one call, the HJSON path as it is.
    _reset_accelerate()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        arguments = training_arguments(CONFIG_DIR / "zero2_muon.hjson", output_dir=f"{outdir}/hjson", **common)
        trainer = _tiny_trainer(arguments)
        trainer.train()
    engine = trainer.model_wrapped
    plain_losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    plain_params = {n: p.detach().clone() for n, p in engine.module.named_parameters()}
    offloaded = _trainer_with_offload(f"{outdir}/offload", common, plain_params, plain_losses, rank)
    return {
        "offloaded": offloaded,
        "from_path": from_path,
        "refusals": refusals,
        "trainer_world_size": arguments.world_size,
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "steps": trainer.state.global_step,
        "optimizer": type(engine.optimizer).__module__,
        "lrs": [group["lr"] for group in engine.optimizer.optimizer.param_groups],
        "warnings": [str(w.message) for w in caught],
    }


def _trainer_with_offload(outdir: str, common: dict, plain_params: dict, plain_losses: list, rank: int) -> dict:
    """The documented way with ds_configs/zero2_muon_offload.hjson, saving at its last step.

    That config is zero2_muon.hjson plus the offload keys, and an offloaded step runs the same
    rules on the same values (tests/test_offload.py), so the Trainer's losses and parameters must
    equal the run without offload bit for bit: the Trainer changes nothing about that.
    """
    import torch
    from safetensors.torch import load_file

    from ds_canzona.hf import training_arguments

    _reset_accelerate()
    steps = common["max_steps"]
    arguments = training_arguments(CONFIG_DIR / "zero2_muon_offload.hjson", output_dir=outdir,
                                   **{**common, "save_strategy": "steps", "save_steps": steps})
    trainer = _tiny_trainer(arguments)
    trainer.train()
    zero = trainer.model_wrapped.optimizer
    trained = dict(trainer.model_wrapped.module.named_parameters())
    checkpoint = Path(outdir) / f"checkpoint-{steps}"
    saved = load_file(checkpoint / "model.safetensors") if rank == 0 else {}
    state_dict = trainer.model_wrapped.module.state_dict()  # names the tied head too, unlike the parameters
    return {
        "optimizer": type(zero).__module__,
        "offload": zero.offload.summary() if zero.offload is not None else None,
        "masters_on_host": all(t.master.device.type == "cpu" for t in zero.owned_tensors()),
        "bytes_moved": zero.offload.counter.total_to_device + zero.offload.counter.total_to_host
        if zero.offload is not None else 0,
        "losses_equal": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry] == plain_losses,
        "params_differ": [n for n, p in trained.items() if not torch.equal(p, plain_params[n])],
        "unmoved": [n for n, p in _tiny_model().named_parameters() if torch.equal(p, trained[n])],
        "engine_checkpoint": (checkpoint / f"global_step{steps}").is_dir(),
        "saved_differ": [n for n, p in saved.items() if not torch.equal(p, state_dict[n])],
        "saved_count": len(saved),
    }


def test_trainer_on_cpu_ranks_plain_script_refused_documented_hjson_way_trains(tmp_path: Path):
    results = run_ranks(trainer_on_two_ranks, 2, str(tmp_path), timeout=300)
    for result in results:
        assert result["from_path"].startswith("ds_canzona."), "deepspeed.initialize(config=HJSON path)"
        batch_filled, no_batch_key = result["refusals"]
        for message in (batch_filled, no_batch_key):
            assert "counted 1 process but DeepSpeed runs 2" in message, message
            assert "TrainingArguments(use_cpu=True)" in message and "\n" not in message
        assert "train_batch_size 4 = micro batch 4 x gradient accumulation 1 x 1 instead of x 2" in batch_filled

        assert result["trainer_world_size"] == 2
        assert result["steps"] == 2 and len(result["losses"]) == 2
        assert result["optimizer"].startswith("ds_canzona."), result["optimizer"]
        assert result["lrs"] == [0.02, 0.003], "muon_lr and adam_lr from the HJSON config"
        stepped_early = [w for w in result["warnings"] if "lr_scheduler.step()" in w]
        assert not stepped_early, stepped_early
    assert results[0]["losses"] == results[1]["losses"], "the logged loss is the mean over ranks"

    # ds_configs/zero2_muon_offload.hjson under the Trainer: ds_canzona's optimizer with its state on
    # the host, the run equal to zero2_muon.hjson's bit for bit, and the Trainer's save written.
    for rank, result in enumerate(results):
        offloaded = result["offloaded"]
        assert offloaded["optimizer"] == "ds_canzona.zero.stage12", offloaded["optimizer"]
        assert offloaded["offload"] is not None and "offload_optimizer cpu" in offloaded["offload"]
        assert offloaded["masters_on_host"] and offloaded["bytes_moved"] > 0
        assert offloaded["losses_equal"], "losses with offload differ from the run without"
        assert offloaded["params_differ"] == [], offloaded["params_differ"][:3]
        assert offloaded["engine_checkpoint"], "the Trainer's checkpoint holds the engine's own"
        assert offloaded["unmoved"] == [], "two steps move every parameter"
    saving = results[0]["offloaded"]
    assert saving["saved_count"] > 0 and saving["saved_differ"] == [], saving["saved_differ"][:3]


def trainer_at_stage3(rank: int, world_size: int, outdir: str) -> dict:
    """The documented Trainer way with ds_configs/zero3_muon.hjson; the model built as the Trainer's
    users build it, with ``from_config`` after the TrainingArguments, i.e. under ``zero.Init``."""
    import torch
    import ds_canzona  # noqa: F401
    from transformers import AutoModelForCausalLM, Qwen3Config, Trainer

    from ds_canzona.data_utils import BlockDataset, load_corpus, token_blocks
    from ds_canzona.hf import training_arguments

    arguments = training_arguments(CONFIG_DIR / "zero3_muon.hjson", output_dir=f"{outdir}/zero3", max_steps=3,
                                   report_to="none", save_strategy="no", disable_tqdm=True, logging_steps=1,
                                   lr_scheduler_type="constant")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(Qwen3Config(**json.loads(TINY_MODEL.read_text())))
    built_under_zero_init = all(hasattr(p, "ds_id") and p.numel() == 0 for p in model.parameters())
    dataset = BlockDataset(token_blocks(load_corpus(), 32)[:64])
    trainer = Trainer(model=model, args=arguments, train_dataset=dataset)
    trainer.train()
    engine = trainer.model_wrapped
    zero = engine.optimizer
    # The Trainer's final save (stage3_gather_16bit_weights_on_model_save in the config): DeepSpeed
    # gathers the model module by module to rank 0 through the owner layout's fetch.
    import deepspeed

    def gathered(model) -> dict:
        with deepspeed.zero.GatheredParameters(list(model.parameters())):
            return {n: p.detach().clone() for n, p in model.named_parameters()}

    trained = gathered(model)
    trainer.save_model(f"{outdir}/final")
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    after_save = gathered(model)  # the save's gather and release (modifier_rank=0) left the shards as they were

    # ds_configs/zero3_muon_offload.hjson, the same way: zero3_muon.hjson plus the offload keys.
    _reset_accelerate()
    arguments = training_arguments(CONFIG_DIR / "zero3_muon_offload.hjson", output_dir=f"{outdir}/zero3_offload",
                                   max_steps=3, report_to="none", save_strategy="no", disable_tqdm=True,
                                   logging_steps=1, lr_scheduler_type="constant")
    torch.manual_seed(0)
    offload_model = AutoModelForCausalLM.from_config(Qwen3Config(**json.loads(TINY_MODEL.read_text())))
    offload_trainer = Trainer(model=offload_model, args=arguments, train_dataset=dataset)
    offload_trainer.train()
    offload_zero = offload_trainer.model_wrapped.optimizer
    offloaded = {
        "optimizer": type(offload_zero).__module__,
        "offload": offload_zero.offload.summary() if offload_zero.offload is not None else None,
        "masters_on_host": all(t.master.device.type == "cpu" for t in offload_zero.owned_tensors()),
        "losses": [entry["loss"] for entry in offload_trainer.state.log_history if "loss" in entry],
        "params": gathered(offload_model),
    }
    return {
        "offloaded": offloaded,
        "trained": trained,
        "after_save": after_save,
        "saved": _saved_weights(f"{outdir}/final") if rank == 0 else None,
        "built_under_zero_init": built_under_zero_init,
        "optimizer": type(zero).__module__,
        "losses": losses,
        "steps": trainer.state.global_step,
        "kinds": {name: group["kind"] for name, group in zip(zero.names, zero.groups)},
        "owned": [t.name for t in zero.owned_tensors()],
    }


def _saved_weights(directory: str) -> dict:
    from safetensors.torch import load_file

    return load_file(f"{directory}/model.safetensors")


def test_trainer_at_stage3_builds_the_model_under_zero_init_and_trains_with_owner_placement(tmp_path: Path):
    import math

    import torch

    results = run_ranks(trainer_at_stage3, 2, str(tmp_path), timeout=300)
    for result in results:
        assert result["built_under_zero_init"], "the Trainer's from_config builds under zero.Init at stage 3"
        assert result["optimizer"] == "ds_canzona.zero.stage3"
        assert result["steps"] == 3 and len(result["losses"]) == 3
        assert all(math.isfinite(x) for x in result["losses"])
        kinds = result["kinds"]
        # ds_shape, not the empty local placeholder, decides the kind (DeepSpeed #8438).
        assert kinds["model.layers.0.mlp.up_proj.weight"] == "muon"
        assert kinds["model.embed_tokens.weight"] == "adamw" and kinds["model.norm.weight"] == "adamw"
    assert results[0]["losses"] == results[1]["losses"], "the logged loss is the mean over ranks"
    owned = [set(r["owned"]) for r in results]
    assert not owned[0] & owned[1] and owned[0] | owned[1] == set(results[0]["kinds"]), "each tensor one owner"
    # trainer.save_model wrote the trained weights whole (a tied head is saved once, as its embedding).
    saved, trained = results[0]["saved"], results[0]["trained"]
    assert set(saved) <= set(trained) and "model.layers.0.mlp.up_proj.weight" in saved
    for name, value in saved.items():
        assert torch.equal(value, trained[name]), name
    for result in results:
        for name, value in result["after_save"].items():
            assert torch.equal(value, result["trained"][name]), name
    # With zero3_muon_offload.hjson: ds_canzona's owner placement with its state on the host, and the
    # same run bit for bit (an offloaded step runs the same rules on the same values).
    for result in results:
        offloaded = result["offloaded"]
        assert offloaded["optimizer"] == "ds_canzona.zero.stage3"
        assert offloaded["offload"] is not None and "offload_optimizer cpu" in offloaded["offload"]
        assert offloaded["masters_on_host"]
        assert offloaded["losses"] == result["losses"]
        different = [n for n, p in offloaded["params"].items() if not torch.equal(p, result["trained"][n])]
        assert not different and offloaded["params"].keys() == result["trained"].keys(), different[:3]
