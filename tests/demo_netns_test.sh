#!/usr/bin/env bash
# The demo across two "hosts": the prefill ranks in one network namespace,
# the decode ranks in another, joined by a veth pair, over tcp and over ucx
# (UCX_TLS=tcp). Creates namespaces kvbd-a-PID / kvbd-b-PID with
# 10.232.0.1/30 and 10.232.0.2/30, runs `kvbridge demo --json` for each
# transport and checks the report is clean with every request verified.
# Cleans up on any exit.
#
# Usage: demo_netns_test.sh PATH/TO/kvbridge
# Exit 77 (ctest's SKIP_RETURN_CODE) with a printed reason when not root or
# when network namespaces cannot be created here (a failure when KVB_REQUIRE
# names netns; a ucx that cannot run fails when it names ucx).
set -euo pipefail
kvb=${1:?usage: demo_netns_test.sh PATH/TO/kvbridge}
source "$(dirname "$0")/require.sh"
skip() { skip_unless_required netns "demo_netns_test: $*"; }

work=$(mktemp -d)
cleanup() {
  netns_cleanup
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/netns_lib.sh"
netns_pair kvbd 10.232.0

status=0
for transport in tcp ucx; do
  out=$work/$transport.json
  if ! UCX_TLS=tcp timeout 180 "$kvb" demo --json --no-progress --transport "$transport" --requests 3 \
       --prefill-netns "$ns_a" --prefill-host 10.232.0.1 --decode-netns "$ns_b" --decode-host 10.232.0.2 \
       > "$out" 2> "$work/$transport.err"; then
    if [[ $transport == ucx ]] && grep -q "transport 'ucx' cannot run here" "$out" "$work/$transport.err"; then
      if kvb_required ucx; then
        echo "FAIL: ucx: the ucx transport cannot run here, and KVB_REQUIRE asks for ucx"
        status=1
      else
        echo "SKIP: ucx: the ucx transport cannot run here"
      fi
      continue
    fi
    echo "FAIL: $transport: the demo exited non-zero"; cat "$out" "$work/$transport.err" | tail -40
    status=1
    continue
  fi
  if ! /usr/bin/python3 - "$out" "$transport" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
t = sys.argv[2]
bad = [k for k in ("leaked_blocks", "stray_bytes", "verify_failures", "double_frees", "failed") if r[k] != 0]
assert not bad and r["ok"] == 3 and r["clean"], f"{t}: {bad}: {json.dumps(r)[:1500]}"
print(f"ok   {t} across namespaces: {r['ok']} requests verified, {r['bytes']} bytes, {r['gbps']:.2f} GB/s, "
      f"{r['handshakes']} handshakes")
PY
  then
    status=1
  fi
done
exit $status
