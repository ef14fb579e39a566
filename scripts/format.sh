#!/usr/bin/env bash
# The C++ sources in the house style (.clang-format, clang-format-14).
# Usage: scripts/format.sh          rewrites every tracked .h/.cc file
#        scripts/format.sh --check  lists the files that differ; exit 1 if any
set -euo pipefail
cd "$(dirname "$0")/.."
fmt=$(command -v clang-format-14 || command -v clang-format || true)
[[ -n $fmt ]] || { echo "format: clang-format-14 is not installed (scripts/deps.sh installs it)"; exit 1; }
mapfile -t files < <(git ls-files '*.h' '*.cc' 2>/dev/null || find include src tools bench tests python fuzz -name '*.h' -o -name '*.cc')
if [[ ${1:-} == --check ]]; then
  # One clang-format for every file (a process per file took 55 s of CI);
  # the files that differ are named from its diagnostics (FILE:LINE:COL: ...).
  if out=$("$fmt" --dry-run --Werror "${files[@]}" 2>&1); then
    echo "format: ${#files[@]} files in the house style"
    exit 0
  fi
  grep -oE '^[^:[:space:]]+:[0-9]+:[0-9]+: (error|warning)' <<<"$out" | cut -d: -f1 | sort -u |
    while read -r f; do echo "format: $f differs from .clang-format (scripts/format.sh rewrites it)"; done
  grep -q -E '^[^:[:space:]]+:[0-9]+:[0-9]+: (error|warning)' <<<"$out" || echo "format: $out"
  exit 1
fi
"$fmt" -i "${files[@]}"
