#!/usr/bin/env bash
# Layer-wise streaming of device memory, run by hand on a GPU machine (the
# device check, scripts/gpu-check.sh, leaves it out to stay short):
# kvbridge demo --memory cuda --stream layer, TP 1 -> TP 1, each rank
# process on its own core, for the request sizes whose TTFT the host's one
# memory bus limits (docs/connector.md, "When streaming pays"): qwen3-next at
# 16k and 32k tokens, llama3-70b at 8k. The prefill's KV goes to the device
# layer by layer and the decode reads it over cuda_ipc (the copy engine), so
# the writes and the reads do not share the host's memory bus. Each run
# prints its report (TTFT streamed and unstreamed, the exposed transfer);
# the summary lines are repeated at the end. Exit status: the first run's
# that failed, 0 when every run was clean.
#
#   bash scripts/gpu-stream.sh build-gpu/tools/kvbridge [extra demo flags]
#
# KVB_STREAM_MEMORY=host runs the same on host memory over cma (a rehearsal
# on a machine without a GPU).
set -uo pipefail
cli=${1:?usage: gpu-stream.sh path/to/kvbridge [demo flags]}
shift
memory=${KVB_STREAM_MEMORY:-cuda}
common=(demo --memory "$memory" --prefill-tp 1 --decode-tp 1 --pin-cores --stream layer --requests 6 --no-progress "$@")
runs=(
  "qwen3-next 16384 600"
  "qwen3-next 32768 1500"
  "llama3-70b 8192 4000"
)
rc=0
summary=()
for r in "${runs[@]}"; do
  read -r preset tokens us <<<"$r"
  echo "--- $preset, $tokens tokens, $us us per layer"
  out=$("$cli" "${common[@]}" --preset "$preset" --compute-us-per-layer "$us" --min-tokens "$tokens" \
    --max-tokens "$tokens" 2>&1)
  status=$?
  echo "$out"
  ((status != 0 && rc == 0)) && rc=$status
  summary+=("$preset $tokens tokens $us us: $(grep -m1 -E '^  TTFT' <<<"$out" | sed 's/^  TTFT *//') rc $status")
done
echo "--- summary ($memory memory)"
for line in "${summary[@]}"; do echo "$line"; done
exit $rc
