#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each over a scratch copy of its seed
# corpus (fuzz/corpus/<target>/; every target has one), as many at once as
# the machine has cores (FUZZ_JOBS overrides; each target is one process on
# one core). A crash's reproducer is kept under BUILD_DIR/crashes/ and its
# path printed; rerun it with
#   BUILD_DIR/fuzz/<target>_fuzz BUILD_DIR/crashes/<file>
# Usage: scripts/fuzz.sh BUILD_DIR SECONDS
set -euo pipefail
build=${1:?build dir}
seconds=${2:-60}
jobs=${FUZZ_JOBS:-$(nproc)}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
crashes="$build/crashes"
mkdir -p "$crashes"
status=0

# One target; its report printed whole when it ends, so parallel runs do not
# interleave; the exit status is the target's.
run_one() {
  local target=$1 name=$2
  local dict=()
  [[ -f "$root/fuzz/$name.dict" ]] && dict=(-dict="$root/fuzz/$name.dict")
  if ! "$target" "${dict[@]}" -max_total_time="$seconds" -print_final_stats=1 \
       -artifact_prefix="$crashes/$name-" "$work/$name" > "$work/$name.log" 2>&1; then
    { echo "fuzz: $name for ${seconds}s"; tail -40 "$work/$name.log"
      echo "fuzz: $name FAILED; reproducer: $(ls -t "$crashes/$name-"* 2>/dev/null | head -1)"; } >&2
    return 1
  fi
  { echo "fuzz: $name for ${seconds}s"; grep -E "stat::number_of_executed_units|Done" "$work/$name.log" | tail -2; }
}

running=0
for target in "$build"/fuzz/*_fuzz; do
  [[ -x "$target" ]] || continue
  name=$(basename "$target" _fuzz)
  if [[ ! -d "$root/fuzz/corpus/$name" ]]; then
    echo "fuzz: $name has no seed corpus in fuzz/corpus/$name" >&2
    status=1
    continue
  fi
  mkdir -p "$work/$name"
  cp -r "$root/fuzz/corpus/$name/." "$work/$name/"
  if (( running >= jobs )); then
    wait -n || status=1
    running=$((running - 1))
  fi
  run_one "$target" "$name" &
  running=$((running + 1))
done
while (( running > 0 )); do
  wait -n || status=1
  running=$((running - 1))
done
exit $status
