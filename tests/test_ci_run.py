""".ci/run: installs, runs the README's test command, and prints the test phase's wall time.

Run on a copy of the script beside stand-in setup and test scripts, so the check takes no install
and no suite: the time line must come out whether the tests pass or fail, and the script's exit
status must be the test command's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("test_status", [0, 3])
def test_ci_run_prints_the_test_phase_time_and_keeps_its_status(tmp_path, test_status):
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts" / "setup.sh").write_text("echo installed\n")
    (tmp_path / "scripts" / "test.sh").write_text(f"echo tests ran\nexit {test_status}\n")
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode == test_status, done
    lines = done.stdout.splitlines()
    assert lines[:2] == ["installed", "tests ran"], lines
    assert re.fullmatch(rf"ci: test phase took \d+m\d\ds \(budget 25m\), exit status {test_status}", lines[-1]), lines


def test_ci_run_stops_when_the_install_fails(tmp_path):
    (tmp_path / ".ci").mkdir()
    (tmp_path / "scripts").mkdir()
    shutil.copy(ROOT / ".ci" / "run", tmp_path / ".ci" / "run")
    (tmp_path / "scripts" / "setup.sh").write_text("exit 5\n")
    (tmp_path / "scripts" / "test.sh").write_text("echo tests ran\n")
    done = subprocess.run(["bash", str(tmp_path / ".ci" / "run")], capture_output=True, text=True, timeout=60)
    assert done.returncode == 5 and "tests ran" not in done.stdout, done
