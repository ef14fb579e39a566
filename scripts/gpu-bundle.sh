#!/usr/bin/env bash
# Prepares the device check's bundle HERE (Debian 12, CUDA 13 at
# /usr/local/cuda, x86-64, like the GPU machines): the C++ parts built once,
# so the GPU machine (no package registry) builds nothing of them and its
# minutes go to the check itself (scripts/gpu-check.sh).
#
#   make gpu-bundle            (or: bash scripts/gpu-bundle.sh)
#
# It configures build-gpu-bundle (Release, -DKVB_CUDA=ON: sm_90 and PTX),
# builds kvbridge, gpu_test and gpu_bench, and lays out .gpu-bundle/
# (git-ignored; carry it to the device):
#   bin/      the three binaries, stripped
#   lib/      the shared libraries they load that a bare CUDA image may
#             lack (everything ldd names but glibc's own), so the binaries
#             run with LD_LIBRARY_PATH=.gpu-bundle/lib
#   python/   what the Python module builds from on the device against its
#             own python (python/device.cmake): the static libraries of the
#             build, the headers the bindings include, and the shared
#             libraries they link
#   MANIFEST  what was built, from which commit, the newest glibc symbol
#             version the binaries need (the device's glibc must be at least
#             that), and the bundle's size
# The carry limit of the device tool is 64 MiB for everything carried: the
# script fails when the bundle is larger.
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$ROOT"
BUILD=${KVB_BUNDLE_BUILD:-build-gpu-bundle}
OUTDIR=${KVB_BUNDLE_DIR:-.gpu-bundle}
LIMIT_MIB=${KVB_BUNDLE_LIMIT_MIB:-60}
JOBS=${JOBS:-$(nproc)}

if [[ ! -x /usr/local/cuda/bin/nvcc ]]; then
  echo "gpu-bundle: no CUDA toolkit at /usr/local/cuda: the bundle needs the real device built" >&2
  exit 1
fi
# Position-independent: the Python module, a shared object, links the same
# static libraries on the device.
mkdir -p "$BUILD"
cmake -G Ninja -S . -B "$BUILD" -DCMAKE_BUILD_TYPE=Release -DKVB_CUDA=ON -DKVB_UCX=OFF -DKVB_PYTHON=OFF \
  -DKVB_BENCH=OFF -DCMAKE_POSITION_INDEPENDENT_CODE=ON > "$BUILD/configure.log" 2>&1 ||
  { cat "$BUILD/configure.log"; exit 1; }
cmake --build "$BUILD" -j "$JOBS" --target kvbridge gpu_test gpu_bench kvbridge_connector kvbridge_testing \
  kvbridge_store

rm -rf "$OUTDIR"
mkdir -p "$OUTDIR/bin" "$OUTDIR/lib" "$OUTDIR/python/lib" "$OUTDIR/python/include"
cp "$BUILD/tools/kvbridge" "$BUILD/tests/gpu/gpu_test" "$BUILD/tests/gpu/gpu_bench" "$OUTDIR/bin/"
strip "$OUTDIR"/bin/*

# Shared libraries: what ldd resolves, but glibc's own (the device has its
# own glibc; a newer one is backward compatible) and the CUDA driver.
# libstdc++ and libgcc_s stay the device's too: the Python process there
# loads torch, which needs its own (newer) libstdc++, before ours.
glibc='^(libc|libm|libdl|libpthread|librt|ld-linux-x86-64|libresolv|libutil|linux-vdso|libcuda|libstdc\+\+|libgcc_s)\.so'
for b in "$OUTDIR"/bin/*; do
  ldd "$b" | awk '$3 ~ /^\// { print $1, $3 }'
done | sort -u | while read -r name path; do
  if [[ ! $name =~ $glibc ]]; then cp -L "$path" "$OUTDIR/lib/$name"; fi
done

# The Python module's inputs: the build's static libraries (in link order,
# python/device.cmake), the headers its sources include, the shared
# libraries they link (already in lib/).
find "$BUILD/src" -name 'libkvbridge_*.a' -exec cp {} "$OUTDIR/python/lib/" \;
cp -r include/kvbridge "$OUTDIR/python/include/"
mkdir -p "$OUTDIR/python/include/src"
(cd src && find . -name '*.h' -exec cp --parents {} "$ROOT/$OUTDIR/python/include/src/" \;)
for h in /usr/include/xxhash.h /usr/include/nlohmann; do cp -r "$h" "$OUTDIR/python/include/"; done

symbols=$(for b in "$OUTDIR"/bin/* "$OUTDIR"/lib/*; do objdump -T "$b" 2>/dev/null; done)
glibc_needed=$(grep -o 'GLIBC_[0-9.]*' <<<"$symbols" | sort -uV | tail -1)
glibcxx_needed=$(grep -o 'GLIBCXX_[0-9.]*' <<<"$symbols" | sort -uV | tail -1)
size_mib=$(du -sm "$OUTDIR" | cut -f1)
{
  echo "kvbridge gpu bundle"
  echo "commit $(git rev-parse --short HEAD)$(git diff --quiet HEAD -- . ':!.gpu-bundle' || echo ' (with uncommitted changes)')"
  echo "built $(date -u '+%Y-%m-%d %H:%M UTC') on $(. /etc/os-release && echo "$PRETTY_NAME"), $(/usr/local/cuda/bin/nvcc --version | grep -o 'release [0-9.]*')"
  echo "glibc needed $glibc_needed"
  echo "libstdc++ needed $glibcxx_needed"
  echo "size ${size_mib} MiB"
  echo "bin: $(cd "$OUTDIR/bin" && ls | tr '\n' ' ')"
  echo "lib: $(cd "$OUTDIR/lib" && ls | tr '\n' ' ')"
  echo "python/lib: $(cd "$OUTDIR/python/lib" && ls | tr '\n' ' ')"
} > "$OUTDIR/MANIFEST"
cat "$OUTDIR/MANIFEST"
if (( size_mib > LIMIT_MIB )); then
  echo "gpu-bundle: ${size_mib} MiB is more than ${LIMIT_MIB} MiB (the device tool carries at most 64 MiB)" >&2
  exit 1
fi
echo "gpu-bundle: ready, ${size_mib} MiB in $OUTDIR (carry \"$OUTDIR\"; run: bash scripts/gpu-check.sh)"
