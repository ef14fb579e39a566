#!/usr/bin/env bash
# Device memory across two "hosts" over tcp, staged through pinned host
# memory, against the same transport moving the same requests between host
# memory, in the same run. The prefill ranks run in one network namespace,
# the decode ranks in another (a veth pair between them); `kvbridge demo`
# moves and checks every byte of each request, once with --memory host and
# once with --memory cuda on the host fake (KVB_DEVICE=fake: its device
# memory is host memory behind the device seam, so the staging's extra
# copies are memcpys on this machine's cores, not a GPU's copy engines).
#
# Prints one row per model and request size: both throughputs (the demo's
# GB/s over its loads), the ratio staged / host, and the staged run's
# messages on the wire (tcp's bulk data frames: their mean size, and how
# many were under 1 MiB) and chunks staged (both sides).
#
# Usage: bench/staged_netns.sh PATH/TO/kvbridge [REQUESTS]   (root)
set -euo pipefail
kvb=${1:?usage: staged_netns.sh PATH/TO/kvbridge [REQUESTS]}
requests=${2:-4}
here=$(cd "$(dirname "$0")" && pwd)
skip() { echo "staged_netns: $*" >&2; exit 77; }

work=$(mktemp -d)
cleanup() {
  netns_cleanup
  rm -rf "$work"
}
trap cleanup EXIT
source "$here/../tests/netns_lib.sh"
netns_pair kvbs 10.233.0

run() {  # preset tokens memory -> "GB/s frames bytes small chunks"
  local out=$work/$1-$2-$3.json
  KVB_DEVICE=fake timeout 600 "$kvb" demo --json --no-progress --transport tcp --memory "$3" --preset "$1" \
    --requests "$requests" --min-tokens "$2" --max-tokens "$2" \
    --prefill-netns "$ns_a" --prefill-host 10.233.0.1 --decode-netns "$ns_b" --decode-host 10.233.0.2 \
    > "$out" 2> "$out.err" || { echo "staged_netns: the demo failed ($1, $2 tokens, $3):" >&2; tail -20 "$out" "$out.err" >&2; exit 1; }
  /usr/bin/python3 -c '
import json, sys
r = json.load(open(sys.argv[1]))
bad = [k for k in ("leaked_blocks", "stray_bytes", "verify_failures", "failed") if r[k] != 0]
assert not bad and r["clean"], f"not clean: {bad}"
print("%.3f %d %d %d %d" % (r["gbps"], r["wire_frames"], r["wire_bytes"], r["wire_small_frames"],
                           r["staged_chunks"]))' "$out"
}

printf '%-12s %7s %10s %12s %6s %13s %11s %14s\n' model tokens "host GB/s" "staged GB/s" ratio \
  "MiB/message" "<1 MiB" "chunks staged"
# llama3-70b holds 320 KiB of KV per token: 8k tokens is 2.7 GB a side,
# as much as this bench's machines hold twice over.
for row in "llama3-70b 8192" "qwen3-next 8192" "qwen3-next 32768"; do
  read -r preset tokens <<< "$row"
  read -r host _ <<< "$(run "$preset" "$tokens" host)"
  read -r staged frames bytes small chunks <<< "$(run "$preset" "$tokens" cuda)"
  ratio=$(/usr/bin/python3 -c "print('%.2f' % ($staged / $host))")
  mib=$(/usr/bin/python3 -c "print('%.2f' % ($bytes / max($frames, 1) / 1048576))")
  printf '%-12s %7s %10s %12s %6s %13s %11s %14s\n' "$preset" "$tokens" "$host" "$staged" "$ratio" "$mib" \
    "$small/$frames" "$chunks"
done
