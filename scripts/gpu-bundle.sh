#!/usr/bin/env bash
# Prebuilt CUDA test binaries for a GPU machine that cannot build moeflex itself
# (its image lacks the project's Debian dev packages and has no network).
#
# Builds the CUDA backend's test binaries here for a portable CPU target
# (-march=x86-64-v3, in build-gpu-bundle.obj/) and copies them, with the non-CUDA
# shared libraries they load (OpenBLAS, fmt, Open MPI, ...), into build-gpu-bundle/
# (git-ignored, about 50 MB). Carry that folder to the GPU
# machine; scripts/gpu-check.sh uses it when it cannot configure a build there.
# The CUDA libraries themselves (cudart, cuBLAS, cuBLASLt, NCCL) are not copied:
# they are large and the GPU machine's own are used.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build-gpu-bundle.obj}
BUNDLE=${BUNDLE:-build-gpu-bundle}
TARGETS=(test_cuda_ops test_cuda_bench test_cuda_runtime test_backend_host)

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMOEFLEX_CUDA=ON -DMOEFLEX_MARCH=x86-64-v3 >/dev/null
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
for t in "${TARGETS[@]}"; do cp "$BUILD/$t" "$BUNDLE/bin/"; done
# Shared libraries to carry: everything ldd resolves except the C runtime (every
# Linux has a compatible one) and the CUDA libraries (the GPU machine's are used).
skip='^(linux-vdso|ld-linux|libc\.|libm\.|libdl\.|libpthread\.|librt\.|libstdc\+\+|libgcc_s|libcuda\.|libcudart|libcublas|libcublasLt|libnccl)'
for t in "${TARGETS[@]}"; do
  ldd "$BUILD/$t" | awk '$3 ~ /^\// {print $1, $3}'
done | sort -u | while read -r name path; do
  if [[ ! $name =~ $skip ]]; then cp -L "$path" "$BUNDLE/lib/$name"; fi
done
{
  echo "built $(date -u +%Y-%m-%dT%H:%MZ) on $(hostname) from commit $(git rev-parse --short HEAD 2>/dev/null || echo '?')"
  git status --porcelain 2>/dev/null | grep -q . && echo "(working tree had uncommitted changes)"
  nvcc --version 2>/dev/null | tail -n 2 | head -n 1 || true
} >"$BUNDLE/BUILD_INFO"
echo "gpu-bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE/ ($(ls "$BUNDLE/lib" | wc -l) libraries):"
ls "$BUNDLE/lib"
echo "carry it with the device run: carry [\"$BUNDLE\"]"
