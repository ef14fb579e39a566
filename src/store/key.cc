// Chained block hashes: see kvbridge/store_key.h and docs/formats/store-object.md.
//
// Every input is encoded explicitly (little-endian integers, length-prefixed
// strings) before XXH3 sees it, so the keys do not depend on the host's byte
// order, on struct padding or on any per-process state. XXH3's output is
// specified to be identical on every platform (xxhash.h, "XXH3 ... stable").
#include <xxhash.h>

#include <algorithm>
#include <cstdio>
#include <numeric>

#include "kvbridge/store_key.h"

namespace kvbridge {
namespace {

void put_u64(std::string& out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}

void put_bytes(std::string& out, std::string_view s) {
  put_u64(out, s.size());
  out.append(s);
}

BlockHash from_xxh(XXH128_hash_t h) { return {h.low64, h.high64}; }

}  // namespace

std::string BlockHash::hex() const {
  char buf[33];
  std::snprintf(buf, sizeof(buf), "%016llx%016llx", static_cast<unsigned long long>(hi),
                static_cast<unsigned long long>(lo));
  return std::string(buf, 32);
}

std::string ObjectKey::text(std::string_view prefix) const {
  std::string s(prefix);
  s += hash.hex();
  s += '.';
  s += std::to_string(group);
  return s;
}

std::string ObjectKey::cluster_text(std::string_view prefix) const {
  std::string s(prefix);
  s += '{';
  s += hash.hex();
  s += '.';
  s += std::to_string(group);
  s += '}';
  return s;
}

uint16_t redis_key_slot(std::string_view key) {
  const size_t open = key.find('{');
  if (open != std::string_view::npos) {
    const size_t close = key.find('}', open + 1);
    if (close != std::string_view::npos && close > open + 1) key = key.substr(open + 1, close - open - 1);
  }
  uint16_t crc = 0;  // CRC16-CCITT (XMODEM): polynomial 0x1021, initial 0
  for (const char c : key) {
    crc ^= static_cast<uint16_t>(static_cast<uint8_t>(c)) << 8;
    for (int b = 0; b < 8; ++b) crc = static_cast<uint16_t>((crc & 0x8000) ? (crc << 1) ^ 0x1021 : crc << 1);
  }
  return crc & 16383;
}

BlockHash chain_seed(const Layout& layout, uint64_t hash_block_tokens, std::span<const std::string> extra_keys) {
  std::string in = "kvbridge.store/1\n";
  put_u64(in, hash_block_tokens);
  put_bytes(in, identity_text(layout));
  put_u64(in, extra_keys.size());
  for (const std::string& k : extra_keys) put_bytes(in, k);
  return from_xxh(XXH3_128bits(in.data(), in.size()));
}

std::vector<BlockHash> chain_hashes(const BlockHash& seed, uint64_t hash_block_tokens,
                                    std::span<const uint32_t> tokens) {
  std::vector<BlockHash> out;
  if (hash_block_tokens == 0) return out;
  const uint64_t n = tokens.size() / hash_block_tokens;
  out.reserve(n);
  // One buffer per block: the previous hash (16 bytes) then the tokens.
  std::vector<uint8_t> buf(16 + 4 * hash_block_tokens);
  BlockHash prev = seed;
  for (uint64_t j = 0; j < n; ++j) {
    uint8_t* p = buf.data();
    for (int i = 0; i < 8; ++i) p[i] = static_cast<uint8_t>(prev.lo >> (8 * i));
    for (int i = 0; i < 8; ++i) p[8 + i] = static_cast<uint8_t>(prev.hi >> (8 * i));
    p += 16;
    const uint32_t* t = tokens.data() + j * hash_block_tokens;
    for (uint64_t k = 0; k < hash_block_tokens; ++k, p += 4) {
      const uint32_t v = t[k];
      p[0] = static_cast<uint8_t>(v);
      p[1] = static_cast<uint8_t>(v >> 8);
      p[2] = static_cast<uint8_t>(v >> 16);
      p[3] = static_cast<uint8_t>(v >> 24);
    }
    prev = from_xxh(XXH3_128bits(buf.data(), buf.size()));
    out.push_back(prev);
  }
  return out;
}

std::vector<uint32_t> group_ids(const Layout& layout) {
  std::vector<size_t> order(layout.groups.size());
  std::iota(order.begin(), order.end(), size_t{0});
  std::stable_sort(order.begin(), order.end(),
                   [&](size_t a, size_t b) { return layout.groups[a].name < layout.groups[b].name; });
  std::vector<uint32_t> ids(layout.groups.size());
  for (size_t rank = 0; rank < order.size(); ++rank) ids[order[rank]] = static_cast<uint32_t>(rank);
  return ids;
}

}  // namespace kvbridge
