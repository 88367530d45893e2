"""Building mesh prints no setuptools warnings, and the wheel ships its data folders.

The first install used to print screens of warnings (``project.license`` as a table; the
template folders "would be ignored" as packages absent from the configuration). This builds
the wheel the way ``pip install`` does (an isolated build backend) from a copy of the
package's sources, so the check cannot leave a ``build/`` folder in the checkout.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ("pyproject.toml", "README.md", "LICENSE", "mesh", "templates")


def _copy_sources(dest: Path) -> Path:
    src = dest / "src"
    src.mkdir()
    skip = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in SOURCES:
        path = ROOT / name
        if path.is_dir():
            # symlinks=True: mesh/template/builtin stays a link to templates/, as in git.
            shutil.copytree(path, src / name, symlinks=True, ignore=skip)
        else:
            shutil.copy2(path, src / name)
    return src


def _warnings(log: str) -> list[str]:
    """Lines of the build's output that warn, except pip's own notes about index
    locations configured on this machine (``WARNING: Location '...' is ignored``)."""
    return [line for line in log.splitlines()
            if "warning" in line.lower() and not line.startswith("WARNING: Location ")]


@pytest.mark.slow
def test_wheel_builds_cleanly_and_ships_the_data(tmp_path: Path) -> None:
    src = _copy_sources(tmp_path)
    out = tmp_path / "wheel"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check",
         "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=600, check=False,
    )
    log = done.stdout + done.stderr
    assert done.returncode == 0, log
    assert _warnings(log) == [], log
    (wheel,) = out.glob("mesh-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    templates = {str(p.relative_to(ROOT / "templates")) for p in (ROOT / "templates").rglob("*")
                 if p.is_file() and "__pycache__" not in p.parts}
    assert {f"mesh/template/builtin/{t}" for t in templates} <= names
    assert {f"mesh/api/static/{p.name}" for p in (ROOT / "mesh/api/static").iterdir()} <= names
    assert any(n.endswith(".dist-info/licenses/LICENSE") for n in names)
    assert not [n for n in names if "__pycache__" in n or n.endswith(".pyc")]
    assert not [n for n in names if n.split("/")[0] in ("tests", "bench", "native")]
