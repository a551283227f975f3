"""The `canzona` config section: validation before anything is allocated, and the stock path."""

from __future__ import annotations

import pytest

from distributed import run_ranks

BAD_SECTIONS = [
    ({"alpha": 1.5}, "canzona.alpha"),
    ({"alpha": -0.1}, "canzona.alpha"),
    ({"alpha": "high"}, "canzona.alpha"),
    ({"bucket_numel": 0}, "canzona.bucket_numel"),
    ({"bucket_numel": -5}, "canzona.bucket_numel"),
    ({"bucket_numel": "big"}, "canzona.bucket_numel"),
    ({"cost_model": "time"}, "canzona.cost_model"),
    ({"kernels": "cuda"}, "canzona.kernels"),
    ({"strategy": "uniform"}, "canzona.strategy"),
    ({"strategy": "greedy"}, "canzona.strategy"),
    ({"enabled": "yes"}, "canzona.enabled"),
    ({"log_plan": 3}, "canzona.log_plan"),
    ({"alhpa": 1.0}, "canzona.alhpa"),
    ({"comm_timeout_s": 0}, "canzona.comm_timeout_s"),
    ({"machine_balance": 0}, "canzona.machine_balance"),
    ({"machine_balance": -30.0}, "canzona.machine_balance"),
    ({"machine_balance": "fast"}, "canzona.machine_balance"),
    ({"cost_model": "flops", "machine_balance": 30.0}, "machine_balance applies to cost_model 'roofline' only"),
    ({"launch_bytes": -1.0}, "canzona.launch_bytes"),
    ({"launch_bytes": "fast"}, "canzona.launch_bytes"),
    ({"launch_bytes": float("inf")}, "canzona.launch_bytes"),
    ({"cost_model": "numel", "launch_bytes": 1e4}, "launch_bytes applies to cost_model 'roofline' only"),
    ({"split_numel": -1}, "canzona.split_numel"),
    ({"split_numel": 2.5}, "canzona.split_numel"),
    ({"split_numel": True}, "canzona.split_numel"),
    # Strict types: a float key takes an int, nothing else; nothing is converted.
    ({"alpha": "1.0"}, "canzona.alpha"),
    ({"alpha": True}, "canzona.alpha"),
    ({"comm_timeout_s": "600"}, "canzona.comm_timeout_s"),
    ({"machine_balance": False}, "canzona.machine_balance"),
    ({"bucket_numel": 4000.0}, "canzona.bucket_numel"),
    ({"bucket_numel": True}, "canzona.bucket_numel"),
    ({"enabled": 1}, "canzona.enabled"),
    ({"log_plan": "true"}, "canzona.log_plan"),
    ({"split_numel": "big"}, "canzona.split_numel"),
]


def _try_configs(rank, world_size, cases):
    from zero_workers import init_engine, make_config
    from ds_canzona.config import CanzonaConfigError

    outcomes = []
    for section, top in cases:
        config = make_config(world_size)
        config["canzona"] = section if not isinstance(section, dict) else {**config["canzona"], **section}
        config.update(top)
        try:
            init_engine(config)
            outcomes.append(("ok", ""))
        except CanzonaConfigError as error:
            outcomes.append(("CanzonaConfigError", str(error)))
        except Exception as error:  # anything else is a bug in how we report bad input
            outcomes.append((type(error).__name__, str(error)))
    return outcomes


def test_bad_sections_and_combinations_raise_one_clear_error():
    cases = [(section, {}) for section, _ in BAD_SECTIONS]
    cases += [
        ("not-an-object", {}),
        ({}, {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}),
        ({}, {"zero_optimization": {"stage": 0}}),
        ({}, {"optimizer": {"type": "Lamb", "params": {}}}),
        ({}, {"optimizer": {"type": "Muon", "params": {"lr": -1.0}}}),
        ({}, {"optimizer": {"type": "Muon", "params": {"momentum": 1.5}}}),
        ({}, {"optimizer": {"type": "Muon", "params": {"ns_steps": 0}}}),
        ({}, {"optimizer": {"type": "Muon", "params": {"ns_method": "cubic"}}}),
        ({}, {"optimizer": {"type": "Muon", "params": {"no_such_key": 1}}}),
    ]
    outcomes = run_ranks(_try_configs, 1, cases, timeout=240)[0]
    expected_keys = [key for _, key in BAD_SECTIONS] + ["canzona", "offload_param", "zero_optimization.stage is 0", "lamb",
                                                        "lr", "momentum", "ns_steps", "ns_method", "no_such_key"]
    for (kind, message), key, case in zip(outcomes, expected_keys, cases):
        assert kind == "CanzonaConfigError", (case, kind, message)
        assert key in message, (case, message)
        assert "\n" not in message, message


def _disabled_is_stock(rank, world_size):
    from zero_workers import init_engine, make_config
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    kinds = []
    for section in (None, {"enabled": False}):
        config = make_config(world_size, optimizer={"type": "AdamW", "params": {"lr": 1e-3}})
        if section is None:
            del config["canzona"]
        else:
            config["canzona"] = section
        engine = init_engine(config)
        kinds.append(isinstance(engine.optimizer, DeepSpeedZeroOptimizer))
    return kinds


def test_no_section_or_disabled_builds_deepspeeds_own_optimizer():
    assert run_ranks(_disabled_is_stock, 1, timeout=240)[0] == [True, True]


def test_types_that_are_accepted_as_written():
    import deepspeed  # noqa: F401  (before ds_canzona.config)
    from ds_canzona.config import parse_canzona_section

    config = parse_canzona_section({"canzona": {"alpha": 1, "comm_timeout_s": 600, "machine_balance": 30}})
    assert (config.alpha, config.comm_timeout_s, config.machine_balance) == (1.0, 600.0, 30.0)
    assert all(isinstance(v, float) for v in (config.alpha, config.comm_timeout_s, config.machine_balance))


def test_split_numel_zero_means_whole_tensors_in_the_config_and_the_cli():
    import deepspeed  # noqa: F401  (before ds_canzona.config)
    from ds_canzona.config import parse_canzona_section
    from ds_canzona.plan_command import _split_count

    assert parse_canzona_section({"canzona": {"split_numel": 0}}).split_numel is None
    assert parse_canzona_section({"canzona": {"split_numel": None}}).split_numel is None
    assert parse_canzona_section({"canzona": {"split_numel": 500}}).split_numel == 500
    assert _split_count("0") is None and _split_count("500") == 500


def _plan_cost_labels(rank, world_size, sections):
    from zero_workers import init_engine, make_config

    labels = []
    for section in sections:
        config = make_config(world_size)
        config["canzona"] = {**config["canzona"], **section}
        labels.append(init_engine(config).optimizer.plan.cost_label)
    return labels


def test_cost_model_and_machine_balance_reach_the_plan():
    sections = [{}, {"machine_balance": 7.5}, {"cost_model": "flops"}, {"cost_model": "numel"}, {"launch_bytes": 0}]
    default, configured, flops, numel, no_floor = run_ranks(_plan_cost_labels, 1, sections, timeout=240)[0]
    # Default: roofline priced with the matrix group's own Newton-Schulz settings and the CPU's balance,
    # launch floor (ds_canzona.plan.cost.DEFAULT_LAUNCH_BYTES) and per-tensor AdamW launches (device=cpu).
    assert default.startswith("roofline:muon(") and default.endswith(
        ",device=cpu,launch_bytes=15000,machine_balance=30)"), default
    assert configured.endswith("machine_balance=7.5)"), configured
    assert no_floor.endswith("launch_bytes=0,machine_balance=30)"), no_floor
    assert flops.startswith("flops:muon(") and numel == "numel"
