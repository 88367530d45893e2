#!/usr/bin/env bash
# Build llama-cpp-python 0.3.36 with CUDA (sm_90, Hopper) HERE, on a machine with nvcc but
# no GPU, into .whl/ for bench/gpu/check.sh: the device call then spends none of its minutes
# compiling. ~40 minutes on 2 cores; needs nvcc (CUDA 13) and ~1 GB of disk.
#
# cuBLAS is not in the CUDA toolkit here: its headers and libraries come from the
# nvidia-cublas wheel (linked against, not carried; the device has its own). libcuda.so is
# not here either, so the build uses GGML_CUDA_NO_VMM (the legacy memory pool). The sdist is
# slimmed (models, docs, tests, other backends) to fit the 64 MiB a device call carries,
# should the wheel be missing and the build have to run there.
set -euo pipefail
cd "$(dirname "$0")/.."
work="${WORK:-/tmp/mesh-gpu-wheel}"
arch="${CUDA_ARCH:-90}"
mkdir -p "$work" .whl
grep -qx '/.whl/' .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude

if [ ! -f "$work/llama_cpp_python-0.3.36.tar.gz" ]; then
    python3 -m pip download -q --no-deps --no-binary :all: -d "$work/full" llama-cpp-python==0.3.36
    rm -rf "$work/src" && mkdir -p "$work/src"
    tar xzf "$work/full/llama_cpp_python-0.3.36.tar.gz" -C "$work/src"
    v="$work/src/llama_cpp_python-0.3.36/vendor/llama.cpp"
    rm -rf "$work/src/llama_cpp_python-0.3.36/.git" "$v/.git" "$v/models" "$v/docs" \
        "$v/benches" "$v/tests" "$v/examples" "$v/pocs" "$v/scripts" "$v/conversion"
    find "$v/tools" -mindepth 1 -maxdepth 1 ! -name mtmd -exec rm -rf {} +
    rm -f "$v"/tools/mtmd/test-*
    for b in openvino webgpu et metal hexagon sycl vulkan opencl cann musa zdnn virtgpu; do
        rm -rf "$v/ggml/src/ggml-$b"
    done
    tar czf "$work/llama_cpp_python-0.3.36.tar.gz" -C "$work/src" llama_cpp_python-0.3.36
fi

cb="$work/cublas/nvidia/cu13"
if [ ! -f "$cb/lib/libcublas.so" ]; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 \
        -d "$work/cublas-whl" "nvidia-cublas>=13,<14"
    mkdir -p "$work/cublas" && (cd "$work/cublas" && unzip -q -o "$work"/cublas-whl/*.whl)
    ln -sf libcublas.so.13 "$cb/lib/libcublas.so"
    ln -sf libcublasLt.so.13 "$cb/lib/libcublasLt.so"
fi

echo "building the CUDA wheel (sm_$arch); progress: grep -c '\\[' $work/build.log" >&2
CMAKE_ARGS="-DGGML_CUDA=on -DGGML_CUDA_NO_VMM=ON -DCMAKE_CUDA_ARCHITECTURES=$arch \
-DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON \
-DGGML_F16C=ON -DGGML_BMI2=ON -DCUDA_cublas_LIBRARY=$cb/lib/libcublas.so \
-DCUDA_cublasLt_LIBRARY=$cb/lib/libcublasLt.so -DCMAKE_CUDA_FLAGS=-I$cb/include \
-DCMAKE_CXX_FLAGS=-I$cb/include" \
CMAKE_BUILD_PARALLEL_LEVEL="$(nproc)" \
    python3 -m pip wheel --no-deps -v -w "$work/out" "$work/llama_cpp_python-0.3.36.tar.gz" \
    >"$work/build.log" 2>&1
# The wheel holds each library 8 times (wheels have no symlinks: 263 MB); what travels is
# the installed package with each library once and its symlinks, xz-compressed (~40 MB).
rm -rf "$work/site" && mkdir -p "$work/site"
(cd "$work/site" && unzip -q "$work"/out/llama_cpp_python-0.3.36-*.whl 'llama_cpp/*' 'include/*' \
    'llama_cpp_python-0.3.36.dist-info/*')  # the metadata: benches read its version
rm -rf "$work/site/llama_cpp/server"
(cd "$work/site/llama_cpp/lib" && for base in libllama libggml libggml-base libggml-cpu libggml-cuda; do
    real="$(ls "$base".so.0.* | head -1)"
    rm -f "$base.so" "$base.so.0" && ln -s "$real" "$base.so.0" && ln -s "$base.so.0" "$base.so"
done)
tar cJf .whl/llama_cpp_cuda_site.tar.xz -C "$work/site" llama_cpp include \
    llama_cpp_python-0.3.36.dist-info
rm -f .whl/llama_cpp_python-0.3.36.tar.gz  # the sdist would not fit beside it in one call
ls -la .whl/
