// transport/cuda_ipc/cuda_ipc_key.h: the key blob a cuda_ipc segment carries
// in the engine metadata (docs/formats/engine-metadata.md, docs/gpu.md),
// and its bounded decoder: a peer's bytes, so the decoder is fuzzed
// (fuzz/cuda_ipc_key_fuzz.cc).
//
//   u8  version (2)
//   u32 device            the exporter's device ordinal (cuda:N)
//   str uuid              the exporter's device UUID (0..16 bytes: empty
//                         when the exporter could not ask), which names
//                         the device in the importer, whose ordinals may
//                         differ (CUDA_VISIBLE_DEVICES)
//   u64 generation        the exporter's registration number, never reused
//   str why_not           empty, or why the memory cannot be exported
//   u32 count             allocations (0 when why_not is set), at most 32
//   count x { u64 base, u64 bytes, str handle (1..128 bytes) }
//
// Integers little-endian, str = u32 length + bytes (net/wire.h).
//
// Thread-safety: pure functions.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::transport {

inline constexpr size_t kMaxCudaIpcAllocations = 32;
inline constexpr size_t kMaxCudaIpcHandleBytes = 128;
inline constexpr size_t kMaxCudaIpcWhyNotBytes = 512;
inline constexpr size_t kMaxCudaIpcUuidBytes = 16;

struct CudaIpcAllocation {
  uint64_t base = 0;  // in the exporter's address space
  uint64_t bytes = 0;
  std::string handle;
};

struct CudaIpcKey {
  uint32_t device = 0;
  std::string uuid;
  uint64_t generation = 0;
  std::string why_not;
  std::vector<CudaIpcAllocation> allocations;
};

std::string encode_cuda_ipc_key(const CudaIpcKey& key);
// kInvalidArgument (kResourceExhausted past a bound) naming the field.
Result<CudaIpcKey> decode_cuda_ipc_key(std::string_view bytes);
// That the allocations are in order, do not overlap, and cover the segment
// [base, base + bytes) (unless why_not is set). kInvalidArgument otherwise.
Status check_cuda_ipc_key(const CudaIpcKey& key, uint64_t base, uint64_t bytes);

}  // namespace kvbridge::transport
