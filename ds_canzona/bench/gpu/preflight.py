"""Is ``gpu_wheels/`` what the GPU device needs? Checked here before device time is spent, and there first.

The device's image has torch, Triton and transformers but not DeepSpeed, hjson or pydantic, and
no network: scripts/gpu_wheels.sh prepares their wheels, the device call carries the folder, and
scripts/gpu_session.sh installs them. A session gets one try, so a folder that cannot work must
be refused before the call, not found out on the device. This module says why a folder would fail:

* no folder, or no wheel in it;
* a wheel whose tags the target Python cannot install (say a cp311 build for the device's 3.12,
  or a manylinux glibc newer than the device's), or whose ``Requires-Python`` excludes it;
* two versions of one distribution (pip refuses the whole install);
* a module the session needs (``NEEDED``) that neither a wheel nor the target provides;
* a requirement of a carried wheel (its ``Requires-Dist``, extras left out) that no carried wheel
  meets, or meets at another version (pydantic pins pydantic-core exactly), and, on the device
  itself (``--here``), that the image does not meet either;
* more bytes than the device call carries (64 MiB for the whole working tree; the folder may take
  ``LIMIT_BYTES``);
* ``COMMIT`` missing, or written by another version of scripts/gpu_wheels.sh (the recipe that
  chose the wheels changed since: prepare them again).

It imports nothing beyond the standard library (``packaging``, where present, evaluates markers
and version specifiers), and runs as a file: ``python ds_canzona/bench/gpu/preflight.py``, which
the session does on the device before DeepSpeed can be imported. Exit status 0 when the folder
would work, 1 otherwise, 2 for bad arguments.

    python ds_canzona/bench/gpu/preflight.py --wheels gpu_wheels --python 3.12   # here, for the device
    python ds_canzona/bench/gpu/preflight.py --wheels gpu_wheels --here          # on the device
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.metadata as metadata
import importlib.util
import json
import platform
import re
import sys
import zipfile
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

__all__ = ["NEEDED", "Report", "WheelName", "check_wheels", "recipe_digest", "source_digest"]

# The modules the session's engine phase imports that the device image lacks, and their distributions.
NEEDED = {"deepspeed": "deepspeed", "hjson": "hjson", "pydantic": "pydantic"}
LIMIT_BYTES = 32 * 2**20  # of the 64 MiB a device call carries: the tree and the results need the rest
RECIPE = "scripts/gpu_wheels.sh"
SOURCE_FOLDERS = ("ds_canzona", "kernels", "scripts")
SOURCE_SUFFIXES = (".py", ".sh", ".json")


def _normalise(name: str) -> str:
    """A distribution name as wheels and metadata compare it (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@dataclass(frozen=True)
class WheelName:
    """The parts of a wheel's file name (PEP 427): ``dist-version(-build)?-python-abi-platform.whl``."""

    distribution: str
    version: str
    python: tuple[str, ...]
    abi: tuple[str, ...]
    platform: tuple[str, ...]

    @classmethod
    def parse(cls, filename: str) -> WheelName | None:
        parts = filename[: -len(".whl")].split("-") if filename.endswith(".whl") else []
        if len(parts) not in (5, 6):
            return None
        return cls(_normalise(parts[0]), parts[1], *(tuple(p.split(".")) for p in parts[-3:]))

    def incompatibility(self, python: tuple[int, int], glibc: tuple[int, int] | None) -> str | None:
        """Why CPython ``python`` on x86-64 Linux (glibc ``glibc`` when known) cannot take it, or None."""
        major, minor = python
        own = f"cp{major}{minor}"
        abi3 = {f"cp{major}{m}" for m in range(minor + 1)}  # abi3 builds for this minor or an older one
        if not any(tag in (f"py{major}", f"py{major}{minor}", own) or tag in abi3 for tag in self.python):
            return f"python tag {'.'.join(self.python)} (not for CPython {major}.{minor})"
        if not any(tag in ("none", own) or (tag == "abi3" and abi3.intersection(self.python)) for tag in self.abi):
            return f"abi tag {'.'.join(self.abi)} (not CPython {major}.{minor}'s)"
        for tag in self.platform:
            if tag in ("any", "linux_x86_64"):
                return None
            legacy = {"manylinux1_x86_64": (2, 5), "manylinux2010_x86_64": (2, 12), "manylinux2014_x86_64": (2, 17)}
            if tag in legacy:
                needs = legacy[tag]
            elif m := re.fullmatch(r"manylinux_(\d+)_(\d+)_x86_64", tag):
                needs = (int(m[1]), int(m[2]))
            else:
                continue
            if glibc is None or needs <= glibc:
                return None
        where = "" if glibc is None else f" with glibc {glibc[0]}.{glibc[1]}"
        return f"platform tag {'.'.join(self.platform)} (not x86-64 Linux{where})"


@dataclass
class Report:
    """What ``check_wheels`` found: ``problems`` make the folder fail; ``notes`` are for the log."""

    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    wheels: list[str] = field(default_factory=list)
    total_bytes: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems

    def text(self) -> str:
        lines = [f"gpu_wheels: {len(self.wheels)} wheels, {self.total_bytes / 2**20:.1f} MiB"]
        lines += [f"  note: {n}" for n in self.notes]
        lines += [f"  PROBLEM: {p}" for p in self.problems]
        lines.append("preflight: the wheels would work" if self.ok else
                     "preflight: FAILED (prepare the folder with `bash scripts/gpu_wheels.sh`)")
        return "\n".join(lines)


def _metadata(wheel: Path) -> tuple[list[str], str | None]:
    """The wheel's ``Requires-Dist`` lines and ``Requires-Python``, read from its METADATA."""
    with zipfile.ZipFile(wheel) as archive:
        name = next((n for n in archive.namelist() if n.endswith(".dist-info/METADATA") and n.count("/") == 1), None)
        if name is None:
            raise ValueError("no .dist-info/METADATA")
        text = archive.read(name).decode("utf-8", "replace")
    header = text.split("\n\n", 1)[0]
    requires = [line.split(":", 1)[1].strip() for line in header.splitlines() if line.startswith("Requires-Dist:")]
    python = next((line.split(":", 1)[1].strip() for line in header.splitlines()
                   if line.startswith("Requires-Python:")), None)
    return requires, python


def _packaging():
    try:
        from packaging.markers import Marker
        from packaging.requirements import Requirement
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version
    except ImportError:
        return None
    return Marker, Requirement, SpecifierSet, Version


def _requirement(line: str, python: tuple[int, int]) -> tuple[str, str] | None:
    """(distribution, specifier) of one ``Requires-Dist`` that applies on CPython ``python`` Linux, else None."""
    requirement, _, marker = line.partition(";")
    if "extra" in marker:
        return None  # an optional feature's: not installed by a plain install
    tools = _packaging()
    if marker.strip() and tools is not None:
        env = {"python_version": f"{python[0]}.{python[1]}", "python_full_version": f"{python[0]}.{python[1]}.0",
               "sys_platform": "linux", "platform_system": "Linux", "os_name": "posix",
               "platform_machine": "x86_64", "implementation_name": "cpython",
               "platform_python_implementation": "CPython", "extra": ""}
        if not tools[0](marker.strip()).evaluate(env):
            return None
    m = re.match(r"\s*([A-Za-z0-9][A-Za-z0-9._-]*)\s*(\[[^\]]*\])?\s*\(?([^)]*)\)?", requirement)
    if m is None:
        return None
    return _normalise(m[1]), m[3].strip()


def _satisfies(version: str, specifier: str) -> bool | None:
    """Whether ``version`` meets ``specifier``; None when that cannot be told (no ``packaging``)."""
    if not specifier:
        return True
    tools = _packaging()
    if tools is None:
        return None
    _, _, SpecifierSet, Version = tools
    try:
        return SpecifierSet(specifier).contains(Version(version), prereleases=True)
    except Exception:
        return None


def _installed_here(distribution: str) -> str | None:
    try:
        return metadata.version(distribution)
    except metadata.PackageNotFoundError:
        return None


def _module_here(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _digest(paths: Iterable[Path], root: Path) -> str:
    """sha256 over (relative path, content sha256) of ``paths``, sorted: 16 hex digits."""
    total = hashlib.sha256()
    for path in sorted(paths, key=lambda p: p.relative_to(root).as_posix()):
        total.update(path.relative_to(root).as_posix().encode() + b"\0")
        total.update(hashlib.sha256(path.read_bytes()).digest())
    return total.hexdigest()[:16]


def source_digest(repo: Path) -> str:
    """The checkout's sources (``SOURCE_FOLDERS``' .py, .sh and .json files): names the code without git."""
    paths = [p for folder in SOURCE_FOLDERS for p in (repo / folder).rglob("*")
             if p.is_file() and p.suffix in SOURCE_SUFFIXES and "__pycache__" not in p.parts]
    return _digest(paths, repo)


def recipe_digest(repo: Path) -> str:
    """scripts/gpu_wheels.sh's: the recipe that chose the wheels."""
    return _digest([repo / RECIPE], repo)


def read_commit_file(folder: Path) -> dict[str, str]:
    """``gpu_wheels/COMMIT``: ``key value`` lines (commit, source-digest, recipe-digest)."""
    entries = {}
    for line in (folder / "COMMIT").read_text(encoding="utf-8").splitlines():
        key, _, value = line.partition(" ")
        if key:
            entries[key] = value.strip()
    return entries


def check_wheels(
    folder: Path,
    *,
    python: tuple[int, int],
    glibc: tuple[int, int] | None = None,
    installed: Callable[[str], str | None] | None = None,
    module_present: Callable[[str], bool] | None = None,
    repo: Path | None = None,
    limit_bytes: int = LIMIT_BYTES,
    needed: dict[str, str] = NEEDED,
) -> Report:
    """Would ``folder``'s wheels give CPython ``python`` every module in ``needed``?

    ``installed(distribution)``: the version the target already has, or None; ``module_present``:
    whether the target imports a module already. Both None (checking here for another machine):
    every needed module must come from a wheel, and a requirement no wheel meets is a note (the
    device image is expected to hold it), not a problem. ``repo``: the checkout, for the recipe
    digest in ``COMMIT``.
    """
    report = Report()
    wheels = sorted(folder.glob("*.whl")) if folder.is_dir() else []
    if not wheels:
        report.problems.append(f"no wheels in {folder}" + ("" if folder.is_dir() else " (no such folder)"))
        return report
    report.wheels = [w.name for w in wheels]
    report.total_bytes = sum(w.stat().st_size for w in wheels)
    if report.total_bytes > limit_bytes:
        report.problems.append(f"{report.total_bytes / 2**20:.1f} MiB of wheels, more than the "
                               f"{limit_bytes / 2**20:.0f} MiB the device call can spare")
    carried: dict[str, tuple[WheelName, Path]] = {}
    for wheel in wheels:
        name = WheelName.parse(wheel.name)
        if name is None:
            report.problems.append(f"{wheel.name}: not a wheel file name")
            continue
        if name.distribution in carried:
            report.problems.append(f"two versions of {name.distribution}: {carried[name.distribution][1].name} and "
                                   f"{wheel.name} (pip refuses the install)")
            continue
        carried[name.distribution] = (name, wheel)
        if (why := name.incompatibility(python, glibc)) is not None:
            report.problems.append(f"{wheel.name}: {why}")

    for module, distribution in needed.items():
        if _normalise(distribution) in carried:
            continue
        if module_present is not None and module_present(module):
            report.notes.append(f"{module}: already importable there, no wheel needed")
            continue
        report.problems.append(f"no wheel provides {module} (distribution {distribution})")

    expected: dict[str, list[str]] = {}  # requirements left to the target, when it cannot be asked
    for distribution, (name, wheel) in sorted(carried.items()):
        try:
            requires, requires_python = _metadata(wheel)
        except (OSError, ValueError, zipfile.BadZipFile) as error:
            report.problems.append(f"{wheel.name}: unreadable ({error})")
            continue
        if requires_python and _satisfies(f"{python[0]}.{python[1]}.0", requires_python) is False:
            report.problems.append(f"{wheel.name}: Requires-Python {requires_python} excludes {python[0]}.{python[1]}")
        for line in requires:
            parsed = _requirement(line, python)
            if parsed is None:
                continue
            wanted, specifier = parsed
            if wanted in carried:
                if _satisfies(carried[wanted][0].version, specifier) is False:
                    report.problems.append(f"{distribution} needs {wanted}{specifier}, the carried wheel is "
                                           f"{carried[wanted][1].name}")
                continue
            if installed is None:
                expected.setdefault(distribution, []).append(wanted + specifier)
                continue
            have = installed(wanted)
            if have is None:
                report.problems.append(f"{distribution} needs {wanted}{specifier}: neither carried nor installed")
            elif _satisfies(have, specifier) is False:
                report.problems.append(f"{distribution} needs {wanted}{specifier}: {have} is installed, no wheel carried")

    for distribution, wanted in expected.items():
        report.notes.append(f"{distribution} also needs {', '.join(wanted)}: expected on the target (the device "
                            f"image has them), checked there by --here")
    if repo is not None:
        try:
            entries = read_commit_file(folder)
        except OSError:
            report.problems.append(f"no {folder.name}/COMMIT (scripts/gpu_wheels.sh writes it)")
        else:
            report.notes.append(f"prepared at commit {entries.get('commit', '?')}, source digest "
                                f"{entries.get('source-digest', '?')} (this tree: {source_digest(repo)})")
            if entries.get("recipe-digest") != recipe_digest(repo):
                report.problems.append(f"{folder.name}/COMMIT names recipe {entries.get('recipe-digest', 'none')}, "
                                       f"but {RECIPE} is now {recipe_digest(repo)}: the recipe changed")
    return report


def _version_pair(text: str) -> tuple[int, int]:
    major, minor, *_ = (int(part) for part in text.split("."))
    return major, minor


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="preflight.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--wheels", type=Path, default=None, help="the folder (default: gpu_wheels in the checkout)")
    target = parser.add_mutually_exclusive_group()
    target.add_argument("--python", default="3.12", help="the target CPython, MAJOR.MINOR (default 3.12, the device's)")
    target.add_argument("--here", action="store_true",
                        help="the target is this interpreter: its version, glibc and installed packages")
    parser.add_argument("--glibc", default=None, help="the target's glibc, MAJOR.MINOR (default: unknown, unless --here)")
    parser.add_argument("--json", type=Path, default=None, help="also write the report as JSON")
    parser.add_argument("--digests", action="store_true", help="print this checkout's source and recipe digests "
                        "as COMMIT lines, and stop")
    args = parser.parse_args(argv)
    repo = Path(__file__).resolve().parents[3]
    if args.digests:
        print(f"source-digest {source_digest(repo)}\nrecipe-digest {recipe_digest(repo)}")
        return 0
    folder = args.wheels if args.wheels is not None else repo / "gpu_wheels"
    if args.here:
        python = sys.version_info[:2]
        libc, version = platform.libc_ver()
        glibc = _version_pair(version) if libc == "glibc" and version else None
        report = check_wheels(folder, python=python, glibc=glibc, installed=_installed_here,
                              module_present=_module_here, repo=repo)
    else:
        try:
            python = _version_pair(args.python)
            glibc = _version_pair(args.glibc) if args.glibc else None
        except ValueError:
            parser.error("--python and --glibc take MAJOR.MINOR")
        report = check_wheels(folder, python=python, glibc=glibc, repo=repo)
    print(f"preflight: {folder} for CPython {python[0]}.{python[1]}"
          + (f", glibc {glibc[0]}.{glibc[1]}" if glibc else "") + (" (this interpreter)" if args.here else ""))
    print(report.text(), flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps({"ok": report.ok, "problems": report.problems, "notes": report.notes,
                                         "wheels": report.wheels, "total_bytes": report.total_bytes}, indent=1))
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
