#!/usr/bin/env bash
# Build llama.cpp's CUDA llama-server and llama-batched-bench on a machine without a GPU, for a
# GPU machine that has the NVIDIA driver and CUDA 13's runtime and cuBLAS (the lent H100/H200
# machines): the build there takes ~340 s of scarce device time, here ~45 minutes of 2 cores.
# Needs nvcc (CUDA 13) at $CUDA_HOME; cuBLAS's headers and libraries come from PyPI's
# nvidia-cublas wheel when the toolkit lacks them, copied into the toolkit (so this wants write
# access to it), and the link takes a stub of the driver's libcuda.so.1 holding the driver
# functions ggml-cuda calls (the real driver supplies them where it runs). The CPU code is built
# for any x86-64 host with AVX2 (GGML_NATIVE off: this machine's AVX-512 would fault elsewhere).
#   LLAMA_CPP_SOURCE=/tmp/llama.cpp LLAMA_CPP_PREFIX=/tmp/llama-cuda bash scripts/llama-cpp-cuda-cross.sh
# Writes $LLAMA_CPP_PREFIX/bin and VERSION as scripts/llama-cpp-cuda.sh does (its version lines
# need the driver, so they are written where the binaries first run: see
# benchmarks/results/gpu/README-2026-12-06.md, "Fifth session").
set -euo pipefail
root="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cuda_home="${CUDA_HOME:-/usr/local/cuda-13.0}"
targets="$cuda_home/targets/x86_64-linux"
work="${CROSS_WORK:-/tmp/llama-cuda-cross}"
mkdir -p "$work"
[ -x "$cuda_home/bin/nvcc" ] || { echo "no nvcc at $cuda_home/bin (set CUDA_HOME)" >&2; exit 1; }

if [ ! -e "$targets/lib/libcublas.so" ]; then
  echo "[cross] cuBLAS from PyPI (nvidia-cublas 13) into $targets"
  python3 -m pip download -q --no-deps "nvidia-cublas==13.*" -d "$work/wheel"
  rm -rf "$work/cublas" && python3 -m zipfile -e "$work"/wheel/nvidia_cublas-*.whl "$work/cublas"
  cp "$work"/cublas/nvidia/cu13/lib/*.so.13 "$targets/lib/"
  cp "$work"/cublas/nvidia/cu13/include/*.h "$targets/include/"
  for lib in libcublas libcublasLt libnvblas; do ln -sf "$lib.so.13" "$targets/lib/$lib.so"; done
fi

# The driver functions ggml-cuda calls (its memory pool's virtual memory management, device
# attributes, error strings): `nm -u libggml-cuda.a | grep ' cu[A-Z]'` on this tree gave these.
stub="$work/stub"
mkdir -p "$stub"
if [ ! -e "$stub/libcuda.so" ]; then
  for fn in cuDeviceGet cuDeviceGetAttribute cuGetErrorString cuMemAddressFree \
      cuMemAddressReserve cuMemCreate cuMemGetAllocationGranularity cuMemMap cuMemRelease \
      cuMemSetAccess cuMemUnmap; do
    echo "int $fn(void) { return 999; }"
  done > "$stub/stub.c"
  gcc -shared -fPIC -Wl,-soname,libcuda.so.1 -o "$stub/libcuda.so" "$stub/stub.c"
fi

export PATH="$cuda_home/bin:$PATH"
LLAMA_CMAKE_ARGS="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
-DCUDA_cuda_driver_LIBRARY=$stub/libcuda.so ${LLAMA_CMAKE_ARGS:-}" \
  CUDA_ARCHS="${CUDA_ARCHS:-90}" bash "$root/scripts/llama-cpp-cuda.sh"
