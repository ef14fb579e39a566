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
//
// This file holds the connection, the failure policy, the socket I/O under
// get() and put(), command() and the counters; the reads (exists(), get()) are
// in redis_tier_read.cc, the writes (put(), put_parts()) in redis_tier_write.cc
// and the cluster support (redirects, CLUSTER SLOTS) in redis_tier_cluster.cc.
#include "store/redis_tier.h"

#include <hiredis/hiredis.h>
#include <sys/socket.h>
#include <sys/uio.h>

#include <cerrno>
#include <cstring>

#include "store/redis_tier_io.h"

namespace kvbridge::store_internal {
namespace {

constexpr size_t kInBytes = 256 << 10;
constexpr size_t kMaxLineBytes = 64 << 10;

timeval to_timeval(std::chrono::milliseconds ms) {
  timeval tv;
  tv.tv_sec = static_cast<time_t>(ms.count() / 1000);
  tv.tv_usec = static_cast<suseconds_t>((ms.count() % 1000) * 1000);
  return tv;
}

}  // namespace

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
