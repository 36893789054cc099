#!/usr/bin/env python3
"""Add to a wheelhouse the wheels another patch release of this Python would need.

``pip wheel`` resolves dependency markers for the interpreter that runs it. An image's python3
can be an older patch release (Debian bookworm ships 3.11.2), and some markers test the full
version: redis needs ``async-timeout; python_full_version < "3.11.3"``. ``pip download
--python-version`` does not help (pip evaluates ``python_full_version`` against the running
interpreter). This walks the wheels' ``Requires-Dist`` from ROOT, evaluates each marker for
``--python-full-version`` (default X.Y.0), and downloads any missing wheel with ``--no-deps``
until the set is closed.

    python complete_wheelhouse.py WHEELHOUSE ROOT [--python-full-version 3.11.0]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

try:
    from packaging.markers import default_environment
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name, parse_wheel_filename
except ImportError:  # a bare interpreter: pip vendors the same library
    from pip._vendor.packaging.markers import default_environment  # type: ignore[no-redef]
    from pip._vendor.packaging.requirements import Requirement  # type: ignore[no-redef]
    from pip._vendor.packaging.utils import canonicalize_name, parse_wheel_filename  # type: ignore[no-redef]


def wheels(house: Path) -> dict[str, Path]:
    return {canonicalize_name(parse_wheel_filename(w.name)[0]): w for w in house.glob("*.whl")}


def requires(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as z:
        meta = next(n for n in z.namelist() if n.endswith(".dist-info/METADATA"))
        return Parser().parsestr(z.read(meta).decode()).get_all("Requires-Dist") or []


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("wheelhouse", type=Path)
    ap.add_argument("root", help="distribution name whose closure the wheelhouse must hold")
    major, minor = sys.version_info[:2]
    ap.add_argument("--python-full-version", default=f"{major}.{minor}.0")
    args = ap.parse_args()
    env = dict(default_environment())
    env["python_full_version"] = args.python_full_version
    wanted: dict[str, set[str]] = {canonicalize_name(args.root): set()}
    pins: dict[str, str] = {}
    while True:
        have = wheels(args.wheelhouse)
        missing = sorted(n for n in wanted if n not in have)
        if missing:
            cmd = [sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                   "--no-deps", "--only-binary=:all:", "-d", str(args.wheelhouse), *(pins[n] for n in missing)]
            print("adding for python " + args.python_full_version + ": " + ", ".join(pins[n] for n in missing),
                  file=sys.stderr)
            subprocess.run(cmd, check=True)
            continue
        before = {n: set(e) for n, e in wanted.items()}
        for name, extras in before.items():
            for line in requires(have[name]):
                req = Requirement(line)
                if req.marker is None or any(req.marker.evaluate({**env, "extra": e}) for e in extras | {""}):
                    dep = canonicalize_name(req.name)
                    wanted.setdefault(dep, set()).update(req.extras)
                    pins.setdefault(dep, f"{req.name}{req.specifier}")
        if wanted == before:
            return 0


if __name__ == "__main__":
    sys.exit(main())
