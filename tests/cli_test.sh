#!/usr/bin/env bash
# End-to-end tests of the kvbridge command-line tool.
# Usage: cli_test.sh PATH/TO/kvbridge
# Each check prints "ok" or "FAIL" with what went wrong; the exit status is
# 1 when any check failed, else 0.
set -u

KVB=${1:?usage: cli_test.sh PATH/TO/kvbridge}
PYTHON=/usr/bin/python3
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
failures=0

ok() { echo "ok   - $1"; }
fail() { echo "FAIL - $1"; failures=$((failures + 1)); }

# expect NAME WANT_RC CMD...: runs CMD, keeps stdout/stderr in $TMP/out, $TMP/err.
expect() {
  local name=$1 want=$2
  shift 2
  "$@" >"$TMP/out" 2>"$TMP/err"
  local rc=$?
  if [[ $rc -eq $want ]]; then
    ok "$name"
  else
    fail "$name: exit $rc, wanted $want; stderr: $(head -c 400 "$TMP/err")"
  fi
}

# contains NAME FILE TEXT: FILE contains TEXT.
contains() {
  if grep -qF -- "$3" "$2"; then ok "$1"; else fail "$1: '$3' not in $(head -c 400 "$2")"; fi
}

# 1. A preset's layout, piped into validate, is valid.
if "$KVB" layout --preset glm5-flash --tp 4 --rank 1 | "$KVB" validate - >"$TMP/out" 2>"$TMP/err"; then
  ok "glm5-flash tp 4 rank 1 validates through a pipe"
else
  fail "glm5-flash tp 4 rank 1 does not validate: $(head -c 400 "$TMP/err")"
fi
contains "validate names the model and rank" "$TMP/out" "valid: glm5-flash tp 1/4"
contains "validate prints the compatibility hash" "$TMP/out" "compatibility hash "

# 2. A tail moved past the end of its tensor is caught, naming the component.
"$KVB" layout --preset glm5-flash --tp 4 --rank 1 >"$TMP/glm5.json"
"$PYTHON" - "$TMP/glm5.json" "$TMP/broken.json" <<'EOF'
import json, sys
layout = json.load(open(sys.argv[1]))
sizes = {t["name"]: t["bytes"] for t in layout["tensors"]}
tail_group = next(g for g in layout["groups"] if g["name"] == "indexer_tail")
component = next(c for c in tail_group["layers"][0]["components"] if c["name"] == "tail")
component["offset"] = sizes[component["tensor"]] + 1
json.dump(layout, open(sys.argv[2], "w"))
EOF
expect "a tail past its tensor fails validation with exit 1" 1 "$KVB" validate "$TMP/broken.json"
contains "the error names component 'tail'" "$TMP/err" "component 'tail'"
contains "the error names the group" "$TMP/err" "group 'indexer_tail'"

# 3. An unknown preset fails clearly.
expect "an unknown preset fails with exit 1" 1 "$KVB" layout --preset no-such-model
contains "the error names the unknown preset" "$TMP/err" "no-such-model"
contains "the error lists the known presets" "$TMP/err" "llama3-8b"

# 4. Every preset prints valid layouts, in every order, compact or not.
"$KVB" presets >"$TMP/presets"
presets=$(awk '{print $1}' "$TMP/presets")
[[ -n $presets ]] && ok "presets lists names" || fail "presets lists nothing"
for preset in $presets; do
  for order in LBHNC LBNHC BLHNC; do
    if "$KVB" layout --preset "$preset" --tp 2 --rank 1 --order "$order" --compact \
        | "$KVB" validate - >"$TMP/out" 2>"$TMP/err"; then
      ok "$preset $order validates"
    else
      fail "$preset $order: $(head -c 400 "$TMP/err")"
    fi
  done
done
"$KVB" layout --preset llama3-8b --compact >"$TMP/compact.json"
[[ $(wc -l <"$TMP/compact.json") -eq 1 ]] && ok "--compact prints one line" \
  || fail "--compact printed $(wc -l <"$TMP/compact.json") lines"

# 5. Identity: same hash across TP sizes, and the identity text is printed.
"$KVB" layout --preset qwen3-next --tp 1 >"$TMP/q1.json"
"$KVB" layout --preset qwen3-next --tp 8 --rank 3 --order BLHNC >"$TMP/q8.json"
expect "identity of a layout file succeeds" 0 "$KVB" identity "$TMP/q1.json"
cp "$TMP/out" "$TMP/id1"
contains "identity prints the hash" "$TMP/id1" "compatibility hash "
"$KVB" identity "$TMP/q8.json" >"$TMP/id8" 2>&1
cmp -s "$TMP/id1" "$TMP/id8" && ok "identity is the same at TP 1 and TP 8" \
  || fail "identity differs between TP 1 and TP 8"
[[ $(wc -l <"$TMP/id1") -gt 1 ]] && ok "identity prints the identity text" \
  || fail "identity printed no identity text"

# 6. A request validates too.
cat >"$TMP/request.json" <<'EOF'
{"format": "kvbridge.request/1", "num_tokens": 40, "skip_tokens": 0,
 "blocks": {"full": {"local": [7, 8, 9], "remote": [40, 41, 42]}}}
EOF
expect "a request validates" 0 "$KVB" validate "$TMP/request.json"
contains "validate says it is a request" "$TMP/out" "request"

# 7. Bad options and usage.
expect "a TP size that does not divide the heads fails with exit 1" 1 \
  "$KVB" layout --preset llama3-8b --tp 3
contains "the error names --tp" "$TMP/err" "--tp"
expect "a bad order is a usage error" 2 "$KVB" layout --preset llama3-8b --order XYZ
expect "a missing --preset is a usage error" 2 "$KVB" layout
expect "no subcommand is a usage error" 2 "$KVB"
expect "an unknown subcommand is a usage error" 2 "$KVB" frobnicate
contains "the error names the unknown command" "$TMP/err" "unknown command 'frobnicate'"
expect "a negative block size is a usage error" 2 "$KVB" layout --preset llama3-8b --block-tokens=-1
contains "the error quotes the value" "$TMP/err" "'-1' is not a whole number"
expect "zero requests is a usage error" 2 "$KVB" demo --requests 0
contains "the error names the bound" "$TMP/err" "'0' is not a whole number of at least 1"
expect "an unknown transport is a usage error" 2 "$KVB" demo --transport rdma
expect "an unknown fault is a usage error" 2 "$KVB" demo --inject kill
contains "the error lists the faults" "$TMP/err" "kill-prefill"
expect "an unknown failure policy is a usage error" 2 "$KVB" demo --policy retry
expect "a demo side's TP size that does not divide the heads fails with exit 1" 1 \
  "$KVB" demo --prefill-tp 3 --requests 1 --no-progress
contains "the error names the demo's option" "$TMP/err" "--prefill-tp 3"
expect "a missing file fails with exit 1" 1 "$KVB" validate "$TMP/none.json"
echo '{"format": "kvbridge.layout/1"' >"$TMP/bad.json"
expect "malformed JSON fails with exit 1" 1 "$KVB" validate "$TMP/bad.json"

# 7b. An input past the 64 MiB bound is refused while it is read, not after
# all of it sits in memory.
head -c $((96 << 20)) /dev/zero | /usr/bin/time -f "%M" -o "$TMP/rss" "$KVB" validate - >"$TMP/out" 2>"$TMP/err"
[[ $? -eq 1 ]] && ok "96 MiB on stdin fails with exit 1" || fail "96 MiB on stdin: exit not 1"
contains "the error names the bound" "$TMP/err" "larger than 64 MiB"
rss_kib=$(tail -1 "$TMP/rss")
# Three times the input: were it read whole, the peak would grow by ~200 MiB;
# stopping at the bound, it stays where it was (compared in the same run, so
# a sanitizer build's larger footprint does not matter).
head -c $((288 << 20)) /dev/zero | /usr/bin/time -f "%M" -o "$TMP/rss3" "$KVB" validate - >/dev/null 2>&1 || true
rss3_kib=$(tail -1 "$TMP/rss3")
(( rss3_kib < rss_kib + 65536 )) && ok "reading stops at the bound (max RSS ${rss_kib} KiB for 96 MiB, ${rss3_kib} KiB for 288 MiB)" ||
  fail "max RSS ${rss_kib} KiB for 96 MiB but ${rss3_kib} KiB for 288 MiB: the input was read whole"

# 7c. Who reads whom: glm5-flash decode TP 2 from prefill TP 4 (MLA and
# indexer replicated, KDA state sharded): each decode rank reads the two
# prefill ranks holding its KDA heads, and each prefill rank has one reader.
for r in 0 1 2 3; do "$KVB" layout --preset glm5-flash --tp 4 --rank $r --num-blocks 8 --compact >"$TMP/p$r.json"; done
for r in 0 1; do "$KVB" layout --preset glm5-flash --tp 2 --rank $r --num-blocks 8 --compact >"$TMP/d$r.json"; done
expect "readers" 0 "$KVB" readers --compact --local "$TMP/d0.json" "$TMP/d1.json" \
  --remote "$TMP/p0.json" "$TMP/p1.json" "$TMP/p2.json" "$TMP/p3.json"
contains "decode rank 1 reads prefill ranks 2 and 3 only" "$TMP/out" '{"rank":1,"source_ranks":[2,3]}'
contains "prefill rank 2 has one reader, decode rank 1" "$TMP/out" '{"rank":2,"readers":1,"reader_ranks":[1]}'
expect "readers without a rank holding a needed head" 1 "$KVB" readers --local "$TMP/d1.json" \
  --remote "$TMP/p0.json" "$TMP/p1.json" "$TMP/p2.json"
contains "the error names the local rank and the head" "$TMP/err" "local rank 1"

# 8. --help works for the tool and each subcommand.
expect "--help" 0 "$KVB" --help
contains "--help lists the subcommands" "$TMP/out" "layout"
for cmd in layout presets validate identity plan readers; do
  expect "$cmd --help" 0 "$KVB" "$cmd" --help
  [[ -s $TMP/out ]] && ok "$cmd --help prints help" || fail "$cmd --help printed nothing"
done

echo "$failures failure(s)"
exit $((failures > 0 ? 1 : 0))
