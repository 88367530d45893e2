"""The shared-prefix attention kernel's own exactness test (issue 32), against the venv's
llama.cpp.

``native/patches/test_shared_prefix_attn.cpp`` builds one flash-attention node the way the
unified KV cache does and compares the old kernel, the shared path and a double-precision
reference over 24 cases (heads 9/3 and 32/8; 1, 2, 8, 32 rows; prefixes 0, 300, 2048); it
exits 0 and prints ``OK`` when every case is within tolerance, the path ran exactly where it
should (prefix >= 256 cells and >= 2 rows) and nothing was written past the planned work
buffer. This test compiles it with g++ against the headers and libraries the venv carries
(``site-packages/include``; ``site-packages/llama_cpp/lib``, which ``scripts/install.sh``
patches) and runs it with 2 threads and 1 repetition: about 1 s to compile and 2 s to run on
the dev machine; the subprocess timeouts keep a stuck build or run under 30 s each.
"""

from __future__ import annotations

import importlib.util
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SOURCE = ROOT / "native" / "patches" / "test_shared_prefix_attn.cpp"
SYMBOL = b"ggml_cpu_shared_prefix_attn_version"
COMPILE_TIMEOUT_S = 30
RUN_TIMEOUT_S = 30
CASES = 24  # 2 geometries x 4 row counts x 3 prefix lengths
SHARED_CASES = 12  # prefix 300 or 2048 cells, 2, 8 or 32 rows
# one result row: "heads N P T | 3 errors | 3 timings | path[  (canary)][  <-- FAIL]"
ROW = re.compile(r"^\s*\d+/\d+\s+(\d+)\s+(\d+)\s+\d+\s+\|.*\|\s*(shared|old)(.*)$")


def venv_ggml() -> tuple[Path, Path]:
    """The (include, lib) directories of the installed llama-cpp-python, found without
    loading it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama_cpp is not installed in this interpreter")
    package = Path(spec.origin).parent
    return package.parent / "include", package / "lib"


def patched(lib: Path) -> bool:
    """Whether ``lib``'s libggml-cpu exports the patch's symbol (its dynamic string table
    names it; read as bytes, so no second copy of the library is loaded)."""
    return any(SYMBOL in p.read_bytes() for p in lib.glob("libggml-cpu.so*") if p.is_file())


def test_the_kernel_test_passes_against_the_venvs_llama_cpp(tmp_path: Path) -> None:
    gxx = shutil.which("g++")
    if gxx is None:
        pytest.skip("no g++ to compile native/patches/test_shared_prefix_attn.cpp")
    include, lib = venv_ggml()
    if not (include / "ggml-cpu.h").is_file():
        pytest.skip(f"{include} has no ggml-cpu.h (llama-cpp-python installed without headers)")
    if not patched(lib):
        pytest.skip(f"{lib}/libggml-cpu lacks mesh's shared-prefix attention patch; install "
                    "it with scripts/install.sh (native/patches/install_patch.sh)")
    exe = tmp_path / "test_shared_prefix_attn"
    build = subprocess.run(
        [gxx, "-O2", "-std=c++17", f"-I{include}", str(SOURCE), f"-L{lib}", "-lggml-base",
         "-lggml-cpu", f"-Wl,-rpath,{lib}", "-o", str(exe)],
        capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
    assert build.returncode == 0, build.stderr[-4000:]
    run = subprocess.run([str(exe), "--threads", "2", "--reps", "1"],
                         capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    out = run.stdout
    assert run.returncode == 0, out[-4000:] + run.stderr[-2000:]
    lines = out.strip().splitlines()
    assert lines[0].startswith("ggml_cpu_shared_prefix_attn_version() = 1,"), lines[0]
    assert lines[-1] == "OK", out[-4000:]
    rows = [m for m in map(ROW.match, lines) if m]
    assert len(rows) == CASES, out
    assert not [m.group(0) for m in rows if m.group(4).strip()], out  # no FAIL, canary kept
    shared = {(int(m.group(1)), int(m.group(2))) for m in rows if m.group(3) == "shared"}
    assert len([m for m in rows if m.group(3) == "shared"]) == SHARED_CASES
    assert shared == {(n, p) for n in (2, 8, 32) for p in (300, 2048)}
