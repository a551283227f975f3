"""Host synchronisations: the counter (ds_canzona.bench.standins.host_syncs) and the optimizer step's budget.

The budget (docs/ARCHITECTURE.md, "One optimizer step"): in the steady state ds_canzona makes the
host wait for the device once per optimizer step, to read the global gradient norm, which also
says whether the step overflowed; none in forward, none in backward (the gradient hooks run
there), none per tensor. The refresh steps of Shampoo and SOAP, every ``precondition_frequency``
steps and so not the steady state, add on a GPU:

- Shampoo, ``inverse_root="eigh"``: one per inverse root (two per block of each owned tensor):
  ``torch.linalg.eigh`` reads cuSOLVER's ``info`` on the host to raise on failure;
- Shampoo, ``inverse_root="newton"``: one read of the stopping flag per ``STOP_CHECK_EVERY``
  Newton steps of each inverse root (kernels/shampoo.py);
- SOAP: one ``eigh`` per rotated side of each owned tensor on its first step (its bases); its
  later QR refreshes none (PyTorch's cuSOLVER and cuBLAS QR read ``info`` only in debug builds).

The engine test spawns 2 ranks once and builds one engine after another on the AutoTP tests' Qwen3
(tests/host_sync_workers.py): ZeRO-1, 2 and 3 at DP=2, AutoTP at TP=2 (DP=1), each with Muon,
Shampoo and SOAP (precondition_frequency=2, so refresh and steady steps both occur in 3 steps),
stages 2 and 3 with 2 micro-batches per step; and Shampoo's Newton roots at stage 2. It counts
each phase of every step on every rank. What else waits, on these runs (per rank), and is not
ds_canzona's:

- DeepSpeed 0.19.8's ThroughputTimer, on by default (``"timers": {"throughput": {"synchronized":
  true}}``): ``accelerator.synchronize()`` in ``engine.forward`` (timer start) and in
  ``engine.step`` (timer stop), one each per micro-batch from global step 2 on (its ``start_step``);
  ``"synchronized": false`` removes both (the last scenario).
- DeepSpeed, first optimizer step only: ZeRO-3's parameter coordinator checks its recorded fetch
  trace against rank 0's (``deepspeed.runtime.zero.utils``: 183 reads per rank here); AutoTP's
  first forward broadcasts the inputs from TP rank 0 and compares them (``engine.broadcast_and_check``:
  1 read on rank 0, 7 on rank 1).
- The model: transformers' Qwen3 called without an attention mask looks for packed sequences
  (``masking_utils.find_packed_sequence_indices``): one read per forward.

Run against the code before this budget (owner_runtime's ``bool(isfinite(sq_norms).all())``
followed by clipping's ``float(norm)`` and its ``isfinite`` of a host copy), the steady-state
step made 3 reads counted here (2 of them on a GPU) and failed the budget; Shampoo's Newton
roots read once per Newton step.
"""

from __future__ import annotations

import math

import pytest
import torch

from distributed import run_ranks
from host_sync_workers import count_host_syncs

from ds_canzona.bench.standins.host_syncs import HostSyncCounter
from ds_canzona.kernels import shampoo as newton_kernels
from ds_canzona.optim.base import new_step
from ds_canzona.optim.clipping import clip_coefficient

# --------------------------------------------------------------------------- the counter


def _x() -> torch.Tensor:
    return torch.randn(4, 4, generator=torch.Generator().manual_seed(0))


def _spd(x: torch.Tensor) -> torch.Tensor:
    return x @ x.mT + torch.eye(4)


READS = {  # what the host reads -> what the counter reports
    "item": (lambda x: x[0, 0].item(), "aten._local_scalar_dense"),
    "bool": (lambda x: bool(x[0, 0] > 0), "aten._local_scalar_dense"),
    "float": (lambda x: float(x[0, 0]), "aten._local_scalar_dense"),
    "int": (lambda x: int(x[0, 0]), "aten._local_scalar_dense"),
    "format": (lambda x: f"{x[0, 0]:.3f}", "aten._local_scalar_dense"),
    "tolist": (lambda x: x.tolist(), "Tensor.tolist"),
    "numpy": (lambda x: x.numpy(), "Tensor.numpy"),
    "cpu": (lambda x: x.cpu(), "Tensor.cpu"),
    "nonzero": (lambda x: x.nonzero(), "aten.nonzero"),
    "where(cond)": (lambda x: torch.where(x > 0), "aten.nonzero"),
    "boolean index": (lambda x: x[x > 0], "aten.index (boolean mask)"),
    "boolean assignment": (lambda x: x.clone().__setitem__(x > 0, 0.0), "aten.index_put_ (boolean mask)"),
    "masked_select": (lambda x: x.masked_select(x > 0), "aten.masked_select"),
    "equal": (lambda x: torch.equal(x, x), "aten.equal"),
    "unique": (lambda x: torch.unique(x), "aten._unique2"),
    "repeat_interleave by a tensor": (lambda x: x.repeat_interleave(torch.tensor([1, 2, 0, 1]), dim=0),
                                      "aten.repeat_interleave"),
    "eigh": (lambda x: torch.linalg.eigh(_spd(x)), "aten._linalg_eigh"),
    "cholesky": (lambda x: torch.linalg.cholesky(_spd(x)), "aten._linalg_check_errors"),
}

NOT_READS = {  # work that stays on the device
    "arithmetic": lambda x: (x * 2 + 1).sum(),
    "integer index": lambda x: x[torch.tensor([0, 2])],
    "a reduction to a device bool": lambda x: torch.isfinite(x).all(),
    "where(cond, a, b)": lambda x: torch.where(x > 0, x, 0.0),
    "qr": lambda x: torch.linalg.qr(_spd(x)),
    "dtype cast": lambda x: x.to(torch.float64),
    "repeat_interleave by an int": lambda x: x.repeat_interleave(2, dim=0),
}


@pytest.mark.parametrize("name", READS)
def test_counter_catches_each_kind_of_read(name):
    read, what = READS[name]
    x = _x()
    with HostSyncCounter(device="cpu") as syncs:
        read(x)
    assert [event.what for event in syncs.events] == [what]
    assert syncs.count == 1 and syncs.sites[0].startswith(f"{what} at test_host_syncs:")
    assert not syncs.events[0].ours


@pytest.mark.parametrize("name", NOT_READS)
def test_counter_ignores_work_that_stays_on_the_device(name):
    x = _x()
    with HostSyncCounter(device="cpu") as syncs:
        NOT_READS[name](x)
    assert syncs.count == 0, syncs.sites


def test_step_counters_and_excluded_tensors_are_not_counted():
    step = new_step()
    step += 1  # in place: still the counter new_step made
    lr = torch.tensor(0.5)  # 0-dim float32 on the CPU like a step counter, but not one
    with HostSyncCounter(device="cpu", exclude=[lr]) as syncs:
        int(step.item())
        float(lr)
    assert syncs.count == 0, syncs.sites
    with HostSyncCounter(device="cpu") as syncs:
        float(lr)
        int(step.clone().item())  # by identity, not by shape and dtype
    assert syncs.count == 2


def test_on_a_gpu_only_reads_of_device_tensors_count():
    x = _x()
    with HostSyncCounter(device="cuda") as syncs:  # every tensor here is host memory
        for read, _ in READS.values():
            read(x)
    assert syncs.count == 0, syncs.sites
    # Copies between the host and an accelerator: the meta device stands in for its memory (the
    # rules look at device types only); reading a meta tensor raises, after being counted.
    with HostSyncCounter(device="meta") as syncs:
        on_device = torch.ones(3).to("meta")
        torch.ones(3).to("meta", non_blocking=True)
        torch.ones(3).tolist()
        with pytest.raises(NotImplementedError):
            on_device.cpu()
        with pytest.raises(RuntimeError):
            on_device[0].item()
    assert [event.what for event in syncs.events] == [
        "aten._to_copy (host to device)", "aten._to_copy (device to host)", "aten._local_scalar_dense"]


def test_explicit_waits_count_and_the_wrappers_go_away():
    from deepspeed.accelerator import get_accelerator

    accelerator = get_accelerator()
    had_own = "synchronize" in vars(accelerator)
    with HostSyncCounter(device="cpu") as syncs:
        accelerator.synchronize()
    assert syncs.sites == [syncs.sites[0]] and syncs.sites[0].startswith("accelerator.synchronize at test_host_syncs:")
    assert ("synchronize" in vars(accelerator)) == had_own
    accelerator.synchronize()
    assert syncs.count == 1


def test_sites_name_the_innermost_ds_canzona_frame_and_counters_nest():
    with HostSyncCounter(device="cpu") as outer:
        with HostSyncCounter(device="cpu") as inner:
            clip_coefficient(torch.ones(3, dtype=torch.float64), 1.0)
        _x().sum().item()
    [event] = inner.events
    assert str(event).startswith("aten._local_scalar_dense at ds_canzona.optim.clipping:")
    assert event.site.endswith("(clip_coefficient)") and event.ours and event.owner == "ds_canzona"
    assert outer.count == 2 and outer.sites[0] == inner.sites[0]
    with outer:  # a counter may be used again after its block, not inside it
        with pytest.raises(RuntimeError, match="re-entrant"):
            outer.__enter__()


# --------------------------------------------------------------------------- the pieces of the budget


def test_clip_coefficient_reads_once_and_its_norm_says_overflow():
    sq = torch.tensor([1.0, 4.0, 0.25], dtype=torch.float64)
    with HostSyncCounter(device="cpu") as syncs:
        norm, coefficient = clip_coefficient(sq, 1.0)
    assert syncs.count == 1
    assert norm == math.sqrt(5.25) and coefficient == 1.0 / (math.sqrt(5.25) + 1e-6)
    assert clip_coefficient(sq, 0.0) == (norm, 1.0) and clip_coefficient(sq, 100.0) == (norm, 1.0)
    for bad in (float("nan"), float("inf")):
        with HostSyncCounter(device="cpu") as syncs:
            norm, coefficient = clip_coefficient(torch.tensor([1.0, bad, 2.0], dtype=torch.float64), 1.0)
        assert syncs.count == 1 and not math.isfinite(norm) and coefficient == 1.0


def _per_step_newton(a: torch.Tensor, root: int, *, epsilon: float, max_iters: int, tol: float):
    """The coupled Newton iteration reading its error after every step: (result, steps run)."""
    eye = torch.eye(a.shape[-1], dtype=a.dtype)
    a = a + epsilon * eye if epsilon else a
    z = (root + 1.0) / (2.0 * torch.linalg.matrix_norm(a, keepdim=True))
    x, m, best, steps = z.pow(1.0 / root) * eye, z * a, float("inf"), 0
    for _ in range(max_iters):
        x_new, m_new = newton_kernels.coupled_newton_step_reference(x, m, root)
        steps += 1
        err = (m_new - eye).abs().amax().item()
        if not err < best:
            break
        x, m, best = x_new, m_new, err
        if err <= tol:
            break
    return x, steps


@pytest.mark.parametrize("cond, dtype, epsilon, tol, max_iters", [
    (1e1, torch.float32, 1e-6, 1e-6, 100),
    (1e3, torch.float64, 1e-6, 1e-12, 100),
    (1e6, torch.float32, 0.0, 0.0, 60),   # stops at fp32's rounding floor
    (1e6, torch.float32, 1e-6, 1e-6, 10),  # stops at max_iters
], ids=["cond1e1", "cond1e3-fp64", "rounding-floor", "max-iters"])
def test_newton_inverse_root_reads_every_few_steps_and_keeps_the_per_step_result(cond, dtype, epsilon, tol,
                                                                                  max_iters):
    generator = torch.Generator().manual_seed(3)
    q, _ = torch.linalg.qr(torch.randn(16, 16, dtype=torch.float64, generator=generator))
    spectrum = torch.logspace(0, -math.log10(cond), 16, dtype=torch.float64)
    a = q @ torch.diag(spectrum) @ q.mT
    stack = torch.stack([a, 3.0 * a]).to(dtype)
    expected, steps = _per_step_newton(stack, 4, epsilon=epsilon, max_iters=max_iters, tol=tol)
    with HostSyncCounter(device="cpu") as syncs:
        got = newton_kernels.inverse_root_newton_reference(stack, 4, epsilon=epsilon, max_iters=max_iters, tol=tol)
    assert torch.equal(got, expected)  # the same iterate, bit for bit
    every = newton_kernels.STOP_CHECK_EVERY
    checks = math.ceil(steps / every)
    assert syncs.count == (checks if checks * every <= max_iters else max_iters // every)
    assert all(s.startswith("aten._local_scalar_dense at ds_canzona.kernels.shampoo:") and s.endswith("(_inverse_root)")
               for s in syncs.sites)
    assert syncs.count < steps  # the per-step loop read once per step


# --------------------------------------------------------------------------- whole engine steps

MUON = {"type": "Muon", "params": {"lr": 0.02, "adam_lr": 0.003, "weight_decay": 0.01}}
SHAMPOO = {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}}
NEWTON = {"type": "Shampoo", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2,
                                        "inverse_root": "newton", "epsilon": 1e-6}}
SOAP = {"type": "SOAP", "params": {"lr": 0.003, "adam_lr": 0.003, "precondition_frequency": 2}}
OPTIMIZERS = {"muon": MUON, "shampoo": SHAMPOO, "soap": SOAP}
STEPS = 3
# 0-based optimizer steps whose refresh makes host syncs (precondition_frequency=2): Shampoo refreshes
# its roots at its start step 2 (index 1); SOAP builds its bases by eigh on its first step (index 0)
# and refreshes them by QR at index 2, whose statistics guard (optim/shampoo.py statistic_health,
# one read per tensor: finite, zero or not) makes the only reads there (QR itself makes none).
REFRESH_STEPS = {"muon": set(), "shampoo": {1}, "newton": {1}, "soap": {0, 2}}
REFRESH_SITES = ("ds_canzona.optim.shampoo:", "ds_canzona.optim.soap:", "ds_canzona.kernels.shampoo:")
NORM_READ = "aten._local_scalar_dense at ds_canzona.optim.clipping:"

SCENARIOS: dict[str, dict] = {}
for _kind, _optimizer in OPTIMIZERS.items():
    for _stage in (1, 2, 3):
        SCENARIOS[f"zero{_stage}-{_kind}"] = {"stage": _stage, "ga": 1 if _stage == 1 else 2, "optimizer": _optimizer}
SCENARIOS["zero2-newton"] = {"stage": 2, "ga": 1, "optimizer": NEWTON}
SCENARIOS["zero2-muon-unsynchronised-timer"] = {"stage": 2, "ga": 1, "optimizer": MUON, "synchronized_timer": False}
for _kind, _optimizer in OPTIMIZERS.items():  # AutoTP last (see host_sync_workers.count_host_syncs)
    SCENARIOS[f"autotp-{_kind}"] = {"stage": 1 if _kind != "shampoo" else 2, "tp": 2, "optimizer": _optimizer}


@pytest.fixture(scope="module")
def engine_syncs() -> dict[str, list[dict]]:
    """{scenario: [rank 0's result, rank 1's]} from one spawn of 2 ranks."""
    names = list(SCENARIOS)
    results = run_ranks(count_host_syncs, 2, [{**SCENARIOS[n], "steps": STEPS} for n in names], timeout=600)
    return {name: [rank[index] for rank in results] for index, name in enumerate(names)}


def _kind(name: str) -> str:
    return name.split("-")[1]


@pytest.mark.parametrize("name", SCENARIOS)
def test_steady_state_optimizer_steps_make_one_host_sync(engine_syncs, name):
    refresh_syncs = 0
    for rank, result in enumerate(engine_syncs[name]):
        assert result["skipped"] == 0
        for step, phases in enumerate(result["syncs"]):
            where = f"rank {rank}, step {step}"
            assert [e for e in phases["forward"] if e.ours] == [], where
            assert [str(e) for e in phases["backward"] if e.ours] == [], f"{where}: in backward (gradient hooks)"
            ours = [str(e) for e in phases["step"] if e.ours]
            norm_reads = [s for s in ours if s.startswith(NORM_READ)]
            assert len(norm_reads) == 1, f"{where}: {ours}"
            others = [s for s in ours if not s.startswith(NORM_READ)]
            if step in REFRESH_STEPS[_kind(name)]:
                assert all(s.split(" at ")[1].startswith(REFRESH_SITES) for s in others), f"{where}: {others}"
                refresh_syncs += len(others)
            else:
                assert others == [], f"{where}: steady-state step reads more than the norm: {others}"
    # The refresh steps do sync (eigh's info check, Newton's stopping flag): the counter sees them.
    assert refresh_syncs > 0 or not REFRESH_STEPS[_kind(name)]


@pytest.mark.parametrize("name", SCENARIOS)
def test_everything_else_is_deepspeeds_timer_or_the_models_forward(engine_syncs, name):
    scenario = SCENARIOS[name]
    ga = scenario.get("ga", 1)
    timer = scenario.get("synchronized_timer", True)
    for rank, result in enumerate(engine_syncs[name]):
        for step, phases in enumerate(result["syncs"]):
            where = f"rank {rank}, step {step}"
            assert {e.owner for p in phases.values() for e in p} <= {"ds_canzona", "deepspeed", "transformers"}
            model = [e for p in ("backward", "step") for e in phases[p] if e.owner == "transformers"]
            assert model == [], where
            assert [e for e in phases["backward"] if e.owner == "deepspeed"] == [], where
            if step == 0:
                continue  # ZeRO-3's trace check, AutoTP's input check (module docstring)
            # Its timer synchronises from its start_step on (global step 2), once per micro-batch.
            synchronises = timer and step >= 2
            for phase, timer_call in (("forward", "(start)"), ("step", "(stop)")):
                deepspeed = [(e.what, e.site.split(":")[0], e.site.split(" ")[-1])
                             for e in phases[phase] if e.owner == "deepspeed"]
                expected = [("accelerator.synchronize", "deepspeed.utils.timer", timer_call)] * ga
                assert deepspeed == (expected if synchronises else []), f"{where}, {phase}: {deepspeed}"
