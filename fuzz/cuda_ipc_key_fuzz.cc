// libFuzzer target for the cuda_ipc key decoder (a peer's bytes in its
// engine metadata; src/transport/cuda_ipc/cuda_ipc_key.h): decode must never
// crash or allocate beyond what the input describes, every error names what
// is wrong, what it accepts re-encodes to the same bytes, and the coverage
// check of an accepted key against any segment never crashes.
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

#include "transport/cuda_ipc/cuda_ipc_key.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  const std::string_view bytes(reinterpret_cast<const char*>(data), size);
  kvbridge::Result<kvbridge::transport::CudaIpcKey> key = kvbridge::transport::decode_cuda_ipc_key(bytes);
  if (!key.has_value()) {
    if (key.error().message().empty()) __builtin_trap();
    return 0;
  }
  if (kvbridge::transport::encode_cuda_ipc_key(*key) != bytes) __builtin_trap();
  const uint64_t base = key->allocations.empty() ? 0 : key->allocations.front().base;
  for (uint64_t bytes_of : {uint64_t{1}, uint64_t{4096}, UINT64_MAX}) {
    const kvbridge::Status s = kvbridge::transport::check_cuda_ipc_key(*key, base, bytes_of);
    if (!s.ok() && s.message().empty()) __builtin_trap();
  }
  return 0;
}
