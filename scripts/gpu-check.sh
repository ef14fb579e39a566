#!/usr/bin/env bash
# The device check, one shot: runs ON THE GPU MACHINE (no package registry,
# no network; CUDA 13, CMake, ninja, g++, and python3 with pybind11, pytest
# and torch), from the repository root, with the bundle that
# scripts/gpu-bundle.sh (`make gpu-bundle`) made here: nothing of the C++
# is built there, only the Python module against that python (a minute).
#
#   make gpu-bundle                                   # here: prints its size
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu-bundle"], timeout_s=420)
#
# Steps, each timed, each run whatever the one before did:
#   machine    nvidia-smi; the glibc the bundle needs against the machine's
#   gpu-test   gpu_test on the real device, KVB_GPU_REQUIRED=1: a test that
#              would skip (no device) fails
#   memcheck   compute-sanitizer --tool memcheck over gpu_test in one process
#              (the cuda_ipc case starts a child, which it leaves out)
#   gpu-bench  gpu_bench: every row's bytes checked, PASS/FAIL against its
#              target, ratios to a contiguous cudaMemcpy, one cudaMemcpyAsync
#              per descriptor and a raw cudaMemcpyBatchAsync (JSON too)
#   demo       kvbridge demo --memory cuda: P/D over cuda_ipc between rank
#              processes, every byte checked
#   staged     the same over tcp on loopback: device memory staged through
#              pinned host memory on both sides (gpu_test's staged case
#              covers device to host and back), every byte checked
#   python     the module built against the machine's python (python/device),
#              then python/tests/test_gpu_torch.py with KVB_GPU_REQUIRED=1 and
#              test_device.py (the module's device paths on the host fake)
# Then one line per step and the verdict, last: "gpu-check: PASS" only when
# every step ran and passed on a real device.
#
# Output: stdout, $OUT/gpu-check.log, $OUT/gpu-check.json (each step's rc and
# seconds, and the verdict) and $OUT/gpu-bench.json ($OUT: the device
# tool's folder that comes back; ./gpu-check-out without it).
#
# Time: each step has a limit, and none runs past KVB_GPU_BUDGET_S (330 s)
# from the start: machine 15 s, gpu-test 60 s, memcheck 90 s, gpu-bench 60
# s, demo 60 s, staged 45 s, python 120 s (build and tests).
#
# Rehearsal without a GPU (here, exactly as it runs there but on the host
# fake): KVB_DEVICE=fake bash scripts/gpu-check.sh. The verdict is then
# "REHEARSED", never PASS: memcheck has no GPU to check, the bench judges
# bytes only, and the torch tests find no CUDA device.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1
BUNDLE=${KVB_GPU_BUNDLE:-$REPO/.gpu-bundle}
OUTDIR=${OUT:-$REPO/gpu-check-out}
mkdir -p "$OUTDIR"
LOG=$OUTDIR/gpu-check.log
BUDGET_S=${KVB_GPU_BUDGET_S:-330}
PY=${KVB_GPU_PYTHON:-python3}
FAKE=0
[[ "${KVB_DEVICE:-}" == fake ]] && FAKE=1
START=$(date +%s)
STEPS=()
JSON_STEPS=()
FAILED=()

now_s() { echo $(($(date +%s) - START)); }

# step NAME LIMIT_S CMD...: runs CMD under timeout (cut to the budget left),
# records its rc and seconds.
step() {
  local name=$1 limit=$2
  shift 2
  local left=$((BUDGET_S - $(now_s)))
  ((limit > left)) && limit=$left
  if ((limit < 3)); then
    skip "$name" "no time left of the ${BUDGET_S} s budget"
    FAILED+=("$name")
    return 1
  fi
  echo
  echo "=== [$name] (limit ${limit} s, at +$(now_s) s): $*"
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout -k 5 "$limit" "$@"
  rc=$?
  t1=$(date +%s.%N)
  local dt
  dt=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  local verdict=ok
  if ((rc != 0)); then
    verdict="FAILED rc $rc"
    ((rc == 124 || rc == 137)) && verdict="FAILED (timed out after ${limit} s)"
    FAILED+=("$name")
  fi
  STEPS+=("$(printf '%-10s %-32s %7s s' "$name" "$verdict" "$dt")")
  JSON_STEPS+=("{\"step\":\"$name\",\"rc\":$rc,\"seconds\":$dt}")
  echo "=== [$name] rc $rc in ${dt} s"
  return $rc
}

skip() {
  echo
  echo "=== [$1] skipped: $2"
  STEPS+=("$(printf '%-10s skipped (%s)' "$1" "$2")")
  JSON_STEPS+=("{\"step\":\"$1\",\"rc\":null,\"skipped\":\"$2\"}")
}

machine() {
  uname -a
  if command -v nvidia-smi > /dev/null; then
    nvidia-smi --query-gpu=name,uuid,driver_version,memory.total --format=csv
  elif ((FAKE)); then
    echo "no nvidia-smi (rehearsal on the fake)"
  else
    echo "no nvidia-smi on a machine said to have a GPU"
    return 1
  fi
  cat "$BUNDLE/MANIFEST"
  local have need
  have=$(ldd --version | head -1 | grep -o '[0-9]*\.[0-9]*$')
  need=$(sed -n 's/^glibc needed GLIBC_//p' "$BUNDLE/MANIFEST")
  echo "glibc here $have, the bundle needs $need"
  [[ "$(printf '%s\n%s\n' "$need" "$have" | sort -V | head -1)" == "$need" ]]
}

python_step() {
  local pybind
  pybind=$("$PY" -m pybind11 --cmakedir 2> /dev/null || echo /usr/lib/cmake/pybind11)
  cmake -G Ninja -S python/device -B build-gpu-python -DCMAKE_BUILD_TYPE=Release -DKVB_BUNDLE="$BUNDLE" \
    -DPython_EXECUTABLE="$(command -v "$PY")" -Dpybind11_DIR="$pybind" > "$OUTDIR/python-configure.log" 2>&1 ||
    { cat "$OUTDIR/python-configure.log"; return 1; }
  cmake --build build-gpu-python -j "$(nproc)" || return 1
  # The CUDA-tensor tests, and the module's device paths on the host fake
  # (test_device.py: the same module, so a rehearsal runs something too).
  env PYTHONPATH="$REPO/build-gpu-python" PYTHONDONTWRITEBYTECODE=1 KVB_GPU_REQUIRED=$((1 - FAKE)) \
    "$PY" -m pytest -q -p no:cacheprovider -rs python/tests/test_gpu_torch.py python/tests/test_device.py
}

main() {
  echo "kvbridge gpu-check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on ${HOSTNAME:-?}$( ((FAKE)) && echo ', REHEARSAL on the host fake')"
  if [[ ! -f "$BUNDLE/MANIFEST" ]]; then
    echo "no bundle at $BUNDLE: run \`make gpu-bundle\` on the build machine and carry .gpu-bundle"
    echo "gpu-check: FAIL (no bundle)"
    return 1
  fi
  export LD_LIBRARY_PATH="$BUNDLE/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
  local bin=$BUNDLE/bin
  # The steps that are functions run in a bash of their own, under timeout.
  export -f machine python_step
  export BUNDLE FAKE PY OUTDIR REPO
  step machine 15 bash -c machine
  step gpu-test 60 env KVB_GPU_REQUIRED=1 "$bin/gpu_test"
  if ((FAKE)); then
    skip memcheck "no GPU to check (rehearsal)"
  elif command -v compute-sanitizer > /dev/null || [[ -x /usr/local/cuda/bin/compute-sanitizer ]]; then
    local cs
    cs=$(command -v compute-sanitizer || echo /usr/local/cuda/bin/compute-sanitizer)
    step memcheck 90 "$cs" --tool memcheck --error-exitcode 1 --target-processes application-only \
      env KVB_GPU_REQUIRED=1 "$bin/gpu_test" --gtest_filter=-GpuTest.CudaIpc*
  else
    skip memcheck "compute-sanitizer not found"
    FAILED+=(memcheck)
  fi
  step gpu-bench 60 "$bin/gpu_bench" --json "$OUTDIR/gpu-bench.json"
  step demo 60 "$bin/kvbridge" demo --memory cuda
  step staged 45 "$bin/kvbridge" demo --memory cuda --transport tcp
  step python 120 bash -c python_step

  echo
  echo "=== summary ($(now_s) s of ${BUDGET_S} s)"
  printf '%s\n' "${STEPS[@]}"
  local verdict
  if ((${#FAILED[@]})); then
    verdict="FAIL (${FAILED[*]})"
  elif ((FAKE)); then
    verdict="REHEARSED (on the host fake: not a device's verdict)"
  else
    verdict="PASS"
  fi
  local IFS=,
  echo "{\"verdict\":\"${verdict}\",\"seconds\":$(now_s),\"steps\":[${JSON_STEPS[*]}]}" > "$OUTDIR/gpu-check.json"
  echo "gpu-check: $verdict"
  ((${#FAILED[@]} == 0))
}

main "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
