#!/usr/bin/env bash
# Runs every benchmark binary of a build (BUILD_DIR/bench/*_bench): the Google
# Benchmark ones with tabular counters, keeping each run's JSON next to the
# binary, and a summary table of the planner's figures; the plain programs
# (cma_shape_bench) as they are; then `kvbridge bench`.
# Usage: scripts/bench.sh BUILD_DIR [ARGS...]. ARGS (e.g.
# --benchmark_filter=llama) go to the Google Benchmark binaries, and only
# those run.
set -euo pipefail
build=${1:?usage: scripts/bench.sh BUILD_DIR [benchmark args...]}
shift
shopt -s nullglob
binaries=("$build"/bench/*_bench)
if [[ ${#binaries[@]} -eq 0 ]]; then
  echo "bench: no benchmarks in $build/bench (is libbenchmark-dev installed? configure with -DKVB_BENCH=ON)" >&2
  exit 1
fi
# Aligns tab-separated columns (awk, so no extra package is needed).
align() {
  awk -F'\t' '{ for (i = 1; i <= NF; i++) { cell[NR, i] = $i; if (length($i) > w[i]) w[i] = length($i) }
                 if (NF > nf) nf = NF }
               END { for (r = 1; r <= NR; r++) { line = ""
                       for (i = 1; i <= nf; i++) line = line sprintf(i == 1 ? "%-*s" : "  %*s", w[i], cell[r, i])
                       print line } }'
}

status=0
for bin in "${binaries[@]}"; do
  [[ -x "$bin" ]] || continue
  name=$(basename "$bin")
  json="$build/bench/$name.json"
  # A Google Benchmark binary lists its benchmarks; a plain program refuses the flag.
  if ! "$bin" --benchmark_list_tests=true >/dev/null 2>&1; then
    [[ $# -eq 0 ]] || continue
    echo "== $name"
    if ! "$bin"; then
      echo "bench: $name FAILED" >&2
      status=1
    fi
    continue
  fi
  echo "== $name"
  if ! "$bin" --benchmark_counters_tabular=true --benchmark_out="$json" --benchmark_out_format=json "$@"; then
    echo "bench: $name FAILED" >&2
    status=1
    continue
  fi
  if [[ $name == plan_bench ]] && command -v jq >/dev/null && [[ -s "$json" ]]; then
    echo
    echo "-- $name summary (plan_pct = plan time / memcpy time of the same bytes, target <= 2%)"
    jq -r '
      def r(x; n): if x == null then "-" else (x * pow(10; n) | round / pow(10; n) | tostring) end;
      ["benchmark", "descriptors", "bytes", "plan_ms", "memcpy_ms", "plan_pct", "B/desc", "naive", "naive_x",
       "layer_blocks", "layer_blocks_x"],
      (.benchmarks[] | select(.run_type != "aggregate") |
       [(.name | sub("^BM_Plan/"; "")), r(.descriptors; 0), r(.bytes; 0), r(.plan_ms; 3), r(.memcpy_ms; 1),
        r(.plan_pct; 3), r(.B_per_desc; 1), r(.naive; 0), r(.naive_x; 1), r(.layer_blocks; 0),
        r(.layer_blocks_x; 1)])
      | @tsv' "$json" | align
  fi
done

# The engine and its transports against their baselines (kvbridge bench; the
# table ends with a verdict per target), when no ARGS narrowed the run.
[[ $# -eq 0 ]] || exit $status
echo "== kvbridge bench"
if ! "$build"/tools/kvbridge bench; then
  echo "bench: kvbridge bench FAILED" >&2
  status=1
fi
exit $status
