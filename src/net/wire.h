// net/wire.h: the one codec for every kvbridge wire format: little-endian
// fixed-width integers and length-prefixed byte strings.
//
// WireReader is the bounded cursor every decoder of peer bytes uses. Each
// read checks the bytes left first; each length or count is checked against
// its bound and against the bytes left before anything is allocated for it,
// so no number a peer chooses sizes an allocation. Errors are
// kInvalidArgument (kResourceExhausted for a bound) and name the thing being
// decoded, the field and the offset: "Hello frame: truncated at nonce
// (needs 32 bytes, 4 left, offset 5 of 9)".
//
// Thread-safety: values; one thread at a time.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::net {

class WireWriter {
 public:
  void u8(uint8_t v) { put(v, 1); }
  void u16(uint16_t v) { put(v, 2); }
  void u32(uint32_t v) { put(v, 4); }
  void u64(uint64_t v) { put(v, 8); }
  void raw(std::string_view bytes) { out_.append(bytes); }
  template <size_t N>
  void array(const std::array<uint8_t, N>& a) {
    out_.append(reinterpret_cast<const char*>(a.data()), N);
  }
  // A u32 byte length, then the bytes. Requires s.size() < 2^32.
  void str(std::string_view s) {
    u32(static_cast<uint32_t>(s.size()));
    out_.append(s);
  }
  std::string& out() { return out_; }
  std::string take() { return std::move(out_); }

 private:
  void put(uint64_t v, int n) {
    for (int i = 0; i < n; ++i) out_.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
  }
  std::string out_;
};

class WireReader {
 public:
  // `what` names the bytes in errors ("Metadata frame", "engine metadata").
  WireReader(std::string_view in, std::string what) : in_(in), what_(std::move(what)) {}

  Status u8(std::string_view field, uint8_t* v) { return get(field, 1, v); }
  Status u16(std::string_view field, uint16_t* v) { return get(field, 2, v); }
  Status u32(std::string_view field, uint32_t* v) { return get(field, 4, v); }
  Status u64(std::string_view field, uint64_t* v) { return get(field, 8, v); }
  // Exactly `n` bytes, as a view into the input.
  Status raw(std::string_view field, size_t n, std::string_view* out);
  template <size_t N>
  Status array(std::string_view field, std::array<uint8_t, N>* a) {
    std::string_view v;
    KVB_RETURN_IF_ERROR(raw(field, N, &v));
    for (size_t i = 0; i < N; ++i) (*a)[i] = static_cast<uint8_t>(v[i]);
    return Status();
  }
  // A u32 length, checked against `max` (kResourceExhausted) and the bytes
  // left, then the bytes.
  Status str(std::string_view field, size_t max, std::string* out);
  Status str_view(std::string_view field, size_t max, std::string_view* out);
  // A u32 count of entries of at least `min_entry_bytes` each, checked
  // against `max` and against what the bytes left can hold.
  Status count(std::string_view field, size_t max, size_t min_entry_bytes, uint32_t* out);
  // OK when every byte was read; else an error naming the trailing bytes.
  Status finish() const;

  size_t left() const { return in_.size() - pos_; }
  size_t offset() const { return pos_; }
  // kInvalidArgument "<what>: <message> (offset P of N)".
  Status error(std::string_view message) const;

 private:
  template <typename T>
  Status get(std::string_view field, int n, T* v) {
    KVB_RETURN_IF_ERROR(need(field, static_cast<size_t>(n)));
    uint64_t x = 0;
    for (int i = 0; i < n; ++i) x |= uint64_t{static_cast<uint8_t>(in_[pos_ + i])} << (8 * i);
    pos_ += static_cast<size_t>(n);
    *v = static_cast<T>(x);
    return Status();
  }
  Status need(std::string_view field, uint64_t n) const;

  std::string_view in_;
  std::string what_;
  size_t pos_ = 0;
};

}  // namespace kvbridge::net
