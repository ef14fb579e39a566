#!/usr/bin/env bash
# The GPU check: runs ON THE GPU MACHINE (no package registry, no network;
# CUDA at /usr/local/cuda, CMake, ninja, g++), from the repository root of a
# copy of the working tree, with the dependency prefix that
# scripts/gpu-deps.sh made here (.gpu-deps/root, .gpu-deps/bin: git-ignored,
# so name them in the device tool's `carry`). For example:
#
#   run(command="bash scripts/gpu-check.sh", carry=[".gpu-deps/root", ".gpu-deps/bin"], timeout_s=540)
#
# Steps, each timed and each continuing past a failure of the one before:
#   configure   build-gpu, Release, -DKVB_CUDA=ON -DKVB_UCX=OFF -DKVB_BENCH=OFF
#               -DKVB_PYTHON=OFF -DKVB_WERROR=OFF, packages from the prefix
#   build       only the targets kvbridge and gpu_test (those that exist)
#   nvidia-smi  the GPU and driver, if nvidia-smi is there
#   ctest-gpu   ctest -L gpu
#   version / bench / demo   build-gpu/tools/kvbridge --version,
#               bench --memory cuda, demo --memory cuda
#   demo-stream layer-wise streaming of device memory, TP 1 -> TP 1, each rank
#               on its own core: qwen3-next at 16k and 32k tokens, llama3-70b
#               at 8k, each with its unstreamed reruns (the TTFT ratio)
# then one summary line per step: ok / failed rc N / skipped (why).
#
# Everything goes to stdout and to $OUT/gpu-check.log ($OUT: the device tool's
# folder that comes back), or ./gpu-check.log without $OUT.
#
# Time: per-step limits (timeout) sum to 9.5 minutes: configure + build 230
# s, nvidia-smi 10 s, tests 90 s, --version 10 s, bench 80 s, demo 60 s,
# demo-stream 120 s; and no step runs past the overall deadline
# KVB_GPU_BUDGET_S (540 s from the start).
# Each limit can be changed by its variable below. KVB_GPU_FRESH=1 removes
# build-gpu first (by default a warm machine reuses it, incrementally);
# KVB_GPU_SKIP_BUILD=1 skips the build (a configure-only rehearsal);
# KVB_GPU_CUDA_ARCH sets CMAKE_CUDA_ARCHITECTURES (the CMake's default: 90);
# KVB_GPU_CMAKE_ARGS adds configure arguments.
set -uo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
cd "$REPO" || exit 1

BUILD=build-gpu
DEPS_ROOT=$REPO/.gpu-deps/root
MULTIARCH=x86_64-linux-gnu
LOG=${OUT:+$OUT/gpu-check.log}
LOG=${LOG:-$REPO/gpu-check.log}

BUDGET_S=${KVB_GPU_BUDGET_S:-540}            # all steps together
T_CONFIGURE_BUILD=${KVB_GPU_T_BUILD:-230}    # configure + build together
T_CONFIGURE=${KVB_GPU_T_CONFIGURE:-90}       # configure alone (within the above)
T_SMI=${KVB_GPU_T_SMI:-10}
T_TESTS=${KVB_GPU_T_TESTS:-90}
T_VERSION=${KVB_GPU_T_VERSION:-10}
T_BENCH=${KVB_GPU_T_BENCH:-80}
T_DEMO=${KVB_GPU_T_DEMO:-60}
T_STREAM=${KVB_GPU_T_STREAM:-120}
JOBS=${KVB_GPU_JOBS:-16}

START=$(date +%s)
STEPS=()          # summary lines, in order
declare -A STATUS # step -> ok / failed / skipped

# now_s: seconds since the start. left_s: seconds left of the overall budget.
now_s() { echo $(( $(date +%s) - START )); }
left_s() { echo $(( BUDGET_S - $(now_s) )); }

# run_step NAME LIMIT_S CMD...: runs CMD under `timeout` (LIMIT_S, cut to what
# is left of the budget; the whole process group is signalled, so children
# such as the demo's rank processes go too), records ok / failed rc N, and
# prints its duration. rc 124 means the limit was hit.
run_step() {
  local name=$1 limit=$2; shift 2
  local left; left=$(left_s)
  if (( left < 3 )); then
    skip_step "$name" "no time left of the ${BUDGET_S} s budget"
    return 1
  fi
  (( limit > left )) && limit=$left
  if (( limit < 1 )); then
    skip_step "$name" "its limit is used up (${limit} s)"
    return 1
  fi
  echo
  echo "=== [$name] (limit ${limit} s, at +$(now_s) s): $*"
  local t0 t1 rc
  t0=$(date +%s.%N)
  timeout -k 5 "$limit" "$@"
  rc=$?
  t1=$(date +%s.%N)
  local dt; dt=$(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.1f", b - a }')
  if (( rc == 0 )); then
    STATUS[$name]=ok
    STEPS+=("$(printf '%-11s ok                 %7s s' "$name" "$dt")")
  else
    local why="rc $rc"
    (( rc == 124 || rc == 137 )) && why="rc $rc (timed out after ${limit} s)"
    STATUS[$name]=failed
    STEPS+=("$(printf '%-11s failed %-11s %7s s' "$name" "$why" "$dt")")
  fi
  echo "=== [$name] rc $rc in ${dt} s"
  return $rc
}

# skip_step NAME WHY: records a step that did not run.
skip_step() {
  echo
  echo "=== [$1] skipped: $2"
  STATUS[$1]=skipped
  STEPS+=("$(printf '%-11s skipped (%s)' "$1" "$2")")
}

main() {
  echo "kvbridge gpu-check: $(date -u '+%Y-%m-%d %H:%M:%S UTC') on ${HOSTNAME:-?}, repo $REPO"
  echo "log: $LOG"

  # --- environment: what the machine has ------------------------------------
  # nvcc: the CMake finds /usr/local/cuda/bin/nvcc itself; on the PATH it
  # also serves this log and CUDAToolkit.
  if ! command -v nvcc >/dev/null && [[ -x /usr/local/cuda/bin/nvcc ]]; then
    export PATH=/usr/local/cuda/bin:$PATH
  fi
  echo "--- tools"
  uname -a
  for t in cmake ninja g++ nvcc; do
    if command -v $t >/dev/null; then
      echo "$t: $(command -v $t): $($t --version 2>&1 | grep -m1 -iE 'version|release|[0-9]+\.[0-9]+')"
    else
      echo "$t: not found"
    fi
  done
  [[ -f /etc/os-release ]] && grep -m1 PRETTY_NAME /etc/os-release
  ldd --version 2>&1 | head -1

  # --- the dependency prefix --------------------------------------------------
  # CMake config packages (nlohmann_json, CLI11, GTest) come from
  # CMAKE_PREFIX_PATH; pkg-config ones (libxxhash, hiredis) from
  # PKG_CONFIG_PATH (their .pc files use ${pcfiledir}, so they are
  # relocatable); OpenSSL from OPENSSL_ROOT_DIR. They come first, before
  # anything the system has.
  local cmake_deps=()
  if [[ -d "$DEPS_ROOT/usr/include" ]]; then
    export PKG_CONFIG_PATH="$DEPS_ROOT/usr/lib/$MULTIARCH/pkgconfig:$DEPS_ROOT/usr/share/pkgconfig${PKG_CONFIG_PATH:+:$PKG_CONFIG_PATH}"
    cmake_deps=(-DCMAKE_PREFIX_PATH="$DEPS_ROOT/usr" -DOPENSSL_ROOT_DIR="$DEPS_ROOT/usr")
    echo "--- prefix: $DEPS_ROOT ($(du -sh "$DEPS_ROOT" | cut -f1))"
  else
    echo "--- prefix: $DEPS_ROOT is MISSING: run scripts/gpu-deps.sh on the Debian machine and carry .gpu-deps/root and .gpu-deps/bin; trying the system's packages"
  fi
  # pkg-config: the system's if it has one, else Debian's pkgconf from the
  # prefix (a wrapper that gives it its own libpkgconf).
  local pkgconfig
  if pkgconfig=$(command -v pkg-config); then
    echo "pkg-config: the system's, $pkgconfig ($($pkgconfig --version))"
  elif [[ -f "$REPO/.gpu-deps/bin/pkg-config" ]]; then
    chmod +x "$REPO/.gpu-deps/bin/pkg-config" 2>/dev/null
    pkgconfig=$REPO/.gpu-deps/bin/pkg-config
    echo "pkg-config: bundled, $pkgconfig ($($pkgconfig --version))"
  else
    pkgconfig=""
    echo "pkg-config: none (the configure will fail at find_package(PkgConfig))"
  fi
  [[ -n "$pkgconfig" ]] && cmake_deps+=(-DPKG_CONFIG_EXECUTABLE="$pkgconfig")
  # Run time: the binaries carry a build-tree RUNPATH into the prefix already;
  # LD_LIBRARY_PATH covers anything that does not. It is set for the run steps
  # only, so cmake, nvcc and g++ never load the prefix's libssl.
  local run_ldpath="$DEPS_ROOT/usr/lib/$MULTIARCH${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

  # --- configure ----------------------------------------------------------------
  [[ "${KVB_GPU_FRESH:-0}" == 1 ]] && rm -rf "$BUILD"
  local extra=()
  [[ -n "${KVB_GPU_CUDA_ARCH:-}" ]] && extra+=(-DCMAKE_CUDA_ARCHITECTURES="$KVB_GPU_CUDA_ARCH")
  # KVB_GPU_CMAKE_ARGS: more configure arguments, split at spaces.
  # shellcheck disable=SC2206
  [[ -n "${KVB_GPU_CMAKE_ARGS:-}" ]] && extra+=($KVB_GPU_CMAKE_ARGS)
  local t_conf=$T_CONFIGURE
  (( t_conf > T_CONFIGURE_BUILD )) && t_conf=$T_CONFIGURE_BUILD
  run_step configure "$t_conf" \
    cmake -G Ninja -S . -B "$BUILD" \
      -DCMAKE_BUILD_TYPE=Release \
      -DKVB_CUDA=ON -DKVB_UCX=OFF -DKVB_BENCH=OFF -DKVB_PYTHON=OFF -DKVB_WERROR=OFF \
      "${cmake_deps[@]}" "${extra[@]}"
  if [[ -f "$BUILD/CMakeCache.txt" ]]; then
    # Where each package was found (all should be under .gpu-deps/root).
    echo "--- found packages (CMakeCache.txt)"
    grep -E '^(nlohmann_json_DIR|CLI11_DIR|GTest_DIR|OPENSSL_INCLUDE_DIR|OPENSSL_CRYPTO_LIBRARY|pkgcfg_lib_XXHASH_xxhash|pkgcfg_lib_HIREDIS_hiredis|PKG_CONFIG_EXECUTABLE|CMAKE_CUDA_COMPILER|CMAKE_CUDA_ARCHITECTURES|CUDAToolkit_[A-Z_]*DIR|CMAKE_CXX_COMPILER|KVB_[A-Z_]*)(:|=)' \
      "$BUILD/CMakeCache.txt"
  fi

  # --- build kvbridge and gpu_test (whichever exist) -----------------------
  local targets=() missing=()
  if [[ "${STATUS[configure]}" == ok ]]; then
    # Ninja lists every target as "name: phony" or "name: <rule>".
    local all_targets
    all_targets=$(cmake --build "$BUILD" --target help 2>/dev/null | sed -n 's/^\([^:]*\): .*/\1/p')
    for t in kvbridge gpu_test; do
      if grep -qx "$t" <<<"$all_targets"; then targets+=("$t"); else missing+=("$t"); fi
    done
    (( ${#missing[@]} )) && echo "NOTE: no target ${missing[*]} in this tree (not written yet?); building ${targets[*]:-nothing}"
  fi
  if [[ "${STATUS[configure]}" != ok ]]; then
    skip_step build "configure failed"
  elif [[ "${KVB_GPU_SKIP_BUILD:-0}" == 1 ]]; then
    skip_step build "KVB_GPU_SKIP_BUILD=1"
  elif (( ${#targets[@]} == 0 )); then
    skip_step build "neither kvbridge nor gpu_test exists"
  else
    run_step build $(( T_CONFIGURE_BUILD - $(now_s) )) \
      cmake --build "$BUILD" -j "$JOBS" --target "${targets[@]}"
  fi

  # --- the GPU ----------------------------------------------------------------------
  if command -v nvidia-smi >/dev/null; then
    run_step nvidia-smi "$T_SMI" nvidia-smi
  else
    skip_step nvidia-smi "nvidia-smi not found"
  fi

  # --- GPU tests (ctest label gpu) ------------------------------------------
  # --no-tests=error: a tree with no test labelled gpu is a failure, not ok.
  if [[ ! -f "$BUILD/CTestTestfile.cmake" ]]; then
    skip_step ctest-gpu "no $BUILD/CTestTestfile.cmake (configure failed)"
  else
    [[ " ${missing[*]} " == *" gpu_test "* ]] && echo "NOTE: gpu_test was not built (no such target)"
    run_step ctest-gpu "$T_TESTS" env LD_LIBRARY_PATH="$run_ldpath" \
      ctest --test-dir "$BUILD" -L gpu --output-on-failure --no-tests=error --timeout "$T_TESTS"
  fi

  # --- the CLI on the GPU -------------------------------------------------------
  local cli=$BUILD/tools/kvbridge
  if [[ -x "$cli" ]]; then
    run_step version "$T_VERSION" env LD_LIBRARY_PATH="$run_ldpath" "$cli" --version
    run_step bench "$T_BENCH" env LD_LIBRARY_PATH="$run_ldpath" "$cli" bench --memory cuda --min-time 0.02 --reps 3
    run_step demo "$T_DEMO" env LD_LIBRARY_PATH="$run_ldpath" "$cli" demo --memory cuda
    run_step demo-fault "$T_DEMO" env LD_LIBRARY_PATH="$run_ldpath" "$cli" demo --memory cuda --requests 3 \
      --inject kill-prefill
    run_step demo-stream "$T_STREAM" env LD_LIBRARY_PATH="$run_ldpath" bash "$REPO/scripts/gpu-stream.sh" "$cli"
  else
    for s in version bench demo demo-fault demo-stream; do skip_step "$s" "$cli was not built"; done
  fi

  # --- summary --------------------------------------------------------------------
  echo
  echo "=== summary (total $(now_s) s of ${BUDGET_S} s)"
  # All ok only when every step ran and passed (nvidia-smi may be absent);
  # INCOMPLETE when none failed but some did not run.
  local failed=0 skipped=0
  for line in "${STEPS[@]}"; do echo "$line"; done
  for s in "${!STATUS[@]}"; do
    [[ "${STATUS[$s]}" == failed ]] && failed=1
    [[ "${STATUS[$s]}" == skipped && $s != nvidia-smi ]] && skipped=1
  done
  if ((failed)); then
    echo "gpu-check: FAILED"
  elif ((skipped)); then
    echo "gpu-check: INCOMPLETE (steps skipped)"
  else
    echo "gpu-check: all ok"
  fi
  return $(( failed || skipped ))
}

# Everything to stdout and the log; the exit status is main's.
mkdir -p "$(dirname "$LOG")"
main "$@" 2>&1 | tee "$LOG"
exit "${PIPESTATUS[0]}"
