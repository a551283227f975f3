"""The pieces of scripts/deepspeed_unit_tests.sh that run in-process: the injection and the table.

The script itself runs DeepSpeed's unit tests twice (minutes; not in CI, docs/NOTES.md has its
last table). Here: ``deepspeed.initialize`` wrapped by the injection adds ``"canzona": {"enabled":
true}`` to a copy of exactly the configs it should (ZeRO 1/2/3 with an optimizer, as a dict or a
JSON file) and passes the others through untouched; the table reads pytest's JUnit reports (or,
for a run that was stopped, its log).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

HELPERS = Path(__file__).resolve().parent.parent / "scripts" / "deepspeed_unit_tests"


@pytest.fixture
def injected(monkeypatch):
    """deepspeed.initialize replaced by a recorder, then wrapped by the injection: what reaches DeepSpeed."""
    import deepspeed

    monkeypatch.syspath_prepend(str(HELPERS))
    import ds_canzona_inject

    seen = []
    monkeypatch.setattr(deepspeed, "initialize", lambda *args, **kwargs: seen.append(kwargs))
    ds_canzona_inject.install()
    assert deepspeed.initialize is not seen  # wrapped
    yield deepspeed.initialize, seen
    sys.modules.pop("ds_canzona_inject", None)


def test_injection_enables_canzona_only_for_zero_engines_with_an_optimizer(injected, tmp_path):
    initialize, seen = injected
    adam = {"type": "Adam", "params": {"lr": 1e-3}}
    config = {"zero_optimization": {"stage": 2}, "optimizer": adam}
    initialize(model=None, config=config)
    assert seen[-1]["config"]["canzona"] == {"enabled": True}
    assert "canzona" not in config  # the test's own dict is left alone
    initialize(model=None, config={"zero_optimization": {"stage": 3}}, optimizer=object())  # a client optimizer
    assert seen[-1]["config"]["canzona"] == {"enabled": True}
    for untouched in ({"zero_optimization": {"stage": 0}, "optimizer": adam}, {"optimizer": adam},
                      {"zero_optimization": {"stage": 1}},
                      {"zero_optimization": {"stage": 1}, "optimizer": adam, "canzona": {"enabled": False}}):
        initialize(model=None, config=untouched)
        assert seen[-1]["config"] is untouched
    path = tmp_path / "ds.json"
    path.write_text(json.dumps(config))
    initialize(model=None, config=str(path))
    assert seen[-1]["config"] == {**config, "canzona": {"enabled": True}}


def test_table_reads_both_reports(tmp_path, capsys):
    sys.path.insert(0, str(HELPERS))
    try:
        import table
    finally:
        sys.path.remove(str(HELPERS))
    case = '<testcase classname="unit.runtime.zero.test_x.TestY" name="test_z[{}]">{}</testcase>'
    stock = case.format(1, "") + case.format(2, "") + case.format(3, '<skipped message="s"/>')
    injected = case.format(1, "") + case.format(2, '<failure message="f"/>') + case.format(3, '<skipped message="s"/>')
    for name, body in (("stock", stock), ("injected", injected)):
        (tmp_path / f"{name}.xml").write_text(f"<testsuites><testsuite>{body}</testsuite></testsuites>")
    (tmp_path / "log").write_text('{"pid": 1, "stage": 2}\n{"pid": 2, "stage": 3}\n')
    table.main(str(tmp_path / "stock.xml"), str(tmp_path / "injected.xml"), str(tmp_path / "log"))
    out = capsys.readouterr().out
    assert "| test_x.py::TestY::test_z[1] | pass | pass |" in out
    assert "| test_x.py::TestY::test_z[2] | pass | fail |" in out
    assert "| test_x.py::TestY::test_z[3] | skip | skip |" in out
    assert "- stock pass, injected fail: 1" in out and "engines built in the injected run: 2" in out
    # A stopped run leaves no report: its verbose log is read, a case without an outcome is "no result".
    (tmp_path / "stock.xml").unlink()
    (tmp_path / "stock.log").write_text("unit/runtime/zero/test_x.py::TestY::test_z[1] \x1b[32mPASSED\x1b[0m [ 50%]\n"
                                        "unit/runtime/zero/test_x.py::TestY::test_z[2] \n")
    table.main(str(tmp_path / "stock.xml"), str(tmp_path / "injected.xml"))
    out = capsys.readouterr().out
    assert "| test_x.py::TestY::test_z[1] | pass | pass |" in out
    assert "| test_x.py::TestY::test_z[2] | no result | fail |" in out
