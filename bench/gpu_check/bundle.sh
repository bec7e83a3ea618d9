#!/usr/bin/env bash
# Packs the GPU check bundle from a portable build (`make gpu-check-bundle` runs it):
#   bench/gpu_check/bundle.sh [--rehearsal] BUILD_DIR BUNDLE_DIR
# BUILD_DIR must be configured with -DSPES_PORTABLE=ON (static C++/Fortran/OpenMP/CUDA
# runtimes). The bundle is everything a lent GPU machine needs for one call of
# BUNDLE_DIR/run.sh OUT: stripped binaries (and CUPTI, for bench_train_gpu's step
# timeline), the two tiny configs, the tokenized Tiny Shakespeare, the GPU-shaped
# Hugging Face fixtures, the PyTorch anchors script, the commit. Fails, naming the
# cause, when a binary needs a shared library the GPU machine may lack, or when the
# bundle exceeds GPU_BUNDLE_MAX_MIB.
# --rehearsal packs a normal CUDA build for a run on this machine only (the rehearsal
# without a GPU, tests/gpu_check_rehearsal.sh): no portability or size checks, fast gzip.
set -euo pipefail

REHEARSAL=0
[[ ${1:-} == --rehearsal ]] && REHEARSAL=1 && shift
BUILD=${1:?usage: bundle.sh [--rehearsal] BUILD_DIR BUNDLE_DIR}
OUT=${2:?usage: bundle.sh [--rehearsal] BUILD_DIR BUNDLE_DIR}
MAX_MIB=${GPU_BUNDLE_MAX_MIB:-60}
SRC=$(cd "$(dirname "$0")/../.." && pwd)
HERE="$SRC/bench/gpu_check"

fail() { echo "gpu-check-bundle: $*" >&2; exit 1; }

[[ -f $BUILD/CMakeCache.txt ]] || fail "$BUILD is not a build folder"
((REHEARSAL)) || grep -q '^SPES_PORTABLE:BOOL=ON' "$BUILD/CMakeCache.txt" ||
  fail "$BUILD is not a -DSPES_PORTABLE=ON build"
grep -q '^SPES_CUDA:BOOL=ON' "$BUILD/CMakeCache.txt" || fail "$BUILD is built without CUDA"

# What the GPU machine provides: glibc, the driver (libcuda), cuBLAS, cuBLASLt, NCCL.
# Anything else a binary needs itself would be missing there.
ALLOWED='^(libc|libm|libpthread|libdl|librt|libcuda|libcublas|libcublasLt|libnccl)\.so(\.[0-9]+)*$|^ld-linux-x86-64\.so\.2$'

binaries=(spes-engine spes_tests)
for b in "$BUILD"/bench_*; do
  [[ -f $b && -x $b ]] && binaries+=("$(basename "$b")")
done

PART="$OUT.partial"
rm -rf "$OUT" "$PART"
mkdir -p "$PART/configs" "$PART/data" "$PART/stage/bin"
trap 'rm -rf "$PART"' EXIT

# ---- binaries: strip, check what each needs --------------------------------------
unpacked=0
needed_all=()
ldd_summary=""
for b in "${binaries[@]}"; do
  [[ -x $BUILD/$b ]] || fail "$BUILD/$b is missing (build first)"
  strip --strip-all -o "$PART/stage/bin/$b" "$BUILD/$b"
  f="$PART/stage/bin/$b"
  unpacked=$((unpacked + $(stat -c %s "$f")))
  # The binary's own needs (DT_NEEDED). ldd also lists what libnccl/libcublas need in
  # turn (libstdc++, libgcc_s): those come with NCCL/cuBLAS on the GPU machine.
  mapfile -t needed < <(readelf -d "$f" | sed -n 's/.*(NEEDED).*\[\(.*\)\]/\1/p')
  for lib in "${needed[@]}"; do
    ((REHEARSAL)) || [[ $lib =~ $ALLOWED ]] || fail "$b needs $lib, which the GPU machine may not have (link it statically: see SPES_PORTABLE in CMakeLists.txt)"
    needed_all+=("$lib")
  done
  if ldd "$f" | grep -q 'not found'; then
    fail "$b: ldd cannot resolve $(ldd "$f" | grep 'not found' | awk '{print $1}' | paste -sd, -) here"
  fi
  ldd_summary+="  $b: $(printf '%s ' "${needed[@]}")"$'\n'
done
# Every CUDA binary must carry sm_90 code (H100/H200).
if ((!REHEARSAL)) && { command -v cuobjdump >/dev/null || [[ -x /usr/local/cuda/bin/cuobjdump ]]; }; then
  CUOBJDUMP=$(command -v cuobjdump || echo /usr/local/cuda/bin/cuobjdump)
  "$CUOBJDUMP" --list-elf "$PART/stage/bin/spes_tests" 2>/dev/null | grep -q 'sm_90' ||
    fail "spes_tests has no sm_90 code (configure with -DCMAKE_CUDA_ARCHITECTURES=90)"
fi

# CUPTI, which bench_train_gpu opens (dlopen) to trace one step: the copy this build's
# header describes, beside the binaries, where the bench looks first. Without it the
# bench uses the GPU machine's own, or says why it has no timeline.
cupti_lib=$(sed -n 's/^CUDA_cupti_LIBRARY:FILEPATH=//p' "$BUILD/CMakeCache.txt")
cupti_note="none found here (bench_train_gpu uses the GPU machine's own, if any)"
if [[ -n $cupti_lib && -f $cupti_lib ]]; then
  cupti_so=$(readelf -d "$cupti_lib" | sed -n 's/.*(SONAME).*\[\(.*\)\]/\1/p')
  cp -L "$cupti_lib" "$PART/stage/bin/${cupti_so:-libcupti.so}"
  cupti_note="$cupti_so, from $cupti_lib"
fi

# The shared libraries the run script must find on the GPU machine.
printf '%s\n' "${needed_all[@]}" | sort -u | grep -E '^lib(cublas|cublasLt|nccl|cuda)\.so' > "$PART/needed-libs.txt" || true

# Three binaries carry OpenBLAS's kernels for every x86 CPU generation (about 22 MB
# each, selected at run time), so plain they exceed the size limit; gzip takes them
# to about a third. run.sh unpacks them into its work folder.
tar -C "$PART/stage" -cf - bin | gzip "-$( ((REHEARSAL)) && echo 1 || echo 9)" > "$PART/bin.tar.gz"
rm -rf "$PART/stage"

# ---- data, configs, scripts ---------------------------------------------------------
"$BUILD/spes-engine" tokenize --input "$SRC/data/corpus/tinyshakespeare.txt" \
  --out "$PART/data/tinyshakespeare" --val-fraction 0.05 >/dev/null
cp "$SRC/configs/tiny.toml" "$SRC/configs/tiny-central.toml" "$PART/configs/"
# test_gpu_import's fixtures (run.sh points SPES_HF_FIXTURES at them).
mkdir -p "$PART/hf"
cp -r "$SRC"/tests/oracles/hf/*_gpu "$PART/hf/"
# Every GPU test file: the kernels (test_cuda_*) and the whole step (test_gpu_step).
for t in "$SRC"/tests/*.cu; do basename "$t" .cu; done > "$PART/cuda-tests.txt"
cp "$HERE/run.sh" "$HERE/report.py" "$SRC/bench/torch_anchors.py" "$PART/"
chmod +x "$PART/run.sh" "$PART/report.py"

commit=$(git -C "$SRC" rev-parse HEAD 2>/dev/null || echo unknown)
dirty=$(git -C "$SRC" status --porcelain --untracked-files=no 2>/dev/null | wc -l)
{
  echo "commit: $commit$([[ $dirty != 0 ]] && echo " (+ $dirty uncommitted changes)")"
  echo "commit_subject: $(git -C "$SRC" log -1 --format=%s 2>/dev/null || true)"
  ((REHEARSAL)) && echo "rehearsal: a normal build, for this machine only (bundle.sh --rehearsal)"
  echo "built: $(date -u +%Y-%m-%dT%H:%M:%SZ) on $(uname -n)"
  echo "cuda_toolkit: $(/usr/local/cuda/bin/nvcc --version 2>/dev/null | sed -n 's/.*release \([0-9.]*\), \(V[0-9.]*\).*/\1 (\2)/p')"
  echo "cuda_archs: $(sed -n 's/^CMAKE_CUDA_ARCHITECTURES:[A-Z]*=//p' "$BUILD/CMakeCache.txt")"
  echo "compiler: $(${CXX:-c++} --version | head -1)"
  echo "binaries: ${binaries[*]}"
  echo "binaries_unpacked_bytes: $unpacked"
  echo "cupti: $cupti_note"
  echo "needs:"
  printf '%s' "$ldd_summary"
} > "$PART/BUNDLE_INFO"

size=$(du -sb "$PART" | cut -f1)
limit=$((MAX_MIB * 1024 * 1024))
((REHEARSAL || size <= limit)) || fail "bundle is $((size / 1048576)) MiB, over the ${MAX_MIB} MiB limit"
echo "bundle_bytes: $size" >> "$PART/BUNDLE_INFO"

trap - EXIT
mv "$PART" "$OUT"
echo "gpu-check-bundle: $OUT: $(awk -v s="$size" 'BEGIN{printf "%.1f", s/1048576}') MiB" \
  "(binaries $(awk -v s="$unpacked" 'BEGIN{printf "%.1f", s/1048576}') MiB unpacked)," \
  "${#binaries[@]} binaries, commit ${commit:0:12}$([[ $dirty != 0 ]] && echo +dirty)"
echo "shared libraries needed (all present on a CUDA machine):"
printf '%s' "$ldd_summary"
echo "run it on a GPU machine: $OUT/run.sh OUTDIR"
