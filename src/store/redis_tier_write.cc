// The Redis tier's writes: put() of whole objects with sendmsg(2) from their
// own bytes, and put_parts(), each part in a MULTI/EXEC whose script publishes
// the completed object (see redis_tier.h and redis_tier.cc).
#include <hiredis/hiredis.h>
#include <sys/uio.h>

#include <cstring>

#include "store/redis_tier.h"
#include "store/redis_tier_io.h"

namespace kvbridge::store_internal {
namespace {

// Completes an object assembled under a staging key (KEYS[1]): once its part
// bitmap (bytes ARGV[2]..ARGV[3]) has ARGV[1] bits, it writes the payload's
// checksum into the header (the first 8 bytes of SHA-1 of bytes 64.., at
// offset 40, and flag bit 2 at offset 48: no rank holds the whole payload,
// so Redis, which does, computes it), then the staging key becomes the
// object key (KEYS[2]) without the staging TTL. Atomic with the part's
// writes (it runs inside their MULTI/EXEC), so exactly one transaction
// publishes and an object key never holds a partial or unchecksummed
// object. When the object exists already the staging key is dropped. (Lua
// 5.1 in Redis: string.char/tonumber build the bytes, `bit` sets the flag.)
constexpr const char* kCompleteScript =
    "if redis.call('EXISTS', KEYS[2]) == 1 then redis.call('DEL', KEYS[1]) return 2 end "
    "if redis.call('BITCOUNT', KEYS[1], ARGV[2], ARGV[3]) >= tonumber(ARGV[1]) then "
    "local h = redis.sha1hex(redis.call('GETRANGE', KEYS[1], 64, -1)) "
    "local b = {} for i = 0, 7 do b[i + 1] = string.char(tonumber(string.sub(h, 2 * i + 1, 2 * i + 2), 16)) end "
    "redis.call('SETRANGE', KEYS[1], 40, table.concat(b)) "
    "local f = string.byte(redis.call('GETRANGE', KEYS[1], 48, 48)) "
    "redis.call('SETRANGE', KEYS[1], 48, string.char(bit.bor(f, 4))) "
    "redis.call('RENAME', KEYS[1], KEYS[2]) redis.call('PERSIST', KEYS[2]) return 1 end "
    "return 0";

}  // namespace

size_t RedisTier::put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values,
                      std::vector<Redirect>* redirects, bool asking) {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  if (keys.empty()) return 0;
  if (!connect_locked() || !raw_ready_locked()) return 0;
  // Each SET goes out with sendmsg(2) from the value's own bytes (hiredis
  // would first copy the value into its output buffer); `depth` are in flight.
  const size_t depth = std::max<uint32_t>(1, options_.pipeline_depth);
  size_t written = 0, replied = 0;
  auto read_reply = [&] {
    std::string_view line;
    if (asking && (!read_line_locked(&line) || line != "+OK")) {
      fail_locked("ASKING reply");
      return false;
    }
    if (!read_line_locked(&line)) {
      fail_locked("SET reply");
      return false;
    }
    const size_t k = replied++;
    if (line == "+OK") {
      ++written;
      ++counters_.writes;
      return true;
    }
    Redirect r;
    if (redirects != nullptr && !line.empty() && line[0] == '-' && parse_redirect(line.substr(1), &r)) {
      r.index = k;
      redirects->push_back(std::move(r));
      return true;
    }
    fail_reply_locked(line.empty() || line[0] != '-' ? "SET: unexpected reply" : "SET error reply", line);
    return false;
  };
  static constexpr char kCrlf[] = "\r\n";
  for (size_t k = 0; k < keys.size(); ++k) {
    out_ = asking ? "*1\r\n$6\r\nASKING\r\n*3\r\n$3\r\nSET\r\n" : "*3\r\n$3\r\nSET\r\n";
    append_bulk(out_, keys[k]);
    out_ += '$';
    out_ += std::to_string(values[k].size());
    out_ += kCrlf;
    iovec iov[3] = {{out_.data(), out_.size()},
                    {const_cast<uint8_t*>(values[k].data()), values[k].size()},
                    {const_cast<char*>(kCrlf), 2}};
    if (!send_iov_locked(iov, 3)) {
      fail_locked("SET send");
      return written;
    }
    if (k + 1 - replied >= depth && !read_reply()) return written;
  }
  while (replied < keys.size()) {
    if (!read_reply()) return written;
  }
  return written;
}

std::vector<PartOutcome> RedisTier::put_parts(std::span<const PartWrite> parts, std::vector<Redirect>* redirects,
                                              bool asking) {
  std::vector<PartOutcome> out(parts.size(), PartOutcome::kFailed);
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  const size_t depth = std::max<uint32_t>(1, options_.pipeline_depth);
  const std::string ttl = std::to_string(std::max<int64_t>(1, options_.incomplete_ttl.count()));
  for (size_t i = 0; i < parts.size(); i += depth) {
    if (!connect_locked()) return out;
    const size_t end = std::min(parts.size(), i + depth);
    std::vector<size_t> replies(end - i);  // replies of each transaction
    for (size_t k = i; k < end; ++k) {
      const PartWrite& p = parts[k];
      size_t n = 0;
      auto append = [&](int argc, const char** argv, const size_t* lens) {
        ++n;
        return redisAppendCommandArgv(ctx_, argc, argv, lens) == REDIS_OK;
      };
      bool ok = true;
      if (asking) {
        const char* argv[1] = {"ASKING"};
        const size_t lens[1] = {6};
        ok = ok && append(1, argv, lens);
      }
      {
        const char* argv[1] = {"MULTI"};
        const size_t lens[1] = {5};
        ok = ok && append(1, argv, lens);
      }
      auto setrange = [&](uint64_t begin, uint64_t end_byte) {
        const std::string off = std::to_string(begin);
        const char* argv[4] = {"SETRANGE", p.staging_key.data(), off.data(),
                               reinterpret_cast<const char*>(p.object + begin)};
        const size_t lens[4] = {8, p.staging_key.size(), off.size(), end_byte - begin};
        return append(4, argv, lens);
      };
      // The range that ends last goes first, so the staging string grows
      // once per part: SETRANGE past a string's end reallocates it (and
      // Redis grows a large string by only 1 MB beyond what is asked), so
      // ranges in address order would copy the string once per range, O(n^2)
      // in one transaction that blocks the server (for a 77 MB state object
      // in 72 ranges, the SETRANGEs Redis logged as slow took 200-270 ms
      // each, and the cluster marked the node failed).
      size_t last = 0;
      for (size_t r = 1; r < p.ranges.size(); ++r) {
        if (p.ranges[r].second > p.ranges[last].second) last = r;
      }
      if (!p.ranges.empty()) ok = ok && setrange(p.ranges[last].first, p.ranges[last].second);
      if (p.header_bytes) ok = ok && setrange(0, p.header_bytes);
      for (size_t r = 0; r < p.ranges.size(); ++r) {
        if (r != last) ok = ok && setrange(p.ranges[r].first, p.ranges[r].second);
      }
      const std::string bit = std::to_string(p.part_bit);
      {
        const char* argv[4] = {"SETBIT", p.staging_key.data(), bit.data(), "1"};
        const size_t lens[4] = {6, p.staging_key.size(), bit.size(), 1};
        ok = ok && append(4, argv, lens);
      }
      {
        const char* argv[3] = {"PEXPIRE", p.staging_key.data(), ttl.data()};
        const size_t lens[3] = {7, p.staging_key.size(), ttl.size()};
        ok = ok && append(3, argv, lens);
      }
      {
        const std::string count = std::to_string(p.parts), b0 = std::to_string(p.bitmap_byte_begin),
                          b1 = std::to_string(p.bitmap_byte_end);
        const char* argv[8] = {"EVAL",       kCompleteScript, "2",      p.staging_key.data(), p.object_key.data(),
                               count.data(), b0.data(),       b1.data()};
        const size_t lens[8] = {4,
                                std::strlen(kCompleteScript),
                                1,
                                p.staging_key.size(),
                                p.object_key.size(),
                                count.size(),
                                b0.size(),
                                b1.size()};
        ok = ok && append(8, argv, lens);
      }
      {
        const char* argv[1] = {"EXEC"};
        const size_t lens[1] = {4};
        ok = ok && append(1, argv, lens);
      }
      if (!ok) {
        fail_locked("append");
        return out;
      }
      replies[k - i] = n;
    }
    for (size_t k = i; k < end; ++k) {
      bool redirected = false;
      for (size_t r = 0; r < replies[k - i]; ++r) {
        void* raw = nullptr;
        if (redisGetReply(ctx_, &raw) != REDIS_OK) {
          fail_locked("part transaction");
          return out;
        }
        Reply reply(static_cast<redisReply*>(raw));
        if (reply->type == REDIS_REPLY_ERROR) {
          // A queued command refused for a redirect (cluster): EXEC answers
          // EXECABORT and nothing of this part is written; the caller
          // retries it where the redirect says.
          Redirect rd;
          if (redirects != nullptr && !redirected && parse_redirect(std::string_view(reply->str, reply->len), &rd)) {
            rd.index = k;
            redirects->push_back(std::move(rd));
            redirected = true;
            continue;
          }
          if (redirected) continue;  // EXECABORT of the redirected transaction
          // A queued command rejected (e.g. OOM): EXEC aborts the whole
          // transaction; nothing of this part was written.
          fail_reply_locked("part transaction error reply", std::string_view(reply->str, reply->len));
          return out;
        }
        if (redirected) continue;
        if (r + 1 < replies[k - i]) continue;
        // EXEC: an array whose last element is the script's result.
        if (reply->type != REDIS_REPLY_ARRAY || reply->elements == 0 ||
            reply->element[reply->elements - 1]->type != REDIS_REPLY_INTEGER) {
          fail_locked("part transaction: unexpected EXEC reply");
          return out;
        }
        const long long v = reply->element[reply->elements - 1]->integer;
        out[k] = v == 1 ? PartOutcome::kPublished : v == 2 ? PartOutcome::kPresent : PartOutcome::kWritten;
        if (v == 0 || v == 1) ++counters_.parts;
        if (v == 1) ++counters_.writes;
      }
    }
  }
  return out;
}

}  // namespace kvbridge::store_internal
