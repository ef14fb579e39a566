// The cuda_ipc key blob (cuda_ipc_key.h).
#include "transport/cuda_ipc/cuda_ipc_key.h"

#include <algorithm>

#include "common/checked.h"
#include "net/wire.h"

namespace kvbridge::transport {

std::string encode_cuda_ipc_key(const CudaIpcKey& key) {
  net::WireWriter w;
  w.u8(2);
  w.u32(key.device);
  w.str(key.uuid);
  w.u64(key.generation);
  w.str(key.why_not);
  w.u32(static_cast<uint32_t>(key.allocations.size()));
  for (const CudaIpcAllocation& a : key.allocations) {
    w.u64(a.base);
    w.u64(a.bytes);
    w.str(a.handle);
  }
  return w.take();
}

Result<CudaIpcKey> decode_cuda_ipc_key(std::string_view bytes) {
  net::WireReader r(bytes, "cuda_ipc key");
  uint8_t version = 0;
  KVB_RETURN_IF_ERROR(r.u8("version", &version));
  if (version != 2) return r.error("version " + std::to_string(version) + " is not 2");
  CudaIpcKey key;
  KVB_RETURN_IF_ERROR(r.u32("device", &key.device));
  KVB_RETURN_IF_ERROR(r.str("uuid", kMaxCudaIpcUuidBytes, &key.uuid));
  KVB_RETURN_IF_ERROR(r.u64("generation", &key.generation));
  KVB_RETURN_IF_ERROR(r.str("why_not", kMaxCudaIpcWhyNotBytes, &key.why_not));
  uint32_t n = 0;
  KVB_RETURN_IF_ERROR(r.count("allocations", kMaxCudaIpcAllocations, 20, &n));
  for (uint32_t i = 0; i < n; ++i) {
    CudaIpcAllocation a;
    KVB_RETURN_IF_ERROR(r.u64("allocation base", &a.base));
    KVB_RETURN_IF_ERROR(r.u64("allocation bytes", &a.bytes));
    KVB_RETURN_IF_ERROR(r.str("allocation handle", kMaxCudaIpcHandleBytes, &a.handle));
    if (a.handle.empty()) return r.error("allocation " + std::to_string(i) + " has an empty handle");
    if (a.bytes == 0) return r.error("allocation " + std::to_string(i) + " has 0 bytes");
    key.allocations.push_back(std::move(a));
  }
  KVB_RETURN_IF_ERROR(r.finish());
  if (!key.why_not.empty() && !key.allocations.empty()) {
    return Status::invalid_argument("cuda_ipc key: allocations listed for memory that cannot be exported");
  }
  return key;
}

Status check_cuda_ipc_key(const CudaIpcKey& key, uint64_t base, uint64_t bytes) {
  if (!key.why_not.empty()) return Status();
  uint64_t end = 0;
  if (!checked_add(base, bytes, &end)) return Status::invalid_argument("cuda_ipc key: the segment wraps around");
  uint64_t covered = base;  // every byte below this is in an allocation
  for (size_t i = 0; i < key.allocations.size(); ++i) {
    const CudaIpcAllocation& a = key.allocations[i];
    uint64_t a_end = 0;
    if (!checked_add(a.base, a.bytes, &a_end)) {
      return Status::invalid_argument("cuda_ipc key: allocation " + std::to_string(i) + " wraps around");
    }
    if (i > 0 && a.base < key.allocations[i - 1].base + key.allocations[i - 1].bytes) {
      return Status::invalid_argument("cuda_ipc key: allocation " + std::to_string(i) +
                                      " overlaps or precedes the one before it");
    }
    if (a.base > covered) {
      return Status::invalid_argument("cuda_ipc key: segment bytes from " + std::to_string(covered - base) +
                                      " are in no allocation");
    }
    covered = std::max(covered, a_end);
  }
  if (covered < end) {
    return Status::invalid_argument("cuda_ipc key: segment bytes from " + std::to_string(covered - base) +
                                    " are in no allocation");
  }
  return Status();
}

}  // namespace kvbridge::transport
