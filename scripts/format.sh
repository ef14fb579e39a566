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
  bad=0
  for f in "${files[@]}"; do
    if ! "$fmt" --dry-run --Werror "$f" >/dev/null 2>&1; then
      echo "format: $f differs from .clang-format (scripts/format.sh rewrites it)"
      bad=1
    fi
  done
  [[ $bad == 0 ]] && echo "format: ${#files[@]} files in the house style"
  exit $bad
fi
"$fmt" -i "${files[@]}"
