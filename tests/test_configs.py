"""Every file in ds_configs/ loads, validates, and trains two steps on two gloo ranks.

Launcher files (HJSON) must be concrete: no "auto", no train_batch_size, an explicit
gradient_clipping. The Trainer file (JSON, with "auto") is resolved the way transformers does it
(``HfTrainerDeepSpeedConfig``) after ``ds_canzona.hf.check_trainer_config``, then must hold no
"auto" at all (accelerate refuses any it cannot fill). Training goes through
``deepspeed.initialize`` with ds_canzona's hook, on the tiny Qwen3 and the shipped corpus.

fp16 and bf16: a config that needs one trains only where DeepSpeed's accelerator reports it
(``is_fp16_supported()`` / ``is_bf16_supported()``) and is skipped with the reason elsewhere. The CPU
accelerator reports fp16 only where oneDNN has it (AVX-512 FP16 and similar); without it DeepSpeed
itself refuses the config. The optimizer's loss-scale and overflow path is tested on every machine
in fp32 (tests/test_zero_runtime.py::test_dynamic_loss_scale_and_overflow_without_fp16).
"""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from types import SimpleNamespace

import pytest

from distributed import run_ranks

REPO = Path(__file__).resolve().parent.parent
CONFIG_DIR = REPO / "ds_configs"
CONFIG_FILES = sorted(p for p in CONFIG_DIR.iterdir() if p.suffix in (".json", ".hjson"))
TINY_MODEL = REPO / "examples" / "configs" / "qwen3-tiny.json"
EXPECTED = {"zero1_muon.hjson", "zero2_muon.hjson", "zero2_muon.json", "zero2_muon_bf16.hjson",
            "zero2_muon_fp16.hjson", "zero2_muon_offload.hjson", "zero2_shampoo.hjson", "zero2_soap.hjson",
            "zero3_muon.hjson", "zero3_muon_offload.hjson", "zero2_normuon.hjson", "zero2_adamuon.hjson",
            "zero2_muon_moe.hjson"}
MICRO_BATCH, GRAD_ACCUM, SEQ_LEN = 2, 1, 32


def is_trainer_config(path: Path) -> bool:
    return path.suffix == ".json"


def find_autos(node, prefix: str = "") -> list[str]:
    """Dotted keys whose value is "auto" (HF's placeholder)."""
    if isinstance(node, dict):
        return [hit for key, value in node.items() for hit in find_autos(value, f"{prefix}{key}.")]
    if isinstance(node, list):
        return [hit for i, value in enumerate(node) for hit in find_autos(value, f"{prefix}{i}.")]
    return [prefix.rstrip(".")] if node == "auto" else []


def trainer_args(world_size: int) -> SimpleNamespace:
    """The TrainingArguments fields transformers reads to fill "auto" (examples/hf_trainer.py's values)."""
    return SimpleNamespace(world_size=world_size, per_device_train_batch_size=MICRO_BATCH,
                           gradient_accumulation_steps=GRAD_ACCUM, max_grad_norm=1.0, learning_rate=0.02,
                           adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8, weight_decay=0.0,
                           save_on_each_node=False, fp16=False, fp16_full_eval=False, bf16=False,
                           bf16_full_eval=False, get_warmup_steps=lambda steps: 0)


def resolved_config(path: Path, world_size: int) -> dict:
    """The dict that reaches deepspeed.initialize: as the launcher script or as the Trainer makes it."""
    from ds_canzona.hf import check_trainer_config, load_ds_config

    if not is_trainer_config(path):
        return load_ds_config(path)
    from transformers.integrations.deepspeed import HfTrainerDeepSpeedConfig

    hf_config = HfTrainerDeepSpeedConfig(check_trainer_config(path))
    hf_config.trainer_config_process(trainer_args(world_size))
    hf_config.trainer_config_finalize(trainer_args(world_size), SimpleNamespace(config=None), 100)
    return hf_config.config


def tiny_model():
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    return Qwen3ForCausalLM(Qwen3Config(**json.loads(TINY_MODEL.read_text())))


def test_the_expected_files_are_shipped():
    assert EXPECTED <= {p.name for p in CONFIG_FILES}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_loads_and_validates(path: Path):
    import deepspeed  # noqa: F401  (before ds_canzona.config)
    import ds_canzona  # noqa: F401
    from deepspeed.runtime.config import DeepSpeedConfig
    from ds_canzona.config import parse_canzona_section
    from ds_canzona.hf import load_ds_config
    from ds_canzona.zero.build import translate_optimizer_params
    from ds_canzona import optim

    raw = load_ds_config(path)
    assert "gradient_clipping" in raw, "DeepSpeed clips at 1.0 by default: set gradient_clipping explicitly"
    if is_trainer_config(path):
        assert raw["train_micro_batch_size_per_gpu"] == "auto"
    else:
        assert find_autos(raw) == [], "'auto' is for the HF Trainer only"
        assert "train_batch_size" not in raw, "leave train_batch_size to DeepSpeed"
        assert isinstance(raw["train_micro_batch_size_per_gpu"], int)
        assert isinstance(raw["gradient_accumulation_steps"], int)

    config = resolved_config(path, world_size=1)
    assert find_autos(config) == []
    canzona = parse_canzona_section(config)
    assert canzona is not None, "every shipped config enables ds_canzona"
    ds_config = DeepSpeedConfig(copy.deepcopy(config))
    assert ds_config.zero_optimization_stage in (1, 2, 3)

    name = config["optimizer"]["type"].lower()
    classes = {"muon": optim.Muon, "normuon": optim.NorMuon, "adamuon": optim.AdaMuon, "shampoo": optim.Shampoo,
               "soap": optim.SOAP}
    kwargs = translate_optimizer_params(name, config["optimizer"].get("params", {}))
    optimizer = classes[name](list(tiny_model().named_parameters()), **kwargs)
    kinds = {group["kind"] for group in optimizer.param_groups if group["params"]}
    assert kinds == {name, "adamw"}


def train_two_steps(rank: int, world_size: int, path: str) -> dict:
    import torch
    import deepspeed
    import ds_canzona  # noqa: F401  (registers the engine hook)
    from ds_canzona.data_utils import load_corpus, token_blocks

    config = resolved_config(Path(path), world_size)
    engine, _, _, _ = deepspeed.initialize(model=tiny_model(), config=config)
    blocks = token_blocks(load_corpus(), SEQ_LEN)
    micro, ga = engine.train_micro_batch_size_per_gpu(), engine.gradient_accumulation_steps()
    losses = []
    for step in range(2):
        for m in range(ga):
            start = ((step * ga + m) * world_size + rank) * micro
            batch = blocks[start:start + micro].to(engine.device)
            loss = engine(input_ids=batch, labels=batch).loss
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.float().item()))
    return {"losses": losses, "optimizer": type(engine.optimizer).__module__, "steps": engine.global_steps,
            "dtype": str(next(engine.module.parameters()).dtype)}


def train_each_config(rank: int, world_size: int, paths: list[str]) -> dict:
    """Every config in turn, in one world (a spawn costs ~10 s here): its result, or its traceback."""
    import gc
    import traceback

    results = {}
    for path in paths:
        try:
            results[path] = train_two_steps(rank, world_size, path)
        except Exception:
            results[path] = traceback.format_exc()
        gc.collect()
    return results


def accelerator_lacks_its_dtype(config: dict) -> str | None:
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    for key, supported in (("fp16", accelerator.is_fp16_supported), ("bf16", accelerator.is_bf16_supported)):
        if (config.get(key) or {}).get("enabled") and not supported():
            return f"DeepSpeed's {accelerator.device_name()} accelerator reports no {key} on this machine"
    return None


@pytest.fixture(scope="module")
def trained_configs() -> dict:
    trainable = [str(p) for p in CONFIG_FILES if accelerator_lacks_its_dtype(resolved_config(p, world_size=2)) is None]
    ranks = run_ranks(train_each_config, 2, trainable, timeout=150 * len(trainable))
    return {path: [rank[path] for rank in ranks] for path in trainable}


@pytest.mark.parametrize("path", CONFIG_FILES, ids=lambda p: p.name)
def test_config_trains_two_steps_on_two_ranks(path: Path, trained_configs: dict):
    config = resolved_config(path, world_size=2)
    reason = accelerator_lacks_its_dtype(config)
    if reason:
        pytest.skip(reason)
    results = trained_configs[str(path)]
    expected_dtype = ("torch.bfloat16" if (config.get("bf16") or {}).get("enabled") else
                      "torch.float16" if (config.get("fp16") or {}).get("enabled") else "torch.float32")
    for result in results:
        assert isinstance(result, dict), result  # else the rank's traceback
        assert result["optimizer"].startswith("ds_canzona."), result["optimizer"]
        assert result["steps"] == 2
        assert result["dtype"] == expected_dtype
        assert all(math.isfinite(x) for x in result["losses"]), result["losses"]


# --------------------------------------------------------------------------- ds_canzona.hf


def test_load_ds_config_errors_are_one_line(tmp_path: Path):
    from ds_canzona.hf import ConfigFileError, load_ds_config

    with pytest.raises(ConfigFileError, match="not found"):
        load_ds_config(tmp_path / "missing.hjson")
    bad = tmp_path / "bad.hjson"
    bad.write_text("{ zero_optimization: {stage: 2\n")
    with pytest.raises(ConfigFileError, match=r"bad.hjson: not valid HJSON: .* line \d+") as info:
        load_ds_config(bad)
    assert "\n" not in str(info.value)
    bad_json = tmp_path / "bad.json"
    bad_json.write_text('{"a": 1,}')
    with pytest.raises(ConfigFileError, match="not valid JSON"):
        load_ds_config(bad_json)
    array = tmp_path / "array.json"
    array.write_text("[1, 2]")
    with pytest.raises(ConfigFileError, match="must be an object"):
        load_ds_config(array)


def test_hjson_and_json_twins_agree_where_concrete():
    from ds_canzona.hf import load_ds_config

    hjson_config = load_ds_config(CONFIG_DIR / "zero2_muon.hjson")
    json_config = load_ds_config(CONFIG_DIR / "zero2_muon.json")
    assert hjson_config["zero_optimization"] == json_config["zero_optimization"]
    assert hjson_config["optimizer"]["type"] == json_config["optimizer"]["type"]
    for key, value in json_config["optimizer"]["params"].items():
        if value != "auto":
            assert hjson_config["optimizer"]["params"][key] == value, key


def test_check_trainer_config():
    from ds_canzona.hf import ConfigFileError, check_trainer_config

    base = {"zero_optimization": {"stage": 2}, "optimizer": {"type": "Muon"},
            "canzona": {"kernels": "default", "alpha": 0.5}}
    checked = check_trainer_config(base)
    assert checked == base and checked is not base and checked["canzona"] is not base["canzona"]
    with pytest.raises(ConfigFileError, match="'canzona.kernels': write \"default\""):
        check_trainer_config({**base, "canzona": {"kernels": "auto"}})
    with pytest.raises(ConfigFileError, match="needs an 'optimizer' section"):
        check_trainer_config({"zero_optimization": {"stage": 2}, "canzona": {}})
    # Optimizer offload to the host is supported; what is not (NVMe, ratio < 1) the engine refuses at init.
    offload = {**base, "zero_optimization": {"stage": 2, "offload_optimizer": {"device": "cpu"}}}
    assert check_trainer_config(offload) == offload
    disabled = {"zero_optimization": {"stage": 2}, "canzona": {"enabled": False}}
    assert check_trainer_config(disabled) == disabled
    assert check_trainer_config(CONFIG_DIR / "zero2_muon.hjson")["canzona"]["kernels"] == "default"
