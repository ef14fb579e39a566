# Sourced by the network-namespace tests: two namespaces joined by a veth
# pair, the stand-in for two hosts, removed again on exit.
#
#   source netns_lib.sh
#   netns_pair PREFIX SUBNET     # e.g. netns_pair kvb 10.231.0
#
# Requires a `skip` function (exit 77 with a reason). Sets ns_a, ns_b (named
# PREFIX-a-PID, PREFIX-b-PID) with SUBNET.1/30 and SUBNET.2/30, and the veth
# ends veth_a, veth_b. Skips when not root, when `ip` is missing, or when
# namespaces cannot be created here. Callers that trap EXIT themselves call
# netns_cleanup from their handler.

netns_cleanup() {
  # Each may already be gone (deleting a namespace deletes its veth end).
  if [[ -n ${ns_a:-} ]]; then ip netns del "$ns_a" 2>/dev/null || true; fi
  if [[ -n ${ns_b:-} ]]; then ip netns del "$ns_b" 2>/dev/null || true; fi
  if [[ -n ${veth_a:-} ]]; then ip link del "$veth_a" 2>/dev/null || true; fi
}

netns_pair() {
  local prefix=$1 subnet=$2 err
  [[ $(id -u) -eq 0 ]] || skip "needs root to create network namespaces (uid $(id -u))"
  command -v ip >/dev/null || skip "the ip command (iproute2) is not installed"
  ns_a=$prefix-a-$$
  ns_b=$prefix-b-$$
  veth_a=${prefix}a$$
  veth_b=${prefix}b$$
  if ! err=$(ip netns add "$ns_a" 2>&1); then
    ns_a=
    skip "cannot create a network namespace: $err"
  fi
  ip netns add "$ns_b"
  ip link add "$veth_a" type veth peer name "$veth_b"
  ip link set "$veth_a" netns "$ns_a"
  ip link set "$veth_b" netns "$ns_b"
  ip -n "$ns_a" addr add "$subnet.1/30" dev "$veth_a"
  ip -n "$ns_b" addr add "$subnet.2/30" dev "$veth_b"
  for ns in "$ns_a" "$ns_b"; do ip -n "$ns" link set lo up; done
  ip -n "$ns_a" link set "$veth_a" up
  ip -n "$ns_b" link set "$veth_b" up
}
