// device/gather.h: how the gather/scatter kernel copies a batch, in code
// that runs on the device (copy_kernel.cu) and on the host (the fake
// device runs the same cut and the same per-lane copy), so a bug in either
// shows in CI without a GPU.
//
// The host cuts each copy into pieces of at most kPieceBytes (cut()), so a
// large copy spreads over many warps and many small ones each get a warp.
// A warp takes a piece (pieces are handed out warp by warp across the
// grid), and its lanes copy it (copy_piece()): the bytes before the
// destination's first aligned word one per lane, the aligned middle in
// words of the widest width both addresses share modulo 16 (16 bytes for
// KV cells), kInFlight loads per lane issued before their stores, then the
// tail bytes. Lanes read consecutive words, so a warp reads 512 contiguous
// bytes per load.
//
// Thread-safety: pure functions over the caller's memory.
#pragma once

#include <cstdint>
#include <vector>

#if defined(__CUDACC__)
#define KVB_GATHER_FN __host__ __device__ __forceinline__
#else
#define KVB_GATHER_FN inline
#endif

namespace kvbridge::device::gather {

// One piece, as it sits in device memory for the kernel.
struct Piece {
  uint64_t dst = 0;
  uint64_t src = 0;
  uint64_t bytes = 0;
};

inline constexpr uint64_t kPieceBytes = uint64_t{64} << 10;
inline constexpr unsigned kWarpLanes = 32;
inline constexpr unsigned kInFlight = 8;  // loads per lane before their stores

// How many pieces cut() makes of copies of these sizes.
inline uint64_t pieces_of(uint64_t bytes) { return (bytes + kPieceBytes - 1) / kPieceBytes; }

// Appends the pieces of one copy (none for an empty one).
inline void cut(uint64_t dst, uint64_t src, uint64_t bytes, std::vector<Piece>* out) {
  for (uint64_t at = 0; at < bytes; at += kPieceBytes) {
    const uint64_t n = bytes - at < kPieceBytes ? bytes - at : kPieceBytes;
    out->push_back(Piece{dst + at, src + at, n});
  }
}

// A 16-byte word: uint4 on the device, two u64 on the host.
#if defined(__CUDACC__)
using Word16 = uint4;
#else
struct alignas(16) Word16 {
  uint64_t lo, hi;
};
#endif
struct alignas(8) Word8 {
  uint64_t v;
};

// Lane `lane` of `lanes` copies its share of `n` words of type W.
template <class W>
KVB_GATHER_FN void copy_words(uint8_t* dst, const uint8_t* src, uint64_t n, unsigned lane, unsigned lanes) {
  W* d = reinterpret_cast<W*>(dst);
  const W* s = reinterpret_cast<const W*>(src);
  uint64_t k = lane;
  const uint64_t stride = uint64_t{lanes} * kInFlight;
  for (; k + uint64_t{kInFlight - 1} * lanes < n; k += stride) {
    W v[kInFlight];
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (unsigned j = 0; j < kInFlight; ++j) v[j] = s[k + uint64_t{j} * lanes];
#if defined(__CUDACC__)
#pragma unroll
#endif
    for (unsigned j = 0; j < kInFlight; ++j) d[k + uint64_t{j} * lanes] = v[j];
  }
  for (; k < n; k += lanes) d[k] = s[k];
}

// The width of the middle's words: the widest power of two up to 16 that
// the destination and the source share modulo 16.
KVB_GATHER_FN unsigned word_bytes(uint64_t dst, uint64_t src) {
  const uint64_t apart = (dst ^ src) & 15;
  if (apart == 0) return 16;
  if ((apart & 7) == 0) return 8;
  if ((apart & 3) == 0) return 4;
  if ((apart & 1) == 0) return 2;
  return 1;
}

// Lane `lane` of `lanes` copies its share of piece `p`: the head bytes up
// to the destination's first `word_bytes()`-aligned byte, the middle in
// words, the tail bytes.
KVB_GATHER_FN void copy_piece(const Piece& p, unsigned lane, unsigned lanes) {
  auto* dst = reinterpret_cast<uint8_t*>(p.dst);
  const auto* src = reinterpret_cast<const uint8_t*>(p.src);
  const unsigned w = word_bytes(p.dst, p.src);
  uint64_t head = (w - (p.dst & (w - 1))) & (w - 1);
  if (head > p.bytes) head = p.bytes;
  for (uint64_t k = lane; k < head; k += lanes) dst[k] = src[k];
  const uint64_t words = (p.bytes - head) / w;
  uint8_t* md = dst + head;
  const uint8_t* ms = src + head;
  switch (w) {
    case 16:
      copy_words<Word16>(md, ms, words, lane, lanes);
      break;
    case 8:
      copy_words<Word8>(md, ms, words, lane, lanes);
      break;
    case 4:
      copy_words<uint32_t>(md, ms, words, lane, lanes);
      break;
    case 2:
      copy_words<uint16_t>(md, ms, words, lane, lanes);
      break;
    default:
      copy_words<uint8_t>(md, ms, words, lane, lanes);
      break;
  }
  const uint64_t done = head + words * w;
  for (uint64_t k = done + lane; k < p.bytes; k += lanes) dst[k] = src[k];
}

}  // namespace kvbridge::device::gather
