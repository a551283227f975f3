"""scripts/gpu_session.sh, the prepared GPU run, in its CPU dry run, so that it cannot rot unseen.

The dry run (``GPU_SESSION_DRY_RUN=1``) runs every phase's code on the CPU: the kernels in Triton's
interpreter on tiny shapes, DeepSpeed engines of a 2-layer Qwen3 on one gloo rank (every stage and
optimizer, optimizer offload, reentrant checkpointing), the Newton-Schulz timings, ``calibrate`` and
the kernel bench. Here it must pass, write its results under ``OUT`` only, and fail (non-zero, FAIL
in the summary) when a phase fails. What a bare device would meet is run too: DeepSpeed and hjson
missing with no wheels (the install fails at once, the engine phase is skipped, the rest runs),
wheels that install, a shell phase past its limit, a writer killed mid-phase. The preflight of
``gpu_wheels/`` is checked against wheels made wrong on purpose, and the judging of a kernel case
in-process against kernels made wrong on purpose: a miss must be seen, an exception recorded.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
import torch

from ds_canzona.bench._record import JsonRecord
from ds_canzona.bench.gpu import engine as gpu_engine, preflight, validate as gpu_validate

REPO = Path(__file__).resolve().parent.parent
SCRIPT = REPO / "scripts" / "gpu_session.sh"
SKIP_PARTS = {".git", "__pycache__", ".pytest_cache", "gpu_wheels"}


def _tree() -> set[str]:
    """Every file of the checkout outside caches: the dry run must add none."""
    return {str(p.relative_to(REPO)) for p in REPO.rglob("*")
            if not SKIP_PARTS.intersection(p.relative_to(REPO).parts) and not p.name.endswith(".egg-info")}


def _session(out: Path, timeout: float, **env: str) -> subprocess.CompletedProcess:
    environ = {key: value for key, value in os.environ.items() if key != "DS_CANZONA_KERNELS"}
    environ.update(OUT=str(out), GPU_SESSION_DRY_RUN="1", PYTHON=sys.executable, OMP_NUM_THREADS="1",
                   GPU_WHEELS=str(out / "no_wheels"))
    environ.update(env)
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
    session = json.loads((out / "session.json").read_text(encoding="utf-8"))
    assert session["complete"] and session["dry_run"] and session["commit"] in summary
    assert [(p["phase"], p["verdict"]) for p in session["phases"]] == [
        (phase, "PASS") for phase in ("install", "validate", "engine", "ns-time", "calibrate", "sweep")]
    assert all(0 < p["limit_s"] <= 600 and p["seconds"] <= p["limit_s"] for p in session["phases"])
    for name in ("validate", "engine", "ns_time", "kernels_sweep"):  # the incremental files, finished
        assert json.loads((out / f"{name}.json").read_text(encoding="utf-8"))["complete"] is True, name


def test_dry_run_writes_only_under_out(dry_run) -> None:
    _, out, before, after = dry_run
    assert after == before, f"files appeared in the checkout: {sorted(after - before)}"
    files = sorted(p.name for p in out.iterdir())
    assert files == ["calibrate.json", "engine.json", "kernels_sweep.json", "ns_time.json", "session.json",
                     "session.log", "validate.json"]  # a device call returns at most 8 files


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
    # The default pass took the GPU's route: every function's first-use check ran (under the
    # interpreter), HAS_C both ways, the size-1 dim in its own class.
    report = payload["backend_report"]
    for op in ("xxt", "ns_step", "sym_stat_update_", "sym_matmul", "coupled_newton_step"):
        assert f"{op}: triton" in report, report
    assert "passed its first-use check" in report and "failed" not in report, report
    assert "HAS_C=True" in report and "HAS_C=False" in report, report
    assert "[1, 70]" in report, report
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
    assert sorted((r["stage"], r["optimizer"], r["variant"]) for r in rows) == sorted(
        [(s, o, "") for s in (1, 2, 3) for o in ("muon", "shampoo", "soap")]
        + [(2, "muon", "offload"), (3, "muon", "reentrant")])
    assert [r["variant"] for r in rows[3:5]] == ["offload", "reentrant"]  # before the repeats a budget may skip
    # The tied embedding's two gradients per backward under reentrant checkpointing reached ZeRO-3's
    # two-gradient path; without checkpointing each tensor got one.
    assert [r["gradient_arrived_twice"] for r in rows if r["stage"] == 3] == [False, True, False, False], rows
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


# --------------------------------------------------------------------------- a bare device


def _hiding(tmp_path: Path, *modules: str) -> dict[str, str]:
    """The environment of a Python that cannot import ``modules`` from its site-packages (as the
    device image lacks DeepSpeed, hjson and pydantic) but still can from anywhere else: the session's
    temporary folder, once the wheels are installed there."""
    folder = tmp_path / "hide"
    folder.mkdir()
    (folder / "sitecustomize.py").write_text(f"""
import importlib.machinery, sys
HIDDEN = {sorted(modules)!r}
class HideFromSitePackages:
    @staticmethod
    def find_spec(name, path=None, target=None):
        if name not in HIDDEN:
            return None
        elsewhere = [p for p in sys.path if "-packages" not in p]
        spec = importlib.machinery.PathFinder.find_spec(name, elsewhere)
        if spec is None:
            raise ModuleNotFoundError(f"No module named {{name!r}} (hidden from site-packages)", name=name)
        return spec
sys.meta_path.insert(0, HideFromSitePackages)
""", encoding="utf-8")
    return {"PYTHONPATH": str(folder) + os.pathsep + os.environ.get("PYTHONPATH", "")}


def test_missing_deepspeed_without_wheels_fails_at_once_and_skips_the_engine(tmp_path) -> None:
    started = time.monotonic()
    result = _session(tmp_path, timeout=120, GPU_SESSION_PHASES="install,engine,calibrate",
                      **_hiding(tmp_path, "deepspeed", "hjson"))
    took = time.monotonic() - started
    log = result.stdout
    assert result.returncode != 0 and "gpu_session: FAILED" in log, log[-3000:]
    assert "missing: deepspeed hjson" in log and "PROBLEM: no wheels in" in log
    assert "registry" not in log.replace("no package registry", "")  # nothing waits on a network
    session = json.loads((tmp_path / "session.json").read_text(encoding="utf-8"))
    verdicts = {p["phase"]: (p["verdict"], p.get("seconds")) for p in session["phases"]}
    assert verdicts["install"][0] == "FAIL" and verdicts["install"][1] <= 20, verdicts
    assert verdicts["engine"][0] == "SKIP" and verdicts["calibrate"][0] == "PASS", verdicts  # the rest still ran
    assert not (tmp_path / "engine.json").exists() and session["complete"]
    assert took < 90, took


def _wheel_of_installed(distribution: str, package: str, folder: Path) -> Path:
    """A wheel made of an installed pure-Python distribution's own files (no network)."""
    from importlib import metadata

    dist = metadata.distribution(distribution)
    name = f"{distribution}-{dist.version}-py3-none-any.whl"
    folder.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(folder / name, "w") as archive:
        for file in dist.files:
            if file.parts[0] in (package, f"{dist.metadata['Name']}-{dist.version}.dist-info") and \
                    "__pycache__" not in file.parts:
                archive.write(file.locate(), file.as_posix())
    return folder / name


def test_carried_wheels_pass_the_preflight_and_install(tmp_path) -> None:
    wheels = tmp_path / "wheels"
    _wheel_of_installed("hjson", "hjson", wheels)
    (wheels / "COMMIT").write_text("commit test\n" + subprocess.run(
        [sys.executable, str(REPO / "ds_canzona" / "bench" / "gpu" / "preflight.py"), "--digests"],
        capture_output=True, text=True, check=True).stdout, encoding="utf-8")
    result = _session(tmp_path, timeout=120, GPU_SESSION_PHASES="install", GPU_WHEELS=str(wheels),
                      **_hiding(tmp_path, "hjson"))
    log = result.stdout
    assert result.returncode == 0, log[-3000:]
    assert "missing: hjson" in log and "preflight: the wheels would work" in log
    assert "installing from gpu_wheels: hjson-" in log and "PASS    install " in log
    assert "deepspeed: already importable there, no wheel needed" in log


def test_a_shell_phase_past_its_limit_is_stopped(tmp_path) -> None:
    # The install phase is a shell function: it runs under its cap like the Python phases. A
    # Python that hangs when asked which modules exist stands in for a hung step.
    python = tmp_path / "python"
    python.write_text(f'#!/bin/bash\ncase "$*" in *find_spec*) sleep 120;; esac\nexec {sys.executable} "$@"\n')
    python.chmod(0o755)
    started = time.monotonic()
    result = _session(tmp_path, timeout=100, GPU_SESSION_PHASES="install,calibrate", PYTHON=str(python),
                      GPU_SESSION_CAPS="install=3")
    took = time.monotonic() - started
    assert "TIMEOUT install (exit 124" in result.stdout and "PASS    calibrate " in result.stdout, result.stdout[-3000:]
    assert result.returncode != 0 and took < 60, took
    phases = json.loads((tmp_path / "session.json").read_text(encoding="utf-8"))["phases"]
    assert phases[0]["phase"] == "install" and phases[0]["verdict"] == "TIMEOUT" and phases[0]["limit_s"] == 3


def test_a_phase_killed_mid_way_leaves_the_rows_it_finished(tmp_path) -> None:
    path = tmp_path / "phase.json"
    writer = subprocess.Popen([sys.executable, "-c", f"""
import sys, time
sys.path.insert(0, {str(REPO)!r})
from ds_canzona.bench._record import JsonRecord
record = JsonRecord(__import__("pathlib").Path({str(path)!r}), {{"env": {{"device": "cpu"}}}})
for i in range(2):
    record.add({{"case": i, "passed": True}})
print("written", flush=True)
time.sleep(120)
"""], stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "written"
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.wait(30)
    payload = json.loads(path.read_text(encoding="utf-8"))
    assert payload == {"env": {"device": "cpu"}, "rows": [{"case": 0, "passed": True}, {"case": 1, "passed": True}],
                       "complete": False}
    assert [p.name for p in tmp_path.iterdir()] == ["phase.json"]  # no partial file left beside it
    record = JsonRecord(path, {"env": {}})
    record.add({"case": 0})
    assert json.loads(record.finish(backend_report="x").read_text(encoding="utf-8"))["complete"] is True


# --------------------------------------------------------------------------- the preflight of gpu_wheels/


def _fake_wheel(folder: Path, filename: str, requires: tuple[str, ...] = (), python: str | None = None) -> Path:
    dist, version = filename.split("-")[:2]
    folder.mkdir(parents=True, exist_ok=True)
    lines = ["Metadata-Version: 2.1", f"Name: {dist}", f"Version: {version}"]
    lines += [f"Requires-Python: {python}"] if python else []
    lines += [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(folder / filename, "w") as archive:
        archive.writestr(f"{dist}-{version}.dist-info/METADATA", "\n".join(lines) + "\n\nDescription.\n")
    return folder / filename


def _device_like_folder(folder: Path) -> Path:
    """What scripts/gpu_wheels.sh carries, as empty wheels with the real names and requirements."""
    _fake_wheel(folder, "deepspeed-0.19.8-py3-none-any.whl", ("hjson", "pydantic>=2.0.0", "torch>=2.0.0",
                                                              'docutils<0.18; extra == "dev"'))
    _fake_wheel(folder, "hjson-3.1.0-py3-none-any.whl")
    _fake_wheel(folder, "pydantic-2.13.4-py3-none-any.whl", ("annotated-types>=0.6.0", "pydantic-core==2.46.4",
                                                            "typing-extensions>=4.14.1"), python=">=3.9")
    _fake_wheel(folder, "pydantic_core-2.46.4-cp312-cp312-manylinux_2_17_x86_64.manylinux2014_x86_64.whl",
                ("typing-extensions>=4.14.1",))
    _fake_wheel(folder, "annotated_types-0.7.0-py3-none-any.whl")
    _fake_wheel(folder, "typing_extensions-4.16.0-py3-none-any.whl")
    return folder


def test_preflight_passes_the_prepared_folder_and_names_every_fault(tmp_path) -> None:
    good = _device_like_folder(tmp_path / "good")
    report = preflight.check_wheels(good, python=(3, 12))
    assert report.ok, report.text()
    assert any("torch>=2.0.0: expected on the target" in n for n in report.notes)  # left to the device image
    assert not any("docutils" in n for n in report.notes)  # an extra's requirement is not a plain install's
    assert not preflight.check_wheels(good, python=(3, 11)).ok  # the cp312 build
    assert "glibc 2.12" in " ".join(preflight.check_wheels(good, python=(3, 12), glibc=(2, 12)).problems)

    def problems(edit) -> str:
        folder = _device_like_folder(tmp_path / edit.__name__)
        edit(folder)
        report = preflight.check_wheels(folder, python=(3, 12))
        assert not report.ok and "FAILED" in report.text()
        return " ".join(report.problems)

    def core_at_another_version(folder):
        next(folder.glob("pydantic_core-*")).unlink()
        _fake_wheel(folder, "pydantic_core-2.46.3-cp312-cp312-manylinux2014_x86_64.whl")

    def two_versions(folder):
        _fake_wheel(folder, "hjson-3.0.2-py3-none-any.whl")

    def no_deepspeed(folder):
        next(folder.glob("deepspeed-*")).unlink()

    def windows_build(folder):
        next(folder.glob("pydantic_core-*")).unlink()
        _fake_wheel(folder, "pydantic_core-2.46.4-cp312-cp312-win_amd64.whl")

    def needs_python_4(folder):
        _fake_wheel(folder, "annotated_types-0.7.0-py3-none-any.whl", python=">=4")

    assert "pydantic needs pydantic-core==2.46.4" in problems(core_at_another_version)
    assert "two versions of hjson" in problems(two_versions)
    assert "no wheel provides deepspeed" in problems(no_deepspeed)
    assert "platform tag win_amd64" in problems(windows_build)
    assert "Requires-Python >=4" in problems(needs_python_4)
    assert "more than the 0 MiB" in " ".join(preflight.check_wheels(good, python=(3, 12), limit_bytes=10).problems)
    assert "no such folder" in " ".join(preflight.check_wheels(tmp_path / "absent", python=(3, 12)).problems)


def test_preflight_on_the_device_asks_its_packages_and_the_recipe(tmp_path) -> None:
    folder = _device_like_folder(tmp_path / "w")
    have = {"torch": "2.11.0", "typing-extensions": "4.12.0"}
    report = preflight.check_wheels(folder, python=(3, 12), installed=have.get, module_present=lambda m: False)
    assert report.ok, report.text()  # typing-extensions: the carried 4.16 meets >=4.14.1, not the image's 4.12
    report = preflight.check_wheels(folder, python=(3, 12), installed={}.get, module_present=lambda m: False)
    assert "deepspeed needs torch>=2.0.0: neither carried nor installed" in report.problems
    report = preflight.check_wheels(folder, python=(3, 12), installed={"torch": "1.13.1"}.get,
                                    module_present=lambda m: False)
    assert "deepspeed needs torch>=2.0.0: 1.13.1 is installed, no wheel carried" in report.problems
    # COMMIT: written by this recipe, else the wheels are stale.
    report = preflight.check_wheels(folder, python=(3, 12), repo=REPO)
    assert any("no w/COMMIT" in p for p in report.problems)
    (folder / "COMMIT").write_text(f"commit abc\nsource-digest 0\nrecipe-digest {preflight.recipe_digest(REPO)}\n")
    assert preflight.check_wheels(folder, python=(3, 12), repo=REPO).ok
    (folder / "COMMIT").write_text("commit abc\nsource-digest 0\nrecipe-digest 0123456789abcdef\n")
    assert any("the recipe changed" in p for p in preflight.check_wheels(folder, python=(3, 12), repo=REPO).problems)


def test_engine_cases_set_the_timeout_and_the_variants() -> None:
    settings = gpu_engine.EngineSettings.for_run(dry=True)
    offload = gpu_engine.ds_config(2, "muon", settings, "offload")
    assert offload["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    for stage, optimizer, variant in gpu_engine.CASE_ORDER:
        config = gpu_engine.ds_config(stage, optimizer, settings, variant)
        assert config["canzona"]["comm_timeout_s"] == gpu_engine.COMM_TIMEOUT_S
    assert len(set(gpu_engine.CASE_ORDER)) == 11
    with pytest.raises(ValueError, match="unknown engine case variant"):
        gpu_engine.ds_config(2, "muon", settings, "nvme")


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
        assert {c.variant for c in selected} == {"", "transposed", "right", "stat16", "root3", "beta0"}
        assert any(1 in c.shape[-2:] for c in selected)  # a size-1 dim
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
