"""Rank-side function of the host-sync budget test (tests/test_host_syncs.py), spawned by tests/distributed.py.

Each scenario builds one engine on the AutoTP tests' Qwen3 (tests/tp_workers.py), so one model
serves ZeRO-1/2/3 (TP=1, DP = the world) and AutoTP (TP = the world, DP=1), and trains it for a
few steps with a fresh ``HostSyncCounter`` around each of ``engine(batch)``, ``engine.backward``
and ``engine.step``. The result is every sync (a ``HostSync``: what, where, whose) per optimizer
step and phase.
"""

from __future__ import annotations

import time

from tp_workers import MODELS, lm_loss, tokens

PHASES = ("forward", "backward", "step")


def ds_config(*, stage: int, tp: int, optimizer: dict, ga: int, synchronized_timer: bool) -> dict:
    config = {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": ga,
        "gradient_clipping": 1.0,
        "steps_per_print": 10_000,
        "zero_optimization": {"stage": stage},
        "optimizer": optimizer,
        "canzona": {"log_plan": False, "bucket_numel": 3000},
    }
    if tp > 1:
        config["tensor_parallel"] = {"autotp_size": tp}
    if not synchronized_timer:
        config["timers"] = {"throughput": {"enabled": True, "synchronized": False}}
    return config


def count_host_syncs(rank: int, world_size: int, scenarios: list[dict]) -> list[dict]:
    """Per scenario: {"syncs": one {phase: [HostSync, ...]} per optimizer step, "skipped", "seconds"}.

    A scenario is {"stage", "tp" (1), "ga" (1), "optimizer", "steps", "synchronized_timer" (True:
    DeepSpeed's default)}; a phase holds the syncs of all the step's micro-batches. AutoTP scenarios go last:
    DeepSpeed keeps the TP groups of an AutoTP engine in global state, and an engine without TP built after
    one fails to start.
    """
    import deepspeed

    import ds_canzona  # noqa: F401  (registers the engine hook)
    from ds_canzona.bench.standins.host_syncs import HostSyncCounter

    results = []
    for scenario in scenarios:
        started = time.perf_counter()
        tp = scenario.get("tp", 1)
        ga = scenario.get("ga", 1)
        config = ds_config(stage=scenario["stage"], tp=tp, optimizer=scenario["optimizer"], ga=ga,
                           synchronized_timer=scenario.get("synchronized_timer", True))
        engine, _, _, _ = deepspeed.initialize(model=MODELS["qwen3"](), config=config)
        per_step = []
        for step in range(scenario["steps"]):
            events: dict[str, list] = {phase: [] for phase in PHASES}
            for micro in range(ga):
                batch = tokens(step, micro, rank // tp)
                counters = {phase: HostSyncCounter() for phase in PHASES}
                with counters["forward"]:
                    loss = lm_loss(engine, batch)
                with counters["backward"]:
                    engine.backward(loss)
                with counters["step"]:
                    engine.step()
                for phase, counter in counters.items():
                    events[phase] += counter.events
            per_step.append(events)
        results.append({"syncs": per_step, "skipped": engine.skipped_steps,
                        "seconds": time.perf_counter() - started})
        del engine
    return results
