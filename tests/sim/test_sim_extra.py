"""The server's dependencies are what the server needs: matplotlib and tqdm (plots and a
progress bar) are the ``sim`` extra, loaded only by ``mesh simulate`` / ``mesh sweep``, which
name the fix in one line when the extra is missing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _run(code: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_the_server_and_the_cli_load_no_plotting_or_progress_bar() -> None:
    done = _run(
        "import sys\n"
        "from mesh.cli import build_parser\n"
        "build_parser()\n"
        "import mesh.cli.compose, mesh.cli.simulate, mesh.a2a.app, mesh.engine.pool\n"
        "import mesh.api.dashboard, mesh.api.openai_api, mesh.sim.scenario\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tqdm'))\n"
        "print(','.join(bad[:5]))\n"
        "sys.exit(1 if bad else 0)\n")
    assert done.returncode == 0, f"loaded {done.stdout.strip()}; {done.stderr[-1500:]}"


def test_simulate_without_the_extra_names_the_fix(tmp_path: Path) -> None:
    for command in ("simulate", "sweep"):
        done = _run(
            "import sys\n"
            "sys.modules['matplotlib'] = None  # as if not installed\n"
            "from mesh.cli import main\n"
            f"sys.exit(main([{command!r}, '--model', 'tiny', '--out', {str(tmp_path)!r}]))\n")
        assert done.returncode == 1, done.stderr[-1500:]
        line = done.stderr.strip().splitlines()[-1]
        assert line.startswith(f"mesh {command}: ") and "mesh[sim]" in line, line
        assert "Traceback" not in done.stderr
    assert not list(tmp_path.iterdir()), "nothing was started or written"
