"""scripts/gpu_session.sh, the prepared GPU run, in its CPU dry run, so that it cannot rot unseen.

The dry run (``GPU_SESSION_DRY_RUN=1``) runs every phase's code on the CPU: the kernels in Triton's
interpreter on tiny shapes, DeepSpeed engines of a 2-layer Qwen3 on one gloo rank, the Newton-Schulz
timings, ``calibrate`` and the kernel bench. Here it must pass, write its results under ``OUT`` only,
and fail (non-zero, FAIL in the summary) when a phase fails. The judging of a kernel case is checked
in-process against kernels made wrong on purpose: a miss must be seen, an exception recorded.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ds_canzona.bench.gpu import engine as gpu_engine, validate as gpu_validate

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_session.sh"
SKIP_PARTS = {".git", "__pycache__", ".pytest_cache", "gpu_wheels"}


def _tree() -> set[str]:
    """Every file of the checkout outside caches: the dry run must add none."""
    return {str(p.relative_to(REPO)) for p in REPO.rglob("*")
            if not SKIP_PARTS.intersection(p.relative_to(REPO).parts) and not p.name.endswith(".egg-info")}


def _session(out: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != "DS_CANZONA_KERNELS"}
    environ.update(OUT=str(out), GPU_SESSION_DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1", **env)
    return subprocess.run(["bash", str(SCRIPT)], cwd=REPO, env=environ, capture_output=True, text=True,
                          timeout=timeout)


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory) -> tuple[subprocess.CompletedProcess, Path, set[str], set[str]]:
    out = tmp_path_factory.mktemp("gpu_out")
    before = _tree()
    result = _session(out, timeout=400)
    return result, out, before, _tree()


def test_dry_run_passes_every_phase(dry_run) -> None:
    result, out, _, _ = dry_run
    log = result.stdout + result.stderr
    assert result.returncode == 0, log[-6000:]
    summary = log[log.index("=== summary"):]
    for phase in ("install", "validate", "engine", "ns-time", "calibrate", "sweep"):
        assert f"PASS    {phase} " in summary, summary
    assert "gpu_session: all phases passed" in summary
    assert "a process per dtype, 2 at a time" in log  # the validation's worker path, as on a GPU
    assert (out / "session.log").read_text(encoding="utf-8").strip() == result.stdout.strip()


def test_dry_run_writes_only_under_out(dry_run) -> None:
    _, out, before, after = dry_run
    assert after == before, f"files appeared in the checkout: {sorted(after - before)}"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["calibrate.json", "engine.json", "kernels_sweep.json", "ns_time.json", "session.log",
                     "validate.json"]


def test_dry_run_validates_every_case_on_both_backends(dry_run) -> None:
    _, out, _, _ = dry_run
    payload = json.loads((out / "validate.json").read_text(encoding="utf-8"))
    expected = {c.name for c in gpu_validate.cases(dry=True)}
    assert {op for op in gpu_validate.BOUND_U} == {c.op for c in gpu_validate.cases(dry=True)}
    for backend in ("triton", "default"):
        rows = [r for r in payload["rows"] if r["backend"] == backend]
        assert {r["case"] for r in rows} == expected
        for row in rows:
            assert row["passed"], row
            assert row["err"] <= row["bound_u"] * gpu_validate.UNIT_ROUNDOFF[
                "float32" if row["op"] == "sym_stat_update_" and row["variant"] != "stat16" else row["dtype"]]
    env = payload["env"]
    assert env["triton_interpret"] == "1"
    # The code of this checkout, imported through the session's temporary package view (from the
    # tree itself ds_canzona.kernels would not resolve: setup.py maps it).
    assert Path(env["package"]) == REPO / "ds_canzona"
    assert "gpu_session." in env["imported_from"] and not env["imported_from"].startswith(str(REPO))


def test_dry_run_trains_every_stage_and_optimizer(dry_run) -> None:
    _, out, _, _ = dry_run
    payload = json.loads((out / "engine.json").read_text(encoding="utf-8"))
    assert payload["model_config"]["num_hidden_layers"] == 2 and payload["model_config"]["tie_word_embeddings"]
    rows = payload["rows"]
    assert sorted((r["stage"], r["optimizer"]) for r in rows) == sorted(
        (s, o) for s in (1, 2, 3) for o in ("muon", "shampoo", "soap"))
    settings = payload["settings"]
    for row in rows:
        assert row["passed"] and not row.get("skipped"), row
        assert len(row["losses"]) == settings["warmup"] + settings["steps"] + 1  # and the counted step
        assert all(math.isfinite(v) for v in row["losses"])
        assert row["forward_ms"] > 0 and row["backward_ms"] > 0 and row["step_ms"] > 0
    # A 2-layer model on one repeated batch: every optimizer lowers the loss within two updates.
    assert all(row["loss_fell"] for row in rows), [(r["stage"], r["optimizer"], r["losses"]) for r in rows]


def test_dry_run_times_newton_schulz_and_calibrates(dry_run) -> None:
    _, out, _, _ = dry_run
    rows = json.loads((out / "ns_time.json").read_text(encoding="utf-8"))["rows"]
    assert {(r["method"], r["dtype"]) for r in rows} == {("gram", "float16"), ("standard", "bfloat16")}
    for row in rows:
        assert row["passed"] and row["triton_ms"] > 0 and row["torch_ms"] > 0, row
        assert row["triton_err"] < 0.05 and row["torch_err"] < 0.05, row  # 16-bit Newton-Schulz against float64
    calibration = json.loads((out / "calibrate.json").read_text(encoding="utf-8"))
    assert calibration["machine_balance"] > 0


def test_a_failing_phase_fails_the_run(tmp_path) -> None:
    # An invalid backend name is an import-time error of the kernels: the ns-time phase (the
    # cheapest that imports them) fails, and with it the run.
    result = _session(tmp_path, timeout=120, GPU_SESSION_PHASES="ns-time", DS_CANZONA_KERNELS="bogus")
    assert result.returncode != 0
    assert "FAIL    ns-time " in result.stdout and "gpu_session: FAILED" in result.stdout, result.stdout[-3000:]


# --------------------------------------------------------------------------- judging, in-process


def _xxt_cases() -> list[gpu_validate.Case]:
    return [c for c in gpu_validate.cases(dry=True, ops=["xxt"], dtypes=["float32", "bfloat16"])]


def test_a_wrong_kernel_is_a_miss_and_an_exception_is_recorded(monkeypatch) -> None:
    import ds_canzona.kernels as K

    honest = K.xxt
    calls = []

    def off_by_a_little(x, *, out=None, config=None):
        calls.append(x.shape)
        res = honest(x, out=out)
        res[..., 0, 0] += res.abs().amax() * 0.2  # one element 20% of the largest off: above every bound
        return res

    def raising(x, *, out=None, config=None):
        raise RuntimeError("compile error (injected)")

    cases = _xxt_cases()
    backend = K.get_backend()
    monkeypatch.setattr(K, "xxt", off_by_a_little)
    rows = gpu_validate.run_cases(cases, backend="torch", device="cpu")
    assert len(calls) == len(cases) and not any(r["passed"] for r in rows)
    # On the CPU the absolute bounds judge; the torch yardstick is a GPU's (judged when asked for).
    assert all("fixed bound" in r["reason"] and "largest error" in r["reason"] and "x torch" not in r["reason"]
               for r in rows)
    rows = gpu_validate.run_cases(cases, backend="torch", device="cpu", yardstick=True)
    assert all("x torch " in r["reason"] and "x torch's" in r["reason"] for r in rows), rows

    monkeypatch.setattr(K, "xxt", raising)
    rows = gpu_validate.run_cases(cases, backend="torch", device="cpu")
    assert [r["case"] for r in rows] == [c.name for c in cases]  # every case ran after the first raised
    assert all(not r["passed"] and "compile error (injected)" in r["reason"] for r in rows)
    assert K.get_backend() == backend  # restored

    monkeypatch.setattr(K, "xxt", honest)
    assert all(r["passed"] for r in gpu_validate.run_cases(cases, backend="torch", device="cpu"))


def test_one_wrong_element_the_norm_averages_away_is_a_miss(monkeypatch) -> None:
    import ds_canzona.kernels as K

    honest = K.xxt

    def one_element_off(x, *, out=None, config=None):
        res = honest(x, out=out)
        res[0, 0, 0] += res.abs().amax() * 0.03  # 7.7 u of the largest element, in bf16
        return res

    case = next(c for c in _xxt_cases() if c.dtype == "bfloat16" and len(c.shape) == 3)
    monkeypatch.setattr(K, "xxt", one_element_off)
    row = gpu_validate.run_cases([case], backend="torch", device="cpu")[0]
    assert not row["passed"] and row["reason"].startswith("largest error"), row  # the norm bounds alone pass
    assert "x the fixed bound" in row["reason"], row  # the absolute elementwise bound, on any processor


def test_an_asymmetric_or_unwritten_output_is_a_miss(monkeypatch) -> None:
    import ds_canzona.kernels as K

    honest = K.xxt

    def skewed(x, *, out=None, config=None):
        res = honest(x, out=out)
        res[..., 0, 1] = torch.nextafter(res[..., 0, 1], torch.full_like(res[..., 0, 1], math.inf))
        return res

    def half_written(x, *, out=None, config=None):
        full = honest(x)
        out[..., : out.shape[-2] // 2, :] = full[..., : out.shape[-2] // 2, :]
        return out

    case = _xxt_cases()[0]
    monkeypatch.setattr(K, "xxt", skewed)
    assert "not symmetric" in gpu_validate.run_cases([case], backend="torch", device="cpu")[0]["reason"]
    monkeypatch.setattr(K, "xxt", half_written)
    assert "not finite" in gpu_validate.run_cases([case], backend="torch", device="cpu")[0]["reason"]


def test_every_case_has_a_bound_and_the_dry_list_covers_every_variant() -> None:
    for dry in (True, False):
        selected = gpu_validate.cases(dry=dry)
        assert {c.dtype for c in selected} == set(gpu_validate.DTYPES)
        assert {c.variant for c in selected} == {"", "transposed", "right", "stat16", "root3"}
        for case in selected:
            assert case.dtype in gpu_validate.BOUND_U[case.op]
    with pytest.raises(ValueError, match="unknown op or dtype"):
        gpu_validate.cases(dry=True, ops=["gemm"])


def test_engine_summary_fails_a_non_finite_loss() -> None:
    settings = gpu_engine.EngineSettings.for_run(dry=True)

    def records(*losses: float) -> list[dict]:
        steps = [{"forward_s": 0.1, "backward_s": 0.2, "step_s": 0.3 + i, "loss": loss}
                 for i, loss in enumerate(losses)]
        steps[-1].update(syncs={p: {"host": None, "cuda": 2} for p in gpu_engine.PHASES},
                         sites={p: {"cuda: x.py:1": 2} for p in gpu_engine.PHASES})
        return steps

    good = gpu_engine._summarise(1, "muon", settings, records(3.0, 2.5, 2.0), 1.0, None)
    assert good["passed"] and good["loss_fell"]
    assert good["step_ms"] == pytest.approx(1300.0)  # the timed step only: not the warm-up, not the counted one
    assert good["cuda_syncs_per_step"] == 6 and good["host_syncs_per_step"] is None
    bad = gpu_engine._summarise(1, "muon", settings, records(3.0, math.nan, 2.0), 1.0, None)
    assert not bad["passed"] and "not finite" in bad["reason"]


def test_gpu_model_is_qwen3_0_6b_shaped() -> None:
    config = gpu_engine.model_config(gpu_engine.EngineSettings.for_run(dry=False))
    assert (config["hidden_size"], config["num_hidden_layers"], config["num_attention_heads"],
            config["num_key_value_heads"], config["head_dim"], config["intermediate_size"], config["vocab_size"],
            config["tie_word_embeddings"]) == (1024, 28, 16, 8, 128, 3072, 151936, True)
    shapes = {(m, n) for _, m, n in gpu_engine.matrix_shapes(gpu_engine.EngineSettings.for_run(dry=False))}
    assert shapes == {(2048, 1024), (1024, 1024), (1024, 2048), (3072, 1024), (1024, 3072)}


def test_sync_count_counts_cuda_sync_warnings_and_passes_the_others_on(monkeypatch) -> None:
    # No CUDA here: torch.cuda's switch is stood in for, and the region emits the warning that
    # torch.cuda.set_sync_debug_mode("warn") makes every synchronising call emit.
    import warnings

    from ds_canzona.bench.gpu import syncs as gpu_syncs

    modes = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_sync_debug_mode", lambda: 0)
    monkeypatch.setattr(torch.cuda, "set_sync_debug_mode", modes.append)
    with warnings.catch_warnings(record=True) as outside:
        warnings.simplefilter("always")
        with gpu_syncs.SyncCount(cuda=True) as count:
            for _ in range(3):
                warnings.warn("called a synchronizing CUDA operation", UserWarning)
            warnings.warn("something else", FutureWarning)
    assert modes == ["warn", 0]  # switched on for the region, then back
    assert count.cuda == 3 and sum(n for site, n in count.sites.items() if site.startswith("cuda: ")) == 3
    assert [str(w.message) for w in outside] == ["something else"]
    if not gpu_syncs.HOST_COUNTER_AVAILABLE:
        assert count.host is None


def test_newton_schulz_timing_flags_a_kernel_less_accurate_than_torch(monkeypatch) -> None:
    import ds_canzona.kernels as K

    honest_xxt, honest_step = K.xxt, K.ns_step
    generator = torch.Generator().manual_seed(0)

    def noisy(result: torch.Tensor) -> torch.Tensor:  # 5% of the largest element: far above 16-bit rounding
        noise = torch.randn(result.shape, generator=generator).to(result.dtype)
        return result + 0.05 * result.abs().amax() * noise

    # Under "triton" (the kernels are not interpreted in this process) the references, made noisy.
    def xxt(x, *, out=None, config=None):
        return noisy(K.xxt_reference(x)) if K.get_backend() == "triton" else honest_xxt(x, out=out)

    def ns_step(x, a, b, c, *, out=None, config=None):
        if K.get_backend() == "triton":
            return noisy(K.ns_step_reference(x, a, b, c))
        return honest_step(x, a, b, c, out=out)

    monkeypatch.setattr(K, "xxt", xxt)
    monkeypatch.setattr(K, "ns_step", ns_step)
    rows = gpu_engine.time_newton_schulz(gpu_engine.EngineSettings.for_run(dry=True), device="cpu", repeats=1)
    assert rows and all("speedup" in r and not r["passed"] and "triton's error" in r["reason"] for r in rows), rows
