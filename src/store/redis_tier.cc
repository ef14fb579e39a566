// The Redis tier: see redis_tier.h.
//
// hiredis (0.14, Debian's libhiredis-dev) in blocking mode: redisConnectWithTimeout
// bounds the connect; redisSetTimeout sets SO_RCVTIMEO/SO_SNDTIMEO, so each
// read(2)/write(2) fails with EAGAIN after command_timeout and the context
// reports REDIS_ERR_IO. A context with err set cannot be reused (hiredis
// README), so every failure frees it.
//
// get() and put() do not go through hiredis: hiredis reads 16 KiB at a time into a
// stack buffer, appends that to its own buffer and copies each bulk string
// into a reply object, three passes over every value before the store sees
// it. Reading GET replies (RESP bulk strings, "$<len>\r\n<bytes>\r\n") is
// small enough to do here, and lets a large value go from the socket straight
// into its final buffer in 256 KiB recv(2) calls. Likewise a SET goes out
// with sendmsg(2) straight from the object, not via a copy into hiredis's
// output buffer. The same socket timeouts bound every recv/send.
#include "store/redis_tier.h"

#include <hiredis/hiredis.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

namespace kvbridge::store_internal {
namespace {

// Values bigger than this are received straight into their buffer; smaller
// ones (and the rest of a large one below this) through in_, which also
// picks up the next replies' headers in the same recv.
constexpr uint64_t kDirectBytes = 64 << 10;
// One recv into a value at most this much, so the caller's checksum of the
// range reads it from cache.
constexpr uint64_t kChunkBytes = 256 << 10;
constexpr size_t kInBytes = 256 << 10;
constexpr size_t kMaxLineBytes = 64 << 10;

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

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv;
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

// Blocks SIGPIPE on this thread for the scope and discards one raised in it
// (the pattern of "SIGPIPE and threads" in signal(7)/pthread_sigmask(3)).
class SigpipeGuard {
 public:
  SigpipeGuard() {
    sigemptyset(&pipe_);
    sigaddset(&pipe_, SIGPIPE);
    sigset_t pending;
    sigpending(&pending);
    was_pending_ = sigismember(&pending, SIGPIPE) == 1;
    pthread_sigmask(SIG_BLOCK, &pipe_, &old_);
  }
  ~SigpipeGuard() {
    if (!was_pending_) {
      sigset_t pending;
      sigpending(&pending);
      if (sigismember(&pending, SIGPIPE) == 1) {
        const timespec zero{0, 0};
        sigtimedwait(&pipe_, nullptr, &zero);
      }
    }
    pthread_sigmask(SIG_SETMASK, &old_, nullptr);
  }

 private:
  sigset_t pipe_, old_;
  bool was_pending_ = false;
};

struct ReplyDeleter {
  void operator()(redisReply* r) const { freeReplyObject(r); }
};
using Reply = std::unique_ptr<redisReply, ReplyDeleter>;

void append_bulk(std::string& out, std::string_view s) {
  out += '$';
  out += std::to_string(s.size());
  out += "\r\n";
  out.append(s);
  out += "\r\n";
}

}  // namespace

bool parse_redirect(std::string_view error, Redirect* out) {
  auto word = [&](std::string_view w) { return error.substr(0, w.size()) == w; };
  if (word("CLUSTERDOWN") || word("TRYAGAIN")) {
    out->kind = Redirect::kRetry;
    out->reply = std::string(error.substr(0, 120));
    return true;
  }
  if (!word("MOVED ") && !word("ASK ")) return false;
  out->kind = word("ASK ") ? Redirect::kAsk : Redirect::kMoved;
  error.remove_prefix(out->kind == Redirect::kAsk ? 4 : 6);
  const size_t space = error.find(' ');
  const size_t colon = error.rfind(':');
  if (space == std::string_view::npos || colon == std::string_view::npos || colon < space) return false;
  uint64_t slot = 0, port = 0;
  for (const char c : error.substr(0, space)) {
    if (c < '0' || c > '9' || (slot = slot * 10 + static_cast<uint64_t>(c - '0')) > 16383) return false;
  }
  const std::string_view port_text = error.substr(colon + 1);
  if (port_text.empty()) return false;
  for (const char c : port_text) {
    if (c < '0' || c > '9' || (port = port * 10 + static_cast<uint64_t>(c - '0')) > 65535) return false;
  }
  out->slot = static_cast<uint16_t>(slot);
  out->host = std::string(error.substr(space + 1, colon - space - 1));
  out->port = static_cast<uint16_t>(port);
  return !out->host.empty() && port != 0;
}

RedisTier::RedisTier(RedisOptions options) : options_(std::move(options)) {}

RedisTier::~RedisTier() {
  if (ctx_) redisFree(ctx_);
}

void RedisTier::fail_locked(const char* what) {
  std::string detail = std::move(io_error_);
  io_error_.clear();
  if (detail.empty() && ctx_ != nullptr && ctx_->err) {
    // hiredis reports a socket timeout as the text of EAGAIN.
    const bool timed_out = ctx_->err == REDIS_ERR_IO && (std::strcmp(ctx_->errstr, std::strerror(EAGAIN)) == 0 ||
                                                         std::strcmp(ctx_->errstr, std::strerror(EWOULDBLOCK)) == 0);
    if (timed_out) {
      io_failed_locked(-1, EAGAIN);
      detail = std::move(io_error_);
      io_error_.clear();
    } else {
      detail = ctx_->err == REDIS_ERR_EOF ? "the server closed the connection" : ctx_->errstr;
    }
  }
  if (detail.empty() && ctx_ == nullptr) detail = "could not allocate a connection";
  counters_.last_error = options_.host + ":" + std::to_string(options_.port) + ": " + what;
  if (!detail.empty()) counters_.last_error += ": " + detail;
  ++counters_.errors;
  counters_.up = false;
  if (ctx_) {
    redisFree(ctx_);
    ctx_ = nullptr;
  }
  in_head_ = in_tail_ = 0;
  down_until_ = std::chrono::steady_clock::now() + options_.retry_interval;
}

void RedisTier::fail_reply_locked(const char* what, std::string_view line) {
  io_error_ = "the server answered \"" + std::string(line.substr(0, 160)) + (line.size() > 160 ? "...\"" : "\"");
  fail_locked(what);
}

void RedisTier::io_failed_locked(ssize_t n, int err) {
  if (n == 0) {
    io_error_ = "the server closed the connection";
  } else if (err == EAGAIN || err == EWOULDBLOCK) {
    io_error_ = "no progress within the command timeout of " + std::to_string(options_.command_timeout.count()) + " ms";
  } else {
    io_error_ = std::strerror(err);
  }
}

bool RedisTier::connect_locked() {
  // Each operation (or pipelined batch of one) starts here: its clock for
  // the least rate a reply must keep (fill_locked()).
  op_start_ = std::chrono::steady_clock::now();
  op_bytes_ = 0;
  if (ctx_) return true;
  if (std::chrono::steady_clock::now() < down_until_) {
    ++counters_.skipped;
    return false;
  }
  ctx_ = redisConnectWithTimeout(options_.host.c_str(), options_.port, to_timeval(options_.connect_timeout));
  if (ctx_ == nullptr || ctx_->err) {
    fail_locked("connect");
    return false;
  }
  if (redisSetTimeout(ctx_, to_timeval(options_.command_timeout)) != REDIS_OK) {
    fail_locked("timeout");
    return false;
  }
  in_head_ = in_tail_ = 0;
  counters_.up = true;
  return true;
}

bool RedisTier::raw_ready_locked() {
  // hiredis must hold nothing unread or unsent: its reader and the socket are
  // in step after every hiredis operation, which reads all its replies.
  if (ctx_->reader->pos != ctx_->reader->len || (ctx_->obuf != nullptr && ctx_->obuf[0] != '\0')) {
    fail_locked("hiredis holds unread bytes");
    return false;
  }
  in_head_ = in_tail_ = 0;
  return true;
}

bool RedisTier::send_iov_locked(iovec* iov, int count) {
  while (count > 0) {
    msghdr m{};
    m.msg_iov = iov;
    m.msg_iovlen = static_cast<size_t>(count);
    ssize_t n = ::sendmsg(ctx_->fd, &m, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // EAGAIN: SO_SNDTIMEO expired
      io_failed_locked(n, errno);
      return false;
    }
    while (count > 0 && static_cast<size_t>(n) >= iov->iov_len) {
      n -= static_cast<ssize_t>(iov->iov_len);
      ++iov;
      --count;
    }
    if (count > 0) {
      iov->iov_base = static_cast<char*>(iov->iov_base) + n;
      iov->iov_len -= static_cast<size_t>(n);
    }
  }
  return true;
}

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

bool RedisTier::send_all_locked(const std::string& bytes) {
  size_t done = 0;
  while (done < bytes.size()) {
    const ssize_t n = ::send(ctx_->fd, bytes.data() + done, bytes.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {  // EAGAIN: SO_SNDTIMEO expired
      io_failed_locked(n, errno);
      return false;
    }
    done += static_cast<size_t>(n);
  }
  return true;
}

bool RedisTier::fill_locked() {
  if (in_.size() < kInBytes) in_.resize(kInBytes);
  if (in_head_ == in_tail_) {
    in_head_ = in_tail_ = 0;
  } else if (in_tail_ == in_.size()) {
    std::memmove(in_.data(), in_.data() + in_head_, in_tail_ - in_head_);
    in_tail_ -= in_head_;
    in_head_ = 0;
  }
  for (;;) {
    const ssize_t n = ::recv(ctx_->fd, in_.data() + in_tail_, in_.size() - in_tail_, 0);
    if (n < 0 && errno == EINTR) continue;
    if (!received_locked(n)) return false;
    in_tail_ += static_cast<size_t>(n);
    return true;
  }
}

bool RedisTier::received_locked(ssize_t n) {
  if (n <= 0) {  // 0: closed; EAGAIN: SO_RCVTIMEO expired
    io_failed_locked(n, errno);
    return false;
  }
  // A server that sends a byte now and then (within the command timeout
  // each time) must not hold an operation for ever: past the command
  // timeout, a reply slower than kMinReplyBytesPerSecond fails.
  op_bytes_ += static_cast<uint64_t>(n);
  const double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - op_start_).count();
  if (elapsed * 1000 > static_cast<double>(options_.command_timeout.count()) &&
      static_cast<double>(op_bytes_) < static_cast<double>(kMinReplyBytesPerSecond) * elapsed) {
    io_error_ = "the reply came slower than " + std::to_string(kMinReplyBytesPerSecond >> 10) + " KiB/s (" +
                std::to_string(op_bytes_) + " bytes in " + std::to_string(static_cast<int>(elapsed * 1000)) + " ms)";
    return false;
  }
  return true;
}

bool RedisTier::read_line_locked(std::string_view* line) {
  size_t scanned = in_head_;
  for (;;) {
    const uint8_t* begin = in_.data() + in_head_;
    for (size_t p = std::max(scanned, in_head_ + 1); p < in_tail_; ++p) {
      if (in_[p] == '\n' && in_[p - 1] == '\r') {
        *line = std::string_view(reinterpret_cast<const char*>(begin), p - 1 - in_head_);
        in_head_ = p + 1;
        return true;
      }
    }
    if (in_tail_ - in_head_ > kMaxLineBytes) return false;
    const size_t seen = in_tail_ - in_head_;
    if (!fill_locked()) return false;  // may move the unread bytes to the front
    scanned = in_head_ + seen;
  }
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

Result<std::string> RedisTier::command(std::span<const std::string> args) {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  if (!connect_locked()) {
    return Status::unavailable("redis " + options_.host + ":" + std::to_string(options_.port) + " is unreachable");
  }
  std::vector<const char*> argv;
  std::vector<size_t> lens;
  for (const std::string& a : args) {
    argv.push_back(a.data());
    lens.push_back(a.size());
  }
  void* r = redisCommandArgv(ctx_, static_cast<int>(argv.size()), argv.data(), lens.data());
  if (r == nullptr) {
    const std::string err = ctx_->errstr;
    fail_locked("command");
    return Status::io_error("redis: " + err);
  }
  Reply reply(static_cast<redisReply*>(r));
  switch (reply->type) {
    case REDIS_REPLY_INTEGER:
      return std::to_string(reply->integer);
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS:
      return std::string(reply->str, reply->len);
    case REDIS_REPLY_ERROR:
      return Status::io_error("redis: " + std::string(reply->str, reply->len));
    case REDIS_REPLY_NIL:
      return Status::not_found("redis: nil reply");
    default:
      return std::string();
  }
}

Result<TierSize> RedisTier::size() {
  TierSize t;
  const std::string dbsize[] = {"DBSIZE"};
  KVB_ASSIGN_OR_RETURN(std::string keys, command(dbsize));
  t.keys = std::strtoull(keys.c_str(), nullptr, 10);
  const std::string memory[] = {"INFO", "memory"};
  KVB_ASSIGN_OR_RETURN(std::string text, command(memory));
  const size_t at = text.find("used_memory:");
  if (at != std::string::npos) t.used_memory_bytes = std::strtoull(text.c_str() + at + 12, nullptr, 10);
  return t;
}

namespace {

// CLUSTER SLOTS is read as it streams in, keeping only the ranges: a node
// (lying, or a cluster of many small ranges) cannot make the reply's tree
// take memory; it is bounded in bytes, entries and nesting.
constexpr uint64_t kMaxSlotsReplyBytes = uint64_t{8} << 20;
constexpr int64_t kMaxSlotRanges = 16384;
constexpr int64_t kMaxSlotEntryItems = 64;
constexpr int64_t kMaxNestedItems = 1024;
constexpr int64_t kMaxBulkBytes = 1 << 20;

bool parse_i64(std::string_view text, int64_t* out) {
  if (text.empty() || text.size() > 19) return false;
  bool negative = text[0] == '-';
  if (negative) text.remove_prefix(1);
  if (text.empty()) return false;
  int64_t v = 0;
  for (char c : text) {
    if (c < '0' || c > '9') return false;
    v = v * 10 + (c - '0');
  }
  *out = negative ? -v : v;
  return true;
}

}  // namespace

bool RedisTier::read_bytes_locked(uint64_t n, std::string* out) {
  while (n > 0) {
    if (in_head_ == in_tail_ && !fill_locked()) return false;
    const uint64_t take = std::min<uint64_t>(n, in_tail_ - in_head_);
    if (out != nullptr) out->append(reinterpret_cast<const char*>(in_.data() + in_head_), take);
    in_head_ += take;
    n -= take;
  }
  return true;
}

// One RESP value of the slots reply, read and dropped (a node id, a
// replica, metadata), at most `depth` levels deep.
bool RedisTier::skip_value_locked(int depth) {
  std::string_view line;
  if (op_bytes_ > kMaxSlotsReplyBytes || !read_line_locked(&line) || line.empty()) return false;
  int64_t n = 0;
  switch (line[0]) {
    case '+':
    case '-':
    case ':':
      return true;
    case '$':
      if (!parse_i64(line.substr(1), &n) || n > kMaxBulkBytes) return false;
      return n < 0 || read_bytes_locked(static_cast<uint64_t>(n) + 2, nullptr);
    case '*':
      if (depth == 0 || !parse_i64(line.substr(1), &n) || n > kMaxNestedItems) return false;
      for (int64_t i = 0; i < n; ++i) {
        if (!skip_value_locked(depth - 1)) return false;
      }
      return true;
  }
  return false;
}

Result<std::vector<SlotRange>> RedisTier::cluster_slots() {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  const std::string where = options_.host + ":" + std::to_string(options_.port);
  if (!connect_locked()) return Status::unavailable("redis " + where + " is unreachable");
  if (!raw_ready_locked())
    return Status::unavailable("redis " + where + ": CLUSTER SLOTS: the connection was not idle");
  if (!send_all_locked("*2\r\n$7\r\nCLUSTER\r\n$5\r\nSLOTS\r\n")) {
    fail_locked("CLUSTER SLOTS");
    return Status::unavailable("redis " + where + ": CLUSTER SLOTS: " + counters_.last_error);
  }
  auto bad = [&](const std::string& what) -> Status {
    fail_locked("CLUSTER SLOTS");  // the rest of the reply is not read: the connection goes
    return Status::io_error("redis " + where + ": CLUSTER SLOTS: " + what);
  };
  auto integer = [&](int64_t* v) {
    std::string_view line;
    return op_bytes_ <= kMaxSlotsReplyBytes && read_line_locked(&line) && !line.empty() && line[0] == ':' &&
           parse_i64(line.substr(1), v);
  };
  auto array = [&](int64_t* v) {
    std::string_view line;
    return op_bytes_ <= kMaxSlotsReplyBytes && read_line_locked(&line) && !line.empty() && line[0] == '*' &&
           parse_i64(line.substr(1), v);
  };
  std::string_view line;
  if (!read_line_locked(&line) || line.empty()) return bad("no reply");
  if (line[0] == '-') {
    const std::string error(line.substr(1));
    return Status::incompatible("redis " + where + " is not a cluster node: " + error);
  }
  int64_t entries = 0;
  if (line[0] != '*' || !parse_i64(line.substr(1), &entries)) return bad("not an array");
  if (entries < 0 || entries > kMaxSlotRanges) {
    return bad(std::to_string(entries) + " ranges, more than the " + std::to_string(kMaxSlotRanges) + " slots");
  }
  std::vector<SlotRange> out;
  for (int64_t i = 0; i < entries; ++i) {
    const std::string entry = "entry " + std::to_string(i);
    int64_t items = 0, first = 0, last = 0, parts = 0, port = 0;
    if (!array(&items) || items < 3 || items > kMaxSlotEntryItems || !integer(&first) || !integer(&last) ||
        !array(&parts) || parts < 2 || parts > kMaxSlotEntryItems) {
      return bad(entry + " is malformed" + (op_bytes_ > kMaxSlotsReplyBytes ? " (past 8 MiB)" : ""));
    }
    std::string_view host_line;
    int64_t host_bytes = 0;
    if (!read_line_locked(&host_line) || host_line.empty() || host_line[0] != '$' ||
        !parse_i64(host_line.substr(1), &host_bytes) || host_bytes < 0 || host_bytes > 255) {
      return bad(entry + ": the master's host is not a string of at most 255 bytes");
    }
    SlotRange r;
    if (!read_bytes_locked(static_cast<uint64_t>(host_bytes), &r.host) || !read_bytes_locked(2, nullptr) ||
        !integer(&port)) {
      return bad(entry + " is malformed");
    }
    for (int64_t k = 2; k < parts; ++k) {
      if (!skip_value_locked(2)) return bad(entry + ": the master's node id or metadata is malformed");
    }
    for (int64_t k = 3; k < items; ++k) {
      if (!skip_value_locked(3)) return bad(entry + ": a replica is malformed");
    }
    if (first < 0 || last > 16383 || first > last || port <= 0 || port > 65535) {
      return bad(entry + " is out of range");
    }
    r.first = static_cast<uint16_t>(first);
    r.last = static_cast<uint16_t>(last);
    if (r.host.empty()) r.host = options_.host;  // a node that does not know its address
    r.port = static_cast<uint16_t>(port);
    out.push_back(std::move(r));
  }
  return out;
}

bool RedisTier::down() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ctx_ == nullptr && std::chrono::steady_clock::now() < down_until_;
}

RedisCounters RedisTier::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  RedisCounters c = counters_;
  c.nodes = 1;
  return c;
}

}  // namespace kvbridge::store_internal
