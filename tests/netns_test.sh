#!/usr/bin/env bash
# tcp between two network namespaces joined by a veth pair: the stand-in for
# two hosts. Creates namespaces kvb-a-PID and kvb-b-PID with 10.231.0.1/30 and
# 10.231.0.2/30 (nothing else is ever a target), runs a tcp_netns_peer server
# in one and a client in the other, then kills the server and checks that the
# client reports the peer gone within its deadline. Cleans up on any exit.
#
# Usage: netns_test.sh PATH/TO/tcp_netns_peer
# Exit 77 (ctest's SKIP_RETURN_CODE) with a printed reason when not root or
# when network namespaces cannot be created here (a failure when KVB_REQUIRE
# names netns: tests/require.sh).
set -euo pipefail
peer=${1:?usage: netns_test.sh PATH/TO/tcp_netns_peer}
source "$(dirname "$0")/require.sh"
skip() { skip_unless_required netns "netns_test: $*"; }

work=$(mktemp -d)
server_pid=
cleanup() {
  [[ -n $server_pid ]] && kill "$server_pid" 2>/dev/null && wait "$server_pid" 2>/dev/null
  netns_cleanup
  rm -rf "$work"
}
trap cleanup EXIT
source "$(dirname "$0")/netns_lib.sh"
netns_pair kvb 10.231.0

ip netns exec "$ns_a" "$peer" serve 10.231.0.1 "$work/server" &
server_pid=$!
for _ in $(seq 100); do
  [[ -s $work/server ]] && break
  kill -0 "$server_pid" 2>/dev/null || { echo "FAIL: the server exited"; exit 1; }
  sleep 0.1
done
[[ -s $work/server ]] || { echo "FAIL: the server did not start within 10 s"; exit 1; }
read -r address base bytes < "$work/server"
echo "server in $ns_a at $address"

echo "client in $ns_b:"
timeout 60 ip netns exec "$ns_b" "$peer" client 10.231.0.2 "$address" "$base" "$bytes"

kill "$server_pid"
wait "$server_pid" 2>/dev/null || true
server_pid=
echo "server killed; the client must report it gone:"
timeout 30 ip netns exec "$ns_b" "$peer" gone 10.231.0.2 "$address" "$base" "$bytes"
echo "PASS: netns_test"
