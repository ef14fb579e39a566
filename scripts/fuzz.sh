#!/usr/bin/env bash
# Runs every fuzz target for SECONDS each over a scratch copy of its seed
# corpus. Usage: scripts/fuzz.sh BUILD_DIR SECONDS
set -euo pipefail
build=${1:?build dir}
seconds=${2:-60}
root=$(cd "$(dirname "$0")/.." && pwd)
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
status=0
for target in "$build"/fuzz/*_fuzz; do
  [[ -x "$target" ]] || continue
  name=$(basename "$target" _fuzz)
  mkdir -p "$work/$name"
  cp -r "$root/fuzz/corpus/$name/." "$work/$name/" 2>/dev/null || true
  dict=()
  [[ -f "$root/fuzz/$name.dict" ]] && dict=(-dict="$root/fuzz/$name.dict")
  echo "fuzz: $name for ${seconds}s"
  if ! "$target" "${dict[@]}" -max_total_time="$seconds" -print_final_stats=1 \
       -artifact_prefix="$work/" "$work/$name" > "$work/$name.log" 2>&1; then
    tail -40 "$work/$name.log"
    echo "fuzz: $name FAILED" >&2
    status=1
  else
    grep -E "stat::number_of_executed_units|Done" "$work/$name.log" | tail -2
  fi
done
exit $status
