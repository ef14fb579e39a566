// The gather/scatter kernel (kernels.h): one batched copy of many pieces on
// the SMs, the alternative to the copy engines' cudaMemcpyBatchAsync. Each
// warp takes pieces in turn (warp w of the grid takes w, w + warps, ...)
// and its lanes copy a piece as gather.h says (the same code the fake runs
// on the host). The grid is capped so a transfer never takes every SM from
// the model's kernels.
#include "device/gather.h"
#include "device/kernels.h"

namespace kvbridge::device {
namespace {

constexpr unsigned kThreads = 512;
constexpr unsigned kWarpsPerBlock = kThreads / gather::kWarpLanes;

__global__ void __launch_bounds__(kThreads) gather_scatter(const gather::Piece* pieces, uint32_t count) {
  const unsigned lane = threadIdx.x % gather::kWarpLanes;
  const uint64_t warps = uint64_t{gridDim.x} * kWarpsPerBlock;
  for (uint64_t i = uint64_t{blockIdx.x} * kWarpsPerBlock + threadIdx.x / gather::kWarpLanes; i < count; i += warps) {
    const gather::Piece p = pieces[i];
    gather::copy_piece(p, lane, gather::kWarpLanes);
  }
}

}  // namespace

cudaError_t launch_gather_scatter(const gather::Piece* pieces, uint32_t count, uint32_t max_blocks,
                                  cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  const uint32_t cap = max_blocks == 0 ? kDefaultCopyBlocks : max_blocks;
  const uint32_t wanted = (count + kWarpsPerBlock - 1) / kWarpsPerBlock;
  const uint32_t blocks = wanted < cap ? wanted : cap;
  gather_scatter<<<blocks, kThreads, 0, stream>>>(pieces, count);
  return cudaGetLastError();
}

}  // namespace kvbridge::device
