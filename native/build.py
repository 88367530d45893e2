"""Build ``native/build/libmesh_native.so`` against the llama.cpp that llama-cpp-python ships.

    .venv/bin/python -m native.build        # scripts/install.sh runs this

The headers (``site-packages/include/llama.h``) and the library
(``site-packages/llama_cpp/lib/libllama.so``) are found from the installed ``llama_cpp``
package, so the extension talks to the same library the ctypes bindings load. A JSON stamp
next to the library records the llama-cpp-python version it was built for; the loader
(:mod:`mesh.engine.native`) refuses a stale build. Exit status 1 (and one line saying why)
when the build is not possible: mesh then runs the pure-Python step.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "mesh_native.c"
OUT_DIR = HERE / "build"
LIB_NAME = "libmesh_native.so"
STAMP_NAME = "libmesh_native.json"


def llama_paths() -> tuple[Path, Path]:
    """(include dir, lib dir) of the installed llama-cpp-python, without importing it."""
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        raise RuntimeError("llama-cpp-python is not installed in this Python")
    pkg = Path(spec.origin).resolve().parent
    candidates = [pkg.parent / "include", pkg / "include"]
    inc = next((c for c in candidates if (c / "llama.h").is_file()), None)
    if inc is None:
        raise RuntimeError(f"llama.h not found next to {pkg} (looked in "
                           f"{', '.join(str(c) for c in candidates)})")
    lib = pkg / "lib"
    if not (lib / "libllama.so").exists():
        raise RuntimeError(f"libllama.so not found in {lib}")
    return inc, lib


def build(out_dir: Path = OUT_DIR, cc: str | None = None) -> Path:
    """Compile the extension; returns the library's path. Raises RuntimeError with the
    compiler's message on failure."""
    compiler = cc or os.environ.get("CC") or "cc"
    if shutil.which(compiler) is None:
        raise RuntimeError(f"no C compiler ({compiler!r}) on PATH; install gcc or set CC")
    inc, lib = llama_paths()
    out_dir.mkdir(parents=True, exist_ok=True)
    target = out_dir / LIB_NAME
    tmp = out_dir / (LIB_NAME + ".tmp")
    cmd = [compiler, "-O3", "-std=c11", "-fPIC", "-shared", "-pthread", "-Wall", "-Wextra",
           f"-I{inc}", str(SOURCE), "-o", str(tmp), f"-L{lib}", "-lllama",
           f"-Wl,-rpath,{lib}"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        errors = [ln for ln in proc.stderr.splitlines() if "error" in ln] or ["no message"]
        raise RuntimeError(f"the C compiler failed: {errors[0].strip()}\n"
                           f"{' '.join(cmd)}\n{proc.stderr.strip()}")
    os.replace(tmp, target)
    stamp = {"llama_cpp_python": importlib.metadata.version("llama_cpp_python"),
             "include": str(inc), "lib": str(lib)}
    (out_dir / STAMP_NAME).write_text(json.dumps(stamp, indent=1) + "\n")
    return target


def main() -> int:
    try:
        path = build()
    except RuntimeError as exc:
        first = str(exc).splitlines()[0]
        print(f"mesh native step: not built ({first}); mesh will use the Python step",
              file=sys.stderr)
        if len(str(exc).splitlines()) > 1:
            print(str(exc), file=sys.stderr)
        return 1
    print(f"mesh native step: built {path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
