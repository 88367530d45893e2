#!/usr/bin/env bash
# llama.cpp's llama-server for the GPU scenario (bench/gpu_scenario/run.sh), built HERE without
# CUDA and without a GPU, run THERE with CUDA: the binary is linked against llama.cpp's
# shared libraries (BUILD_SHARED_LIBS=ON), and on the device it loads libllama/libggml*
# from the CUDA build of llama-cpp-python that bench/gpu/wheel.sh made (same sdist, same
# llama.cpp commit). ggml picks its backends inside libggml.so (GGML_USE_CUDA is defined
# there, not in the server's own code: common/, tools/server/ and tools/mtmd/ have no
# GGML_USE_* #if), so a server compiled without CUDA runs on the GPU once it loads the CUDA
# libggml. Nothing of CUDA is compiled twice; what travels is the binary and the three
# shared libraries the CUDA wheel lacks (libllama-common, libllama-server-impl, libmtmd:
# the wheel is built with LLAVA_BUILD=OFF), a few MB, beside the wheel's ~40 MB.
#
#   bash bench/gpu/server_build.sh          # ~10 min on 2 cores (JOBS=1: ~20 min)
#   -> .whl/llama_server_bin.tar.xz         # llama-server + lib*.so* (no RPATH)
#
# Then the device run sets LD_LIBRARY_PATH=<unpacked>:<site>/llama_cpp/lib:<cuda libs>
# (bench/gpu_scenario/run.sh does). Checked here with ldd against the CPU llama_cpp in .venv,
# which is the same relink on a CPU: LD_LIBRARY_PATH=...:.venv/.../llama_cpp/lib.
# SERVER_CUDA=1 builds a self-contained CUDA server instead (sm_$CUDA_ARCH, static ggml,
# GGML_CUDA_NO_VMM, cuBLAS from the wheel bench/gpu/wheel.sh downloads; ~35 min on 2
# cores, and its libggml-cuda is compiled a second time): only if the relink fails there.
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
work="${WORK:-/tmp/mesh-gpu-wheel}"
ver="${LLAMA_CPP_PYTHON_VERSION:-0.3.36}"
jobs="${JOBS:-$(nproc)}"
py="${PYTHON:-python3}"
[ -x .venv/bin/python ] && py=.venv/bin/python
mkdir -p "$work" .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude

# The full sdist (bench/gpu/wheel.sh keeps it here too; its slimmed copy has no server).
sdist="$work/full/llama_cpp_python-$ver.tar.gz"
if [ ! -f "$sdist" ]; then
    "$py" -m pip download -q --no-deps --no-binary :all: -d "$work/full" "llama-cpp-python==$ver"
fi
src="$work/server-src/llama_cpp_python-$ver/vendor/llama.cpp"
if [ ! -f "$src/tools/server/server.cpp" ]; then
    rm -rf "$work/server-src" && mkdir -p "$work/server-src"
    tar xzf "$sdist" -C "$work/server-src"
fi

common=(-DCMAKE_BUILD_TYPE=Release -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF
        -DLLAMA_BUILD_UI=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_CURL=OFF -DGGML_NATIVE=OFF)
if [ -n "${SERVER_CUDA:-}" ]; then
    cb="$work/cublas/nvidia/cu13"
    [ -f "$cb/lib/libcublas.so" ] || { echo "run bench/gpu/wheel.sh first (it fetches cuBLAS into $cb)" >&2; exit 2; }
    build="$work/server-build-cuda"
    cmake -S "$src" -B "$build" "${common[@]}" -DBUILD_SHARED_LIBS=OFF -DGGML_CUDA=ON \
        -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" \
        -DCUDA_cublas_LIBRARY="$cb/lib/libcublas.so" -DCUDA_cublasLt_LIBRARY="$cb/lib/libcublasLt.so" \
        -DCMAKE_CUDA_FLAGS="-I$cb/include" -DCMAKE_CXX_FLAGS="-I$cb/include" >"$work/server-build.log" 2>&1
else
    build="$work/server-build"
    # No RPATH: the libraries come from LD_LIBRARY_PATH, so the CUDA wheel's libllama and
    # libggml* are the ones loaded on the device (never this build's CPU ones).
    cmake -S "$src" -B "$build" "${common[@]}" -DBUILD_SHARED_LIBS=ON -DGGML_CUDA=OFF \
        -DGGML_BACKEND_DL=OFF -DCMAKE_SKIP_RPATH=ON >"$work/server-build.log" 2>&1
fi
echo "building llama-server ($jobs jobs); log: $work/server-build.log" >&2
nice -n "${NICE:-10}" cmake --build "$build" --target llama-server -j"$jobs" >>"$work/server-build.log" 2>&1

pkg="$work/server-pkg/llama-server-bin"
rm -rf "$work/server-pkg" && mkdir -p "$pkg"
cp -a "$build/bin/llama-server" "$pkg/"
if [ -z "${SERVER_CUDA:-}" ]; then
    # Only the libraries the CUDA wheel does not ship; libllama/libggml* must come from it.
    for base in libllama-common libllama-server-impl libmtmd; do
        cp -a "$build/bin/$base".so* "$pkg/" 2>/dev/null \
            || find "$build" -name "$base.so*" -exec cp -a {} "$pkg/" \;
    done
fi
strip --strip-unneeded "$pkg"/* 2>/dev/null || true
tar cJf .whl/llama_server_bin.tar.xz -C "$work/server-pkg" llama-server-bin
ls -la "$pkg" .whl/llama_server_bin.tar.xz >&2

# The relink check on this CPU: every library resolves, libllama/libggml from .venv's
# llama_cpp (on the device: from the CUDA wheel), the rest from the package.
venv_lib="$("$py" -c 'import importlib.util, pathlib; s = importlib.util.find_spec("llama_cpp"); print(pathlib.Path(s.origin).parent / "lib")' 2>/dev/null || true)"
if [ -z "${SERVER_CUDA:-}" ] && [ -d "$venv_lib" ]; then
    echo "ldd with LD_LIBRARY_PATH=$pkg:$venv_lib" >&2
    LD_LIBRARY_PATH="$pkg:$venv_lib" ldd "$pkg/llama-server" | tee "$work/server-ldd.txt" >&2
    if grep -q "not found" "$work/server-ldd.txt"; then
        echo "unresolved libraries (above); the package is incomplete" >&2; exit 4
    fi
    LD_LIBRARY_PATH="$pkg:$venv_lib" "$pkg/llama-server" --version >&2
fi
echo "$root/.whl/llama_server_bin.tar.xz"
