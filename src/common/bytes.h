// common/bytes.h: a scan of plain memory shared by the tools and tests that
// check a buffer is untouched (a sentinel, a fill value).
#pragma once

#include <cstdint>
#include <span>

namespace kvbridge {

struct OtherBytes {
  uint64_t count = 0;  // bytes that are not the value
  uint64_t first = 0;  // offset of the first of them; the size when none
};

// The bytes of `bytes` that are not `value`. Compares a page at a time
// (memcmp against a page of `value`) and byte by byte only in a page that
// differs, so a clean buffer is scanned at memory speed in every build, the
// sanitizer builds included (a byte loop there is instrumented per byte).
OtherBytes other_bytes(std::span<const uint8_t> bytes, uint8_t value);

}  // namespace kvbridge
