// The gather/scatter kernel (kernels.h): one batched copy of many
// descriptors on the SMs, the alternative to the copy engines'
// cudaMemcpyBatchAsync. Each block takes descriptors in turn (block b takes
// b, b + gridDim.x, ...) and its threads copy 16-byte vectors when both
// addresses and the length are multiples of 16 (KV cells are), bytes
// otherwise. The grid is capped so a transfer never takes every SM from the
// model's kernels.
#include "device/kernels.h"

namespace kvbridge::device {
namespace {

__global__ void gather_scatter(const KernelCopy* descriptors, uint32_t count) {
  for (uint32_t i = blockIdx.x; i < count; i += gridDim.x) {
    const KernelCopy d = descriptors[i];
    if (((d.dst | d.src | d.bytes) & 15) == 0) {
      uint4* dst = reinterpret_cast<uint4*>(d.dst);
      const uint4* src = reinterpret_cast<const uint4*>(d.src);
      const uint64_t n = d.bytes / 16;
      for (uint64_t k = threadIdx.x; k < n; k += blockDim.x) dst[k] = src[k];
    } else {
      uint8_t* dst = reinterpret_cast<uint8_t*>(d.dst);
      const uint8_t* src = reinterpret_cast<const uint8_t*>(d.src);
      for (uint64_t k = threadIdx.x; k < d.bytes; k += blockDim.x) dst[k] = src[k];
    }
  }
}

}  // namespace

cudaError_t launch_gather_scatter(const KernelCopy* descriptors, uint32_t count, uint32_t max_blocks,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const uint32_t cap = max_blocks == 0 ? kDefaultCopyBlocks : max_blocks;
  const uint32_t blocks = count < cap ? count : cap;
  gather_scatter<<<blocks, 512, 0, stream>>>(descriptors, count);
  return cudaGetLastError();
}

}  // namespace kvbridge::device
