#!/usr/bin/env bash
# Prebuilt CUDA test binaries for a GPU machine that cannot build moeflex itself
# (its image lacks the project's Debian dev packages and has no network).
#
# Builds the CUDA backend's test binaries and the moeflex binary here for a portable
# CPU target (-march=x86-64-v3, in build-gpu-bundle.obj/) and copies them, with the
# non-CUDA shared libraries they load (OpenBLAS, fmt, Open MPI, sentencepiece, ...),
# into build-gpu-bundle/ (git-ignored; the libraries packed as lib.tgz so that the
# whole stays well under the device tool's 64 MiB carry: about 40 MB), with the
# default corpus and its
# tokenized cache as data.tgz (the training runs of gpu-check.sh steps 3-4; data/ is
# git-ignored, so it does not travel with the working tree). Carry that folder to the GPU
# machine; scripts/gpu-check.sh uses it when it cannot configure a build there.
# The CUDA libraries themselves (cudart, cuBLAS, cuBLASLt, NCCL) are not copied:
# they are large and the GPU machine's own are used.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BUILD=${BUILD:-build-gpu-bundle.obj}
BUNDLE=${BUNDLE:-build-gpu-bundle}
TARGETS=(test_cuda_ops test_cuda_op_cases test_cuda_bench test_cuda_runtime test_backend_host test_cuda_train moeflex)

cmake -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DMOEFLEX_CUDA=ON -DMOEFLEX_MARCH=x86-64-v3 >/dev/null
cmake --build "$BUILD" -j "${JOBS:-$(nproc)}" --target "${TARGETS[@]}"

rm -rf "$BUNDLE"
mkdir -p "$BUNDLE/bin" "$BUNDLE/lib"
for t in "${TARGETS[@]}"; do cp "$BUILD/$t" "$BUNDLE/bin/"; done
# The corpus of the training runs (gpu-check.sh unpacks it when data/ is absent).
if [[ -d data/brown ]]; then
  tar czf "$BUNDLE/data.tgz" data/brown $(ls -d data/tokenized/brown-v4096 2>/dev/null)
else
  echo "gpu-bundle: WARNING: no data/brown (run make data): the bundle's training runs will have no corpus" >&2
fi
# A hardware profile for gpu-check.sh's optional --profile-ops run (only its measured
# times are read there).
[[ -f data/hardware/this-machine.json ]] && cp data/hardware/this-machine.json "$BUNDLE/hw.json"
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
nlibs=$(ls "$BUNDLE/lib" | wc -l)
libs=$(ls "$BUNDLE/lib" | tr '\n' ' ')
# Packed (OpenBLAS alone is 36 MB unpacked); gpu-check.sh unpacks it into its work folder.
tar czf "$BUNDLE/lib.tgz" -C "$BUNDLE" lib
rm -rf "$BUNDLE/lib"
echo "gpu-bundle: $(du -sh "$BUNDLE" | cut -f1) in $BUNDLE/ ($nlibs libraries in lib.tgz): $libs"
echo "carry it with the device run: carry [\"$BUNDLE\"]"
