"""The DeepSpeed releases ds_canzona was checked against: version facts, below every runtime.

Imported by the engine hook (which releases accept the ``canzona`` section at all), by
``support`` (which accept ZeRO-3 with owner placement) and by nothing else; it imports no
DeepSpeed and no other ds_canzona module at load time, so it can be read while DeepSpeed's
engine module is still being imported.
"""

from __future__ import annotations

import re

# The releases scripts/compat.sh passed on (docs/NOTES.md, "DeepSpeed versions"); setup.py
# declares the same range (tests/test_support.py checks that they agree).
SUPPORTED_DEEPSPEED_VERSIONS = tuple(f"0.19.{patch}" for patch in range(9))

# The releases whose ZeRO-3 closures, DeepSpeedZeRoOffload and coordinator
# ds_canzona.zero.owner_placement and ds_canzona.zero.stage3 were read against and tested with:
# every release the hook accepts, each passing `COMPAT_SUBSET=stage3 scripts/compat.sh`
# (docs/NOTES.md, "DeepSpeed versions"). A release added to SUPPORTED_DEEPSPEED_VERSIONS needs that
# run too, or a list of its own here. (scripts/compat.sh rewrites this line in its snapshot.)
STAGE3_DEEPSPEED_VERSIONS = SUPPORTED_DEEPSPEED_VERSIONS


def _release(version: str) -> str | None:
    """``major.minor.patch`` of a version string (local suffixes such as "+abc123" dropped)."""
    match = re.match(r"\d+\.\d+\.\d+", version)
    return None if match is None else match.group(0)


def deepspeed_version_supported(version: str) -> bool:
    """Whether ``version`` is one ds_canzona was tested with."""
    return _release(version) in SUPPORTED_DEEPSPEED_VERSIONS


def check_deepspeed_version(version: str) -> None:
    """Refuse the ``canzona`` section on a DeepSpeed release outside SUPPORTED_DEEPSPEED_VERSIONS."""
    from ds_canzona.config import CanzonaConfigError

    if not deepspeed_version_supported(version):
        raise CanzonaConfigError(
            f"the 'canzona' section needs DeepSpeed {SUPPORTED_DEEPSPEED_VERSIONS[0]} to "
            f"{SUPPORTED_DEEPSPEED_VERSIONS[-1]} (tested: {', '.join(SUPPORTED_DEEPSPEED_VERSIONS)}), found "
            f"{version}: install one of them (pip install 'deepspeed>={SUPPORTED_DEEPSPEED_VERSIONS[0]},"
            f"<={SUPPORTED_DEEPSPEED_VERSIONS[-1]}') or remove the 'canzona' section")


def check_stage3_version(version: str) -> None:
    """Refuse stage 3 on a DeepSpeed release the owner layout was not checked against."""
    from ds_canzona.config import CanzonaConfigError

    if _release(version) not in STAGE3_DEEPSPEED_VERSIONS:
        raise CanzonaConfigError(
            f"zero_optimization.stage 3 with the 'canzona' section needs DeepSpeed {', '.join(STAGE3_DEEPSPEED_VERSIONS)} "
            f"(the ZeRO-3 internals it patches were checked there), found {version}: install "
            f"deepspeed=={STAGE3_DEEPSPEED_VERSIONS[-1]}, or use stage 1 or 2")


__all__ = ["STAGE3_DEEPSPEED_VERSIONS", "SUPPORTED_DEEPSPEED_VERSIONS", "check_deepspeed_version",
           "check_stage3_version", "deepspeed_version_supported"]
