#!/usr/bin/env bash
# `kvbridge discovery` against a real etcd on loopback (started and stopped
# here): an instance registered by one process is listed and watched by
# others (added, then removed when the registering process is interrupted:
# its lease is revoked, nothing is left under the prefix); a bad record is
# refused naming the field; an etcd that is not there is a clear error, not
# a hang.
# Usage: discovery_cli_test.sh path/to/kvbridge
set -euo pipefail
KVB="$1"
source "$(dirname "$0")/require.sh"
command -v etcd >/dev/null || skip_unless_required etcd "discovery_cli_test: etcd is not installed"
"$KVB" discovery list --help >/dev/null 2>&1 || { echo "FAIL: kvbridge has no discovery subcommand"; exit 1; }
free_port() { python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])'; }
CPORT=$(free_port); PPORT=$(free_port)
DATA=$(mktemp -d /tmp/kvb_etcd.XXXXXX)
ETCD=http://127.0.0.1:$CPORT
etcd --data-dir "$DATA" --listen-client-urls "$ETCD" --advertise-client-urls "$ETCD" \
  --listen-peer-urls "http://127.0.0.1:$PPORT" --initial-advertise-peer-urls "http://127.0.0.1:$PPORT" \
  --initial-cluster "default=http://127.0.0.1:$PPORT" >"$DATA.log" 2>&1 &
EPID=$!
trap 'kill -9 $EPID ${WPID:-} ${RPID:-} 2>/dev/null || true; wait 2>/dev/null || true; rm -rf "$DATA" "$DATA.log" "$DATA.watch"' EXIT
for _ in $(seq 100); do curl -sf "$ETCD/health" >/dev/null 2>&1 && break; sleep 0.1; done

"$KVB" layout --preset llama3-8b --tp 2 --rank 0 > "$DATA/rank0.json"
"$KVB" discovery watch --etcd "$ETCD" --duration 6 > "$DATA.watch" 2>&1 &
WPID=$!
sleep 0.5
"$KVB" discovery register --etcd "$ETCD" --id prefill-7 --rank 127.0.0.1:7000 --rank 127.0.0.1:7001 \
  --layout "$DATA/rank0.json" > "$DATA/register.out" 2>&1 &
RPID=$!
listed=""
for _ in $(seq 50); do
  listed=$("$KVB" discovery list --etcd "$ETCD" --json 2>/dev/null || true)
  [[ "$listed" == *prefill-7* ]] && break
  sleep 0.1
done
python3 - "$listed" <<'PY'
import json, sys
rows = [json.loads(l) for l in sys.argv[1].splitlines() if l.strip()]  # one record per line
assert [r["id"] for r in rows] == ["prefill-7"], rows
assert rows[0]["ranks"] == ["127.0.0.1:7000", "127.0.0.1:7001"] and rows[0]["role"] == "prefill", rows
assert rows[0]["format"] == "kvbridge.instance/1" and len(rows[0]["identity"]) == 16, rows
PY
kill -INT $RPID; wait $RPID || { echo "FAIL: register did not exit cleanly on SIGINT: $(cat "$DATA/register.out")"; exit 1; }
wait $WPID || true
grep -q "^added prefill-7 prefill identity=[0-9a-f]\{16\} protocol=[0-9]* ranks=127.0.0.1:7000,127.0.0.1:7001" "$DATA.watch" ||
  { echo "FAIL: watch did not report the registration: $(cat "$DATA.watch")"; exit 1; }
grep -q "^removed prefill-7" "$DATA.watch" || { echo "FAIL: watch did not report the revoked lease: $(cat "$DATA.watch")"; exit 1; }
left=$("$KVB" discovery list --etcd "$ETCD" --json)
[[ "$left" != *prefill-7* ]] || { echo "FAIL: the key outlived its registration: $left"; exit 1; }

rc=0; "$KVB" discovery register --etcd "$ETCD" --id 'bad id' --rank 127.0.0.1:7000 --identity 0123456789abcdef \
  > /dev/null 2> "$DATA/err" || rc=$?
[[ $rc -ne 0 ]] && grep -q "'id'" "$DATA/err" || { echo "FAIL: a bad id (rc $rc): $(cat "$DATA/err")"; exit 1; }

kill -9 $EPID; wait $EPID 2>/dev/null || true
rc=0; timeout 20 "$KVB" discovery list --etcd "$ETCD" > /dev/null 2> "$DATA/err" || rc=$?
[[ $rc -eq 1 ]] && grep -q "unavailable" "$DATA/err" || { echo "FAIL: etcd gone: rc $rc: $(cat "$DATA/err")"; exit 1; }
echo "discovery_cli_test: ok"
