"""A results file that is whole at every moment: rewritten after each row, replaced atomically.

The GPU session runs each phase under a time limit; a phase killed at its limit must leave the
rows it finished, readable. ``JsonRecord`` writes the payload (``header`` plus ``rows``, and
``"complete": false``) after every ``add`` to a temporary file beside the target and renames it
over the target (``os.replace``: readers see the old file or the new one, never half of one);
``finish`` writes the last version with ``"complete": true``.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["JsonRecord", "write_json_atomically"]


def write_json_atomically(path: Path, payload: Mapping[str, Any]) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(json.dumps(payload, indent=1, default=str), encoding="utf-8")
    os.replace(partial, path)
    return path


class JsonRecord:
    """``header`` and the rows so far at ``path``, rewritten after every row."""

    def __init__(self, path: Path, header: Mapping[str, Any] | None = None) -> None:
        self.path = Path(path)
        self.header: dict[str, Any] = dict(header or {})
        self.rows: list[dict[str, Any]] = []
        self._write(complete=False)

    def add(self, row: dict[str, Any]) -> None:
        self.rows.append(row)
        self._write(complete=False)

    def extend(self, rows: list[dict[str, Any]]) -> None:
        self.rows.extend(rows)
        self._write(complete=False)

    def finish(self, **extra: Any) -> Path:
        self.header.update(extra)
        return self._write(complete=True)

    def _write(self, *, complete: bool) -> Path:
        return write_json_atomically(self.path, {**self.header, "rows": self.rows, "complete": complete})
