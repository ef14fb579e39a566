#!/usr/bin/env bash
# `kvbridge store` end to end across processes: a TP 8 instance with 32-token
# blocks puts a prefix into a real redis-server, a TP 2 instance with 16-token
# blocks in another process gets it and checks it byte for byte (so the keys
# agree across processes), stat sees it; the ranks of a TP 2 instance put as
# two processes (`put --rank`) and a TP 4 instance reads the objects they
# assembled in Redis, while one rank alone makes no hit; and bench prints the
# JSON rows.
# Usage: store_cli_test.sh path/to/kvbridge
set -euo pipefail
KVB="$1"
source "$(dirname "$0")/require.sh"
command -v redis-server >/dev/null || skip_unless_required redis "store_cli_test: redis-server is not installed"
PORT=$(python3 -c 'import socket; s=socket.socket(); s.bind(("127.0.0.1",0)); print(s.getsockname()[1])')
redis-server --port "$PORT" --bind 127.0.0.1 --save '' --appendonly no --loglevel warning >/dev/null 2>&1 &
RPID=$!
trap 'kill -9 $RPID 2>/dev/null || true; wait $RPID 2>/dev/null || true' EXIT
for _ in $(seq 100); do redis-cli -p "$PORT" ping >/dev/null 2>&1 && break; sleep 0.05; done

put=$("$KVB" store put --redis 127.0.0.1:"$PORT" --preset llama3-8b --tp 8 --block-tokens 32 --tokens 300 --json)
echo "put: $put"
get=$("$KVB" store get --redis 127.0.0.1:"$PORT" --preset llama3-8b --tp 2 --block-tokens 16 --tokens 300 --json)
echo "get: $get"
stat=$("$KVB" store stat --redis 127.0.0.1:"$PORT" --preset llama3-8b --tokens 300 --json)
echo "stat: $stat"
# Another prompt, or another salt of the key, misses.
miss=$("$KVB" store get --redis 127.0.0.1:"$PORT" --preset llama3-8b --tokens 300 --token-seed 2 --json)
python3 - "$put" "$get" "$stat" "$miss" <<'PY'
import json, sys
put, get, stat, miss = (json.loads(a) for a in sys.argv[1:5])
assert put["objects_published"] == 18 and put["redis_writes"] == 18 and put["redis_errors"] == 0, put
assert get["hit_tokens"] == 288 and get["bad_cells"] == 0 and get["cells_checked"] > 0, get
assert get["redis_objects"] == 18 and get["memory_objects"] == 18, get  # rank 0 fetches, rank 1 reads memory
assert stat["hit_tokens"] == 288 and stat["redis_keys"] == 18, stat
assert miss["hit_tokens"] == 0, miss
PY
# A Redis timeout without a Redis is refused by name.
rc=0; "$KVB" store get --redis-timeout-ms 5000 --tokens 16 --json >/dev/null 2>/tmp/kvb_store_err.$$ || rc=$?
[[ $rc -eq 1 ]] && grep -q -- "--redis-timeout-ms needs --redis or --redis-cluster" /tmp/kvb_store_err.$$ ||
  { echo "--redis-timeout-ms alone: rc $rc: $(cat /tmp/kvb_store_err.$$)" >&2; exit 1; }
rm -f /tmp/kvb_store_err.$$
# One process per rank: the parts meet in Redis. Both ranks at once, then a
# reader of another TP and block size. Prompt 3: only rank 0 puts, no hit.
# qwen3-next's state objects are 77 MB each (one every 64 tokens), so its
# prompt is shorter: two of them, checksummed inside Redis, which holds the
# other rank's part transaction for that pass (0.8-0.9 s each here, more
# under the sanitizers beside other tests): its commands get a longer
# timeout than the 2 s default.
for preset in llama3-8b qwen3-next; do
  n=256; [[ $preset == qwen3-next ]] && n=128
  t=(); [[ $preset == qwen3-next ]] && t=(--redis-timeout-ms 30000)
  "$KVB" store put --redis 127.0.0.1:"$PORT" --preset "$preset" --tp 2 --rank 0 "${t[@]}" --tokens $n --token-seed 5 --json >/tmp/kvb_store_r0.$$ &
  P0=$!
  "$KVB" store put --redis 127.0.0.1:"$PORT" --preset "$preset" --tp 2 --rank 1 "${t[@]}" --tokens $n --token-seed 5 --json >/tmp/kvb_store_r1.$$
  wait $P0
  r0=$(cat /tmp/kvb_store_r0.$$); r1=$(cat /tmp/kvb_store_r1.$$); rm -f /tmp/kvb_store_r0.$$ /tmp/kvb_store_r1.$$
  echo "rank puts ($preset): $r0 $r1"
  got=$("$KVB" store get --redis 127.0.0.1:"$PORT" --preset "$preset" --tp 4 --block-tokens 128 "${t[@]}" --tokens $n --token-seed 5 --json)
  echo "get at tp 4 ($preset): $got"
  "$KVB" store put --redis 127.0.0.1:"$PORT" --preset "$preset" --tp 2 --rank 0 "${t[@]}" --tokens $n --token-seed 3 --json >/dev/null
  half=$("$KVB" store get --redis 127.0.0.1:"$PORT" --preset "$preset" --tp 1 "${t[@]}" --tokens $n --token-seed 3 --json)
  python3 - "$r0" "$r1" "$got" "$half" "$n" <<'PY'
import json, sys
r0, r1, got, half = (json.loads(a) for a in sys.argv[1:5])
n = int(sys.argv[5])
assert r0["parts_written"] > 0 and r0["parts_written"] == r1["parts_written"], (r0, r1)
assert r0["objects_published"] + r1["objects_published"] == r0["parts_written"], (r0, r1)
assert r0["redis_errors"] == 0 and r1["redis_errors"] == 0, (r0, r1)
assert got["hit_tokens"] == n and got["bad_cells"] == 0 and got["cells_checked"] > 0, got
assert half["hit_tokens"] == 0, half
PY
done
# Redis gone: no hang and no crash, and not a quiet miss either: the
# figures come out, and the exit status and stderr say the tier was down.
kill -9 $RPID; wait $RPID 2>/dev/null || true
rc=0
down=$(timeout 20 "$KVB" store get --redis 127.0.0.1:"$PORT" --preset llama3-8b --tokens 300 --json 2>/tmp/kvb_store_err.$$) || rc=$?
python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["hit_tokens"]==0 and d["redis_errors"]>=1, d' "$down"
[[ $rc -eq 1 ]] || { echo "store get with Redis down exited $rc, not 1" >&2; exit 1; }
grep -q "unavailable: store: the shared tier at 127.0.0.1:$PORT could not be reached" /tmp/kvb_store_err.$$ ||
  { echo "store get with Redis down said: $(cat /tmp/kvb_store_err.$$)" >&2; exit 1; }
rm -f /tmp/kvb_store_err.$$
bench=$("$KVB" store bench --json --bench-mib 8 --repeat 1 --lookup-tokens 8192)
python3 - "$bench" <<'PY'
import json, sys
rows = json.loads(sys.argv[1])
assert isinstance(rows, list) and rows, rows
need = {"tier", "op", "value_bytes", "gbps", "baseline", "baseline_gbps", "ratio"}
for r in rows:
    assert need <= set(r), r
    assert r["gbps"] > 0 and r["baseline_gbps"] > 0, r
assert {(r["tier"], r["op"]) for r in rows} >= {("memory", "put"), ("memory", "get"), ("memory", "lookup"),
                                                ("disk", "put"), ("disk", "get"), ("disk", "get-cold"),
                                                ("redis", "put"), ("redis", "get")}, rows
PY
# The disk tier across processes: a TP 4 instance puts, a later process at
# TP 1 with another block size reads every byte from the files; a second
# store on the directory while one holds it is refused by name; a capacity
# smaller than the prefix keeps the files under it.
DISK=$(mktemp -d /tmp/kvb_store_disk.XXXXXX)
trap 'rm -rf "$DISK"; kill -9 $RPID 2>/dev/null || true' EXIT
put=$("$KVB" store put --disk "$DISK" --preset qwen3-next --tp 4 --tokens 256 --json)
python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["objects_published"]>0 and d["disk_writes"]==d["objects_published"], d' "$put"
got=$("$KVB" store get --disk "$DISK" --preset qwen3-next --tp 1 --block-tokens 128 --tokens 256 --json)
python3 -c 'import json,sys; d=json.loads(sys.argv[1]); assert d["hit_tokens"]==256 and d["memory_objects"]==0 and d["disk_objects"]>0 and d["bad_cells"]==0 and d["cells_checked"]>0, d' "$got"
exec 9>"$DISK/LOCK"; flock 9
rc=0; "$KVB" store get --disk "$DISK" --preset qwen3-next --tokens 256 --json >/dev/null 2>/tmp/kvb_store_err.$$ || rc=$?
exec 9>&-
[[ $rc -eq 1 ]] && grep -q "is in use by another store" /tmp/kvb_store_err.$$ ||
  { echo "a second store on one disk directory: rc $rc: $(cat /tmp/kvb_store_err.$$)" >&2; exit 1; }
rm -f /tmp/kvb_store_err.$$
"$KVB" store put --disk "$DISK" --disk-mib 8 --preset llama3-8b --tokens 2048 --json >/dev/null
used=$(find "$DISK" -type f ! -name LOCK -printf '%s\n' | awk '{s+=$1} END {print s+0}')
(( used > 0 && used <= 8 * 1024 * 1024 )) || { echo "disk tier of 8 MiB holds $used bytes" >&2; exit 1; }
# A bench killed mid-run takes its redis-server and redis-benchmark with it.
"$KVB" store bench --bench-mib 64 --repeat 3 > /dev/null 2>&1 &
BENCH=$!
children=""
for _ in $(seq 1 200); do
  children=$(pgrep -P "$BENCH" -d ' ' || true)
  [[ -n "$children" ]] && pgrep -P "$BENCH" -x redis-benchmark > /dev/null && break
  sleep 0.1
done
[[ -n "$children" ]] || { echo "store_cli_test: the bench started no child"; exit 1; }
kill -9 "$BENCH"; wait "$BENCH" 2>/dev/null || true
for _ in $(seq 1 30); do
  alive=""
  for c in $children; do
    state=$(awk '{print $3}' "/proc/$c/stat" 2>/dev/null || echo gone)
    [[ "$state" != gone && "$state" != Z ]] && alive="$alive $c"
  done
  [[ -z "$alive" ]] && break
  sleep 0.1
done
[[ -z "$alive" ]] || { echo "store_cli_test: children of a killed bench still run:$alive"; ps -o pid,stat,args -p ${alive// /,}; exit 1; }
echo "store_cli_test: ok"
