// The Redis tier's reads: exists() through hiredis, get() straight from the
// socket into the sink's buffers (see redis_tier.h and redis_tier.cc).
#include <hiredis/hiredis.h>
#include <sys/socket.h>

#include <cerrno>
#include <cstring>

#include "store/redis_tier.h"
#include "store/redis_tier_io.h"

namespace kvbridge::store_internal {
namespace {

// Values bigger than this are received straight into their buffer; smaller
// ones (and the rest of a large one below this) through in_, which also
// picks up the next replies' headers in the same recv.
constexpr uint64_t kDirectBytes = 64 << 10;
// One recv into a value at most this much, so the caller's checksum of the
// range reads it from cache.
constexpr uint64_t kChunkBytes = 256 << 10;

}  // namespace

std::vector<uint8_t> RedisTier::exists(std::span<const std::string> keys, std::vector<Redirect>* redirects,
                                       bool asking) {
  std::vector<uint8_t> out(keys.size(), 0);
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  // EXISTS is tiny: pipeline deeper than the value-sized commands.
  const size_t depth = 1024;
  for (size_t i = 0; i < keys.size(); i += depth) {
    if (!connect_locked()) return out;
    const size_t end = std::min(keys.size(), i + depth);
    for (size_t k = i; k < end; ++k) {
      const char* argv[2] = {"EXISTS", keys[k].data()};
      const size_t lens[2] = {6, keys[k].size()};
      const char* ask[1] = {"ASKING"};
      const size_t ask_len[1] = {6};
      if ((asking && redisAppendCommandArgv(ctx_, 1, ask, ask_len) != REDIS_OK) ||
          redisAppendCommandArgv(ctx_, 2, argv, lens) != REDIS_OK) {
        fail_locked("append");
        return std::vector<uint8_t>(keys.size(), 0);
      }
    }
    for (size_t k = i; k < end; ++k) {
      for (int n = asking ? 2 : 1; n > 0; --n) {
        void* r = nullptr;
        if (redisGetReply(ctx_, &r) != REDIS_OK) {
          fail_locked("EXISTS");
          return std::vector<uint8_t>(keys.size(), 0);
        }
        Reply reply(static_cast<redisReply*>(r));
        if (n == 2) continue;  // ASKING's +OK
        Redirect rd;
        if (reply->type == REDIS_REPLY_ERROR && redirects != nullptr &&
            parse_redirect(std::string_view(reply->str, reply->len), &rd)) {
          rd.index = k;
          redirects->push_back(std::move(rd));
        }
        out[k] = reply->type == REDIS_REPLY_INTEGER && reply->integer > 0;
      }
    }
  }
  return out;
}

bool RedisTier::read_value_locked(size_t i, uint64_t bytes, GetSink& sink) {
  uint8_t* dst = sink.buffer(i, bytes);
  uint64_t got = 0;
  while (got < bytes) {
    if (in_head_ == in_tail_) {
      const uint64_t left = bytes - got;
      if (dst != nullptr && left >= kDirectBytes) {
        const ssize_t n = ::recv(ctx_->fd, dst + got, std::min(left, kChunkBytes), 0);
        if (n < 0 && errno == EINTR) continue;
        if (!received_locked(n)) return false;
        sink.received(i, got, static_cast<uint64_t>(n));
        got += static_cast<uint64_t>(n);
        continue;
      }
      if (!fill_locked()) return false;
    }
    const uint64_t take = std::min<uint64_t>(bytes - got, in_tail_ - in_head_);
    if (dst != nullptr) {
      std::memcpy(dst + got, in_.data() + in_head_, take);
      sink.received(i, got, take);
    }
    in_head_ += take;
    got += take;
  }
  while (in_tail_ - in_head_ < 2) {
    if (!fill_locked()) return false;
  }
  if (in_[in_head_] != '\r' || in_[in_head_ + 1] != '\n') return false;
  in_head_ += 2;
  if (dst != nullptr) sink.done(i);
  return true;
}

bool RedisTier::get(std::span<const std::string> keys, GetSink& sink, std::vector<Redirect>* redirects, bool asking) {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  if (keys.empty()) return true;
  if (!connect_locked()) return false;
  if (!raw_ready_locked()) return false;
  // A sliding window: up to `depth` GETs in flight, topped up whenever half
  // of them have been answered, so Redis always has the next reply to send.
  const size_t depth = std::max<uint32_t>(1, options_.pipeline_depth);
  size_t sent = 0;
  auto send_upto = [&](size_t n) {
    out_.clear();
    for (; sent < n; ++sent) {
      if (asking) out_ += "*1\r\n$6\r\nASKING\r\n";
      out_ += "*2\r\n$3\r\nGET\r\n";
      append_bulk(out_, keys[sent]);
    }
    return send_all_locked(out_);
  };
  if (!send_upto(std::min(keys.size(), depth))) {
    fail_locked("GET send");
    return false;
  }
  for (size_t i = 0; i < keys.size(); ++i) {
    if (sent < keys.size() && sent - i <= depth / 2 && !send_upto(std::min(keys.size(), i + depth))) {
      fail_locked("GET send");
      return false;
    }
    std::string_view line;
    if (asking && (!read_line_locked(&line) || line != "+OK")) {
      fail_locked("ASKING reply");
      return false;
    }
    if (!read_line_locked(&line) || line.empty()) {
      fail_locked("GET reply");
      return false;
    }
    Redirect rd;
    if (line[0] == '-' && redirects != nullptr && parse_redirect(line.substr(1), &rd)) {
      rd.index = i;
      redirects->push_back(std::move(rd));
      continue;
    }
    if (line[0] != '$') {
      fail_reply_locked(line[0] == '-' ? "GET error reply" : "GET: unexpected reply", line);
      return false;
    }
    if (line == "$-1") continue;  // absent
    uint64_t bytes = 0;
    for (size_t c = 1; c < line.size(); ++c) {
      if (line[c] < '0' || line[c] > '9' || bytes > (uint64_t{1} << 40)) {
        fail_locked("GET: bad bulk length");
        return false;
      }
      bytes = bytes * 10 + static_cast<uint64_t>(line[c] - '0');
    }
    if (!read_value_locked(i, bytes, sink)) {
      fail_locked("GET value");
      return false;
    }
  }
  return true;
}

}  // namespace kvbridge::store_internal
