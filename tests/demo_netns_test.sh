#!/usr/bin/env bash
# The demo across two "hosts": the prefill ranks in one network namespace,
# the decode ranks in another, joined by a veth pair, over tcp and over ucx
# (UCX_TLS=tcp). Creates namespaces kvbd-a-PID / kvbd-b-PID with
# 10.232.0.1/30 and 10.232.0.2/30, runs `kvbridge demo --json` for each
# transport and checks the report is clean with every request verified; then
# over tcp again with an etcd in the prefill namespace, where the decode ranks
# find the prefill instance instead of being given its addresses (when etcd
# is installed; a failure when KVB_REQUIRE names etcd).
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
etcd_pid=""
cleanup() {
  if [[ -n $etcd_pid ]]; then kill "$etcd_pid" 2>/dev/null || true; fi
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

# Device memory across the namespaces (the host fake's): tcp stages it
# through pinned host memory on both sides, streamed layer by layer behind
# a slow producer kernel, so a stage read before its layer landed would fail
# the check.
out=$work/device.json
if ! KVB_DEVICE=fake timeout 180 "$kvb" demo --json --no-progress --transport tcp --memory cuda --requests 3 \
     --stream layer --producer-delay-us 2000 \
     --prefill-netns "$ns_a" --prefill-host 10.232.0.1 --decode-netns "$ns_b" --decode-host 10.232.0.2 \
     > "$out" 2> "$work/device.err"; then
  echo "FAIL: tcp, device memory: the demo exited non-zero"; cat "$out" "$work/device.err" | tail -40
  status=1
elif ! /usr/bin/python3 - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
bad = [k for k in ("leaked_blocks", "stray_bytes", "verify_failures", "double_frees", "failed") if r[k] != 0]
assert not bad and r["ok"] >= 3 and r["clean"], f"{bad}: {json.dumps(r)[:1500]}"
assert r["staged_chunks"] > 0, "device memory crossed without staging"
print(f"ok   tcp, device memory staged across namespaces: {r['ok']} requests verified, {r['bytes']} bytes, "
      f"{r['staged_chunks']} chunks staged, {r['wire_bytes'] / max(r['wire_frames'], 1) / 1048576:.2f} MiB a message")
PY
then
  status=1
fi

# Discovery across the namespaces: etcd listens on the prefill side's address.
if command -v etcd >/dev/null; then
  ip netns exec "$ns_a" etcd --data-dir "$work/etcd" --listen-client-urls http://10.232.0.1:23790 \
    --advertise-client-urls http://10.232.0.1:23790 --listen-peer-urls http://127.0.0.1:23800 \
    --initial-advertise-peer-urls http://127.0.0.1:23800 --initial-cluster default=http://127.0.0.1:23800 \
    > "$work/etcd.log" 2>&1 &
  etcd_pid=$!
  for _ in $(seq 100); do
    ip netns exec "$ns_b" curl -sf http://10.232.0.1:23790/health >/dev/null 2>&1 && break
    sleep 0.1
  done
  out=$work/etcd.json
  if ! timeout 180 "$kvb" demo --json --no-progress --transport tcp --requests 3 --etcd http://10.232.0.1:23790 \
       --prefill-netns "$ns_a" --prefill-host 10.232.0.1 --decode-netns "$ns_b" --decode-host 10.232.0.2 \
       > "$out" 2> "$work/etcd.err"; then
    echo "FAIL: tcp with etcd: the demo exited non-zero"; cat "$out" "$work/etcd.err" "$work/etcd.log" | tail -40
    status=1
  elif ! /usr/bin/python3 - "$out" <<'PY'
import json, sys
r = json.load(open(sys.argv[1]))
assert r["clean"] and r["ok"] == 3 and r["discovered"] == 4, json.dumps(r)[:1500]
print(f"ok   tcp across namespaces, the prefill instance found through etcd by {r['discovered']} decode ranks "
      f"(slowest {r['discovery_ms_max']:.1f} ms): {r['ok']} requests verified")
PY
  then
    status=1
  fi
  kill "$etcd_pid" 2>/dev/null || true
  wait "$etcd_pid" 2>/dev/null || true
elif kvb_required etcd; then
  echo "FAIL: etcd is not installed, and KVB_REQUIRE asks for etcd"
  status=1
else
  echo "SKIP: tcp with etcd: etcd is not installed"
fi
exit $status
