// The content hash kernel (kernels.h): one thread per 64 KiB leaf of a list
// of ranges, each hashing its leaf with the same XXH3-64 code the host fake
// runs (common/xxh3.h), so the fake's tests cover what the kernel computes.
#include "common/xxh3.h"
#include "device/kernels.h"

namespace kvbridge::device {
namespace {

__global__ void content_leaves(const KernelRange* ranges, uint32_t count, uint64_t leaves, uint64_t* out) {
  const uint64_t leaf = blockIdx.x * uint64_t{blockDim.x} + threadIdx.x;
  if (leaf >= leaves) return;
  // The range holding this leaf: the last whose first leaf is not past it.
  uint32_t lo = 0, hi = count;
  while (hi - lo > 1) {
    const uint32_t mid = (lo + hi) / 2;
    if (ranges[mid].first_leaf <= leaf) {
      lo = mid;
    } else {
      hi = mid;
    }
  }
  const KernelRange r = ranges[lo];
  out[leaf] = xxh3::content_leaf(reinterpret_cast<const void*>(r.address), r.bytes, leaf - r.first_leaf);
}

}  // namespace

cudaError_t launch_content_leaves(const KernelRange* ranges, uint32_t count, uint64_t leaves, uint64_t* out,
                                  cudaStream_t stream) {
  if (leaves == 0) return cudaSuccess;
  constexpr uint32_t kThreads = 128;
  const uint64_t blocks = (leaves + kThreads - 1) / kThreads;
  content_leaves<<<static_cast<unsigned>(blocks), kThreads, 0, stream>>>(ranges, count, leaves, out);
  return cudaGetLastError();
}

}  // namespace kvbridge::device
