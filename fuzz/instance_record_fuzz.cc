// libFuzzer target for parse_instance_record() (docs/discovery.md): the
// records under an etcd prefix are written by whoever can write to etcd.
// It must never crash, hang or allocate beyond the input's bound; every
// error names what is wrong; and whatever it accepts serializes and parses
// back to the same record, signed or not; a signed record is taken under
// its secret and refused under another. A broken round trip traps, so the
// fuzzer reports it as a crash.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/discovery.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  kvbridge::Result<kvbridge::InstanceRecord> r = kvbridge::parse_instance_record(text);
  if (!r.has_value()) {
    if (r.error().message().empty()) __builtin_trap();
    return 0;
  }
  if (!kvbridge::check_instance_record(*r).ok()) __builtin_trap();
  kvbridge::Result<std::string> json = kvbridge::instance_record_to_json(*r);
  if (!json.has_value()) __builtin_trap();
  kvbridge::Result<kvbridge::InstanceRecord> again = kvbridge::parse_instance_record(*json);
  if (!again.has_value() || !(*again == *r)) __builtin_trap();
  // Under a secret: what it signs it takes back; another secret refuses it.
  kvbridge::Result<std::string> signed_json = kvbridge::instance_record_to_json(*r, "fuzz-secret-0123456789");
  if (!signed_json.has_value()) __builtin_trap();
  again = kvbridge::parse_instance_record(*signed_json, "fuzz-secret-0123456789");
  if (!again.has_value() || !(*again == *r)) __builtin_trap();
  if (kvbridge::parse_instance_record(*signed_json, "another-secret-01234567").has_value()) __builtin_trap();
  // The input itself, under a secret it was not signed with, is refused.
  if (kvbridge::parse_instance_record(text, "fuzz-secret-0123456789-not-this").has_value()) __builtin_trap();
  return 0;
}
