"""The table of scripts/deepspeed_unit_tests.sh: each case's outcome stock and with ds_canzona injected.

    python table.py stock.xml injected.xml [injections.log]

Reads the two JUnit XML reports pytest wrote and prints one Markdown row per case (pass, fail,
error, skip), then the counts and, with the injection log, how many engines the injected run
built with ds_canzona (per process, not per case: DeepSpeed's test ranks are forkserver
processes that do not see which test the parent is running).
"""

from __future__ import annotations

import json
import os
import re
import sys
import xml.etree.ElementTree as ET
from collections import Counter


LOG_LINE = re.compile(r"^(?P<file>\S+\.py)::(?P<test>\S+) (?P<outcome>PASSED|FAILED|ERROR|SKIPPED)")
STARTED = re.compile(r"^(?P<file>\S+\.py)::(?P<test>\S+) ")


def outcomes(path: str) -> dict[str, str]:
    """Each case's outcome from a JUnit report; from the pytest log beside it if the run left none.

    A run that was stopped writes no report: its verbose log's per-case lines are read instead,
    and a case that started without an outcome is "no result".
    """
    if not os.path.exists(path):
        return outcomes_from_log(os.path.splitext(path)[0] + ".log")
    result = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        if case.find("failure") is not None:
            outcome = "fail"
        elif case.find("error") is not None:
            outcome = "error"
        elif case.find("skipped") is not None:
            outcome = "skip"
        else:
            outcome = "pass"
        result[name] = outcome
    return result


def outcomes_from_log(path: str) -> dict[str, str]:
    result = {}
    with open(path) as handle:
        for line in handle:
            line = re.sub(r"\x1b\[[0-9;]*m", "", line)
            match = LOG_LINE.match(line) or STARTED.match(line)
            if match:
                # As the JUnit report names it: "package.module.Class::test".
                *classes, test = match["test"].split("::")
                name = ".".join([match["file"][:-3].replace("/", "."), *classes]) + f"::{test}"
                outcome = match.groupdict().get("outcome")
                result[name] = {"PASSED": "pass", "FAILED": "fail", "ERROR": "error", "SKIPPED": "skip"}.get(
                    outcome, "no result")
    return result


def short(name: str) -> str:
    """``tests.unit.runtime.zero.test_x.TestY::test_z[...]`` -> ``test_x.py::TestY::test_z[...]``."""
    module, _, test = name.partition("::")
    parts = module.split(".")
    for i, part in enumerate(parts):
        if part.startswith("test_"):
            return "::".join([part + ".py"] + parts[i + 1:] + [test])
    return name


def injections(log: str) -> int:
    try:
        with open(log) as handle:
            return sum(1 for line in handle if json.loads(line).get("stage"))
    except FileNotFoundError:
        return 0


def main(stock_xml: str, injected_xml: str, log: str | None = None) -> None:
    stock, injected = outcomes(stock_xml), outcomes(injected_xml)
    print("| case | stock | injected |")
    print("|---|---|---|")
    counts: Counter = Counter()
    for name in sorted(set(stock) | set(injected)):
        a, b = stock.get(name, "-"), injected.get(name, "-")
        counts[(a, b)] += 1
        print(f"| {short(name)} | {a} | {b} |")
    print()
    for (a, b), n in sorted(counts.items()):
        print(f"- stock {a}, injected {b}: {n}")
    if log:
        print(f"- ds_canzona engines built in the injected run: {injections(log)}")


if __name__ == "__main__":
    main(*sys.argv[1:])
