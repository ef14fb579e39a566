// common/xxh3.h: XXH3-64 (seed 0, the default secret) in plain integer
// code that compiles for the host and, under nvcc, for the device, so that a
// kernel and the host fake hash device memory with one function. It equals
// libxxhash's XXH3_64bits() for every input (common_test checks every length
// up to 2 KiB and a spread of larger ones, at every alignment); it reads
// bytes one at a time where it cannot know their alignment, so it is a
// reference, not the fast path: host code hashes with libxxhash.
//
// The content check's hash (content_hash(), transport/copies.h) is a tree
// over it: each kContentLeafBytes of a range is a leaf, hashed alone, and
// the range's hash is XXH3-64 of its leaves' hashes (little-endian u64s,
// in order). Leaves hash in parallel on a device.
//
// Thread-safety: pure functions.
#pragma once

#include <cstddef>
#include <cstdint>

#if defined(__CUDACC__)
#define KVB_HD __host__ __device__
#else
#define KVB_HD
#endif

namespace kvbridge::xxh3 {

inline constexpr uint64_t kContentLeafBytes = uint64_t{1} << 16;

namespace detail {

inline constexpr uint64_t kP32_1 = 0x9E3779B1u, kP32_2 = 0x85EBCA77u, kP32_3 = 0xC2B2AE3Du;
inline constexpr uint64_t kP64_1 = 0x9E3779B185EBCA87ull, kP64_2 = 0xC2B2AE3D27D4EB4Full,
                          kP64_3 = 0x165667B19E3779F9ull, kP64_4 = 0x85EBCA77C2B2AE63ull,
                          kP64_5 = 0x27D4EB2F165667C5ull;
inline constexpr size_t kSecretSize = 192;

KVB_HD inline uint64_t secret_word(size_t i) {
  // XXH3's default secret (kSecret), as 24 little-endian u64s.
  constexpr uint64_t k[24] = {
      0xbe4ba423396cfeb8ull, 0x1cad21f72c81017cull, 0xdb979083e96dd4deull, 0x1f67b3b7a4a44072ull, 0x78e5c0cc4ee679cbull,
      0x2172ffcc7dd05a82ull, 0x8e2443f7744608b8ull, 0x4c263a81e69035e0ull, 0xcb00c391bb52283cull, 0xa32e531b8b65d088ull,
      0x4ef90da297486471ull, 0xd8acdea946ef1938ull, 0x3f349ce33f76faa8ull, 0x1d4f0bc7c7bbdcf9ull, 0x3159b4cd4be0518aull,
      0x647378d9c97e9fc8ull, 0xc3ebd33483acc5eaull, 0xeb6313faffa081c5ull, 0x49daf0b751dd0d17ull, 0x9e68d429265516d3ull,
      0xfca1477d58be162bull, 0xce31d07ad1b8f88full, 0x280416958f3acb45ull, 0x7e404bbbcafbd7afull};
  return k[i];
}
KVB_HD inline uint8_t secret(size_t i) { return static_cast<uint8_t>(secret_word(i / 8) >> (8 * (i % 8))); }

KVB_HD inline uint64_t read64(const uint8_t* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | p[i];
  return v;
}
KVB_HD inline uint32_t read32(const uint8_t* p) {
  return static_cast<uint32_t>(p[0]) | static_cast<uint32_t>(p[1]) << 8 | static_cast<uint32_t>(p[2]) << 16 |
         static_cast<uint32_t>(p[3]) << 24;
}
KVB_HD inline uint64_t secret64(size_t at) {
  if (at % 8 == 0) return secret_word(at / 8);
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | secret(at + static_cast<size_t>(i));
  return v;
}
KVB_HD inline uint32_t secret32(size_t at) { return static_cast<uint32_t>(secret64(at)); }

KVB_HD inline uint64_t rotl(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }
KVB_HD inline uint64_t swap64(uint64_t x) {
  uint64_t out = 0;
  for (int i = 0; i < 8; ++i) out = (out << 8) | ((x >> (8 * i)) & 0xff);
  return out;
}

KVB_HD inline uint64_t mul128_fold64(uint64_t a, uint64_t b) {
#if defined(__CUDA_ARCH__)
  return (a * b) ^ __umul64hi(a, b);
#else
  const unsigned __int128 p = static_cast<unsigned __int128>(a) * b;
  return static_cast<uint64_t>(p) ^ static_cast<uint64_t>(p >> 64);
#endif
}

KVB_HD inline uint64_t xxh64_avalanche(uint64_t h) {
  h ^= h >> 33;
  h *= kP64_2;
  h ^= h >> 29;
  h *= kP64_3;
  h ^= h >> 32;
  return h;
}
KVB_HD inline uint64_t avalanche(uint64_t h) {
  h ^= h >> 37;
  h *= 0x165667919E3779F9ull;
  h ^= h >> 32;
  return h;
}
KVB_HD inline uint64_t rrmxmx(uint64_t h, uint64_t len) {
  h ^= rotl(h, 49) ^ rotl(h, 24);
  h *= 0x9FB21C651E98DF25ull;
  h ^= (h >> 35) + len;
  h *= 0x9FB21C651E98DF25ull;
  return h ^ (h >> 28);
}
KVB_HD inline uint64_t mix16(const uint8_t* in, size_t s) {
  return mul128_fold64(read64(in) ^ secret64(s), read64(in + 8) ^ secret64(s + 8));
}

KVB_HD inline uint64_t upto16(const uint8_t* in, size_t len) {
  if (len > 8) {
    const uint64_t lo = read64(in) ^ (secret64(24) ^ secret64(32));
    const uint64_t hi = read64(in + len - 8) ^ (secret64(40) ^ secret64(48));
    return avalanche(len + swap64(lo) + hi + mul128_fold64(lo, hi));
  }
  if (len >= 4) {
    const uint64_t in64 = read32(in + len - 4) + (static_cast<uint64_t>(read32(in)) << 32);
    return rrmxmx(in64 ^ (secret64(8) ^ secret64(16)), len);
  }
  if (len > 0) {
    const uint32_t combined = (static_cast<uint32_t>(in[0]) << 16) | (static_cast<uint32_t>(in[len >> 1]) << 24) |
                              static_cast<uint32_t>(in[len - 1]) | (static_cast<uint32_t>(len) << 8);
    return xxh64_avalanche(static_cast<uint64_t>(combined) ^ static_cast<uint64_t>(secret32(0) ^ secret32(4)));
  }
  return xxh64_avalanche(secret64(56) ^ secret64(64));
}

KVB_HD inline uint64_t upto128(const uint8_t* in, size_t len) {
  uint64_t acc = len * kP64_1;
  if (len > 32) {
    if (len > 64) {
      if (len > 96) {
        acc += mix16(in + 48, 96);
        acc += mix16(in + len - 64, 112);
      }
      acc += mix16(in + 32, 64);
      acc += mix16(in + len - 48, 80);
    }
    acc += mix16(in + 16, 32);
    acc += mix16(in + len - 32, 48);
  }
  acc += mix16(in, 0);
  acc += mix16(in + len - 16, 16);
  return avalanche(acc);
}

KVB_HD inline uint64_t upto240(const uint8_t* in, size_t len) {
  uint64_t acc = len * kP64_1;
  const size_t rounds = len / 16;
  for (size_t i = 0; i < 8; ++i) acc += mix16(in + 16 * i, 16 * i);
  acc = avalanche(acc);
  for (size_t i = 8; i < rounds; ++i) acc += mix16(in + 16 * i, 16 * (i - 8) + 3);
  acc += mix16(in + len - 16, 136 - 17);
  return avalanche(acc);
}

KVB_HD inline void accumulate512(uint64_t* acc, const uint8_t* in, size_t s) {
  for (size_t i = 0; i < 8; ++i) {
    const uint64_t v = read64(in + 8 * i);
    const uint64_t key = v ^ secret64(s + 8 * i);
    acc[i ^ 1] += v;
    acc[i] += (key & 0xFFFFFFFFull) * (key >> 32);
  }
}

KVB_HD inline uint64_t long_hash(const uint8_t* in, size_t len) {
  uint64_t acc[8] = {kP32_3, kP64_1, kP64_2, kP64_3, kP64_4, kP32_2, kP64_5, kP32_1};
  constexpr size_t kStripes = (kSecretSize - 64) / 8;  // per block
  constexpr size_t kBlock = 64 * kStripes;
  const size_t blocks = (len - 1) / kBlock;
  for (size_t n = 0; n < blocks; ++n) {
    for (size_t s = 0; s < kStripes; ++s) accumulate512(acc, in + n * kBlock + s * 64, s * 8);
    for (size_t i = 0; i < 8; ++i) {
      uint64_t a = acc[i];
      a ^= a >> 47;
      a ^= secret64(kSecretSize - 64 + 8 * i);
      a *= kP32_1;
      acc[i] = a;
    }
  }
  const size_t stripes = ((len - 1) - kBlock * blocks) / 64;
  for (size_t s = 0; s < stripes; ++s) accumulate512(acc, in + blocks * kBlock + s * 64, s * 8);
  accumulate512(acc, in + len - 64, kSecretSize - 64 - 7);
  uint64_t result = len * kP64_1;
  for (size_t i = 0; i < 4; ++i) {
    result += mul128_fold64(acc[2 * i] ^ secret64(11 + 16 * i), acc[2 * i + 1] ^ secret64(11 + 16 * i + 8));
  }
  return avalanche(result);
}

}  // namespace detail

// XXH3_64bits(data, len).
KVB_HD inline uint64_t hash64(const void* data, size_t len) {
  const uint8_t* in = static_cast<const uint8_t*>(data);
  if (len <= 16) return detail::upto16(in, len);
  if (len <= 128) return detail::upto128(in, len);
  if (len <= 240) return detail::upto240(in, len);
  return detail::long_hash(in, len);
}

// The content hash's leaves of a range of `bytes`, and the hash of leaf
// `leaf` of the range at `data`.
KVB_HD inline uint64_t content_leaves(uint64_t bytes) { return (bytes + kContentLeafBytes - 1) / kContentLeafBytes; }
KVB_HD inline uint64_t content_leaf(const void* data, uint64_t bytes, uint64_t leaf) {
  const uint64_t at = leaf * kContentLeafBytes;
  const uint64_t n = bytes - at < kContentLeafBytes ? bytes - at : kContentLeafBytes;
  return hash64(static_cast<const uint8_t*>(data) + at, static_cast<size_t>(n));
}
// The range's hash from its leaves' hashes (a little-endian host's u64s).
KVB_HD inline uint64_t content_root(const uint64_t* leaves, uint64_t count) {
  return hash64(leaves, static_cast<size_t>(count * sizeof(uint64_t)));
}

}  // namespace kvbridge::xxh3
