// libFuzzer target for the engine metadata decoder (docs/formats/engine-metadata.md):
// decode_metadata() must never crash, hang, or allocate beyond what the
// input can describe; every error names what is wrong; and whatever it
// accepts re-encodes to exactly the same bytes (the encoding is canonical).
// A broken round trip traps, so the fuzzer reports it as a crash.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "engine/metadata.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  kvbridge::Result<kvbridge::engine_internal::EngineMetadata> m = kvbridge::engine_internal::decode_metadata(bytes);
  if (!m.has_value()) {
    if (m.error().message().empty()) __builtin_trap();
    return 0;
  }
  if (!kvbridge::engine_internal::check_metadata(*m).ok()) __builtin_trap();
  kvbridge::Result<std::string> again = kvbridge::engine_internal::encode_metadata(*m);
  if (!again.has_value() || *again != bytes) __builtin_trap();
  return 0;
}
