# Sourced by the shell tests: skip for a capability this machine lacks,
# unless the run requires it. KVB_REQUIRE is a comma-separated list
# ("cma,ucx,netns,redis", set by .ci/run; the same variable the C++ and
# Python tests read): a skip for a listed capability is a failure instead,
# so CI cannot pass by skipping.

# Whether KVB_REQUIRE names $1.
kvb_required() { [[ ",${KVB_REQUIRE:-}," == *",$1,"* ]]; }

# skip_unless_required CAPABILITY REASON...: exit 77 (ctest's
# SKIP_RETURN_CODE) with the reason, or exit 1 when the capability is required.
skip_unless_required() {
  local capability=$1
  shift
  if kvb_required "$capability"; then
    echo "FAIL: $*, and KVB_REQUIRE asks for $capability"
    exit 1
  fi
  echo "SKIP: $*"
  exit 77
}
