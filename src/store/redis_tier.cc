// The Redis tier: see redis_tier.h.
//
// hiredis (0.14, Debian's libhiredis-dev) in blocking mode: redisConnectWithTimeout
// bounds the connect; redisSetTimeout sets SO_RCVTIMEO/SO_SNDTIMEO, so each
// read(2)/write(2) fails with EAGAIN after command_timeout and the context
// reports REDIS_ERR_IO. A context with err set cannot be reused (hiredis
// README), so every failure frees it.
#include "store/redis_tier.h"

#include <hiredis/hiredis.h>
#include <signal.h>

#include <cstring>

namespace kvbridge::store_internal {
namespace {

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

}  // namespace

struct RedisTier::Functions {
  redisReplyObjectFunctions fn;
  const redisReplyObjectFunctions* defaults = nullptr;
};

// hiredis calls createString with the bulk string still in its read buffer
// (read.h, redisReplyObjectFunctions); the default copies it into a new
// allocation. For a top-level string while a sink is set, hand the bytes to
// the sink and return a reply without a copy (str NULL, len kept);
// freeReplyObject frees a NULL str harmlessly.
void* RedisTier::create_string(const redisReadTask* task, char* str, size_t len) {
  auto* self = static_cast<RedisTier*>(task->privdata);
  if (self != nullptr && self->sink_ && task->parent == nullptr && task->type == REDIS_REPLY_STRING) {
    self->sink_(std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(str), len));
    auto* r = static_cast<redisReply*>(calloc(1, sizeof(redisReply)));
    if (r == nullptr) return nullptr;
    r->type = REDIS_REPLY_STRING;
    r->len = len;
    return r;
  }
  return self->functions_->defaults->createString(task, str, len);
}

RedisTier::RedisTier(RedisOptions options) : options_(std::move(options)) {}

RedisTier::~RedisTier() {
  if (ctx_) redisFree(ctx_);
}

void RedisTier::fail_locked(const char* /*what*/) {
  ++counters_.errors;
  counters_.up = false;
  if (ctx_) {
    redisFree(ctx_);
    ctx_ = nullptr;
  }
  down_until_ = std::chrono::steady_clock::now() + options_.retry_interval;
}

bool RedisTier::connect_locked() {
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
  // Keep the reader's buffer between replies: by default hiredis frees it
  // once idle and above 16 KiB (REDIS_READER_MAX_BUF), so every object-sized
  // reply would grow it again from nothing, faulting in fresh pages.
  ctx_->reader->maxbuf = 0;
  if (!functions_) functions_ = std::make_unique<Functions>();
  functions_->defaults = ctx_->reader->fn;
  functions_->fn = *ctx_->reader->fn;
  functions_->fn.createString = &RedisTier::create_string;
  ctx_->reader->fn = &functions_->fn;
  ctx_->reader->privdata = this;
  counters_.up = true;
  return true;
}

size_t RedisTier::put(std::span<const std::string> keys, std::span<const std::span<const uint8_t>> values) {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  size_t written = 0;
  const size_t depth = std::max<uint32_t>(1, options_.pipeline_depth);
  for (size_t i = 0; i < keys.size(); i += depth) {
    if (!connect_locked()) return written;
    const size_t end = std::min(keys.size(), i + depth);
    for (size_t k = i; k < end; ++k) {
      const char* argv[3] = {"SET", keys[k].data(), reinterpret_cast<const char*>(values[k].data())};
      const size_t lens[3] = {3, keys[k].size(), values[k].size()};
      if (redisAppendCommandArgv(ctx_, 3, argv, lens) != REDIS_OK) {
        fail_locked("append");
        return written;
      }
    }
    for (size_t k = i; k < end; ++k) {
      void* r = nullptr;
      if (redisGetReply(ctx_, &r) != REDIS_OK) {
        fail_locked("SET");
        return written;
      }
      Reply reply(static_cast<redisReply*>(r));
      if (reply->type == REDIS_REPLY_ERROR) {
        fail_locked("SET error reply");
        return written;
      }
      ++written;
      ++counters_.writes;
    }
  }
  return written;
}

std::vector<uint8_t> RedisTier::exists(std::span<const std::string> keys) {
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
      if (redisAppendCommandArgv(ctx_, 2, argv, lens) != REDIS_OK) {
        fail_locked("append");
        return std::vector<uint8_t>(keys.size(), 0);
      }
    }
    for (size_t k = i; k < end; ++k) {
      void* r = nullptr;
      if (redisGetReply(ctx_, &r) != REDIS_OK) {
        fail_locked("EXISTS");
        return std::vector<uint8_t>(keys.size(), 0);
      }
      Reply reply(static_cast<redisReply*>(r));
      out[k] = reply->type == REDIS_REPLY_INTEGER && reply->integer > 0;
    }
  }
  return out;
}

bool RedisTier::get(std::span<const std::string> keys,
                    const std::function<void(size_t, std::span<const uint8_t>)>& found) {
  std::lock_guard<std::mutex> lock(mu_);
  SigpipeGuard guard;
  const size_t depth = std::max<uint32_t>(1, options_.pipeline_depth);
  for (size_t i = 0; i < keys.size(); i += depth) {
    if (!connect_locked()) return false;
    const size_t end = std::min(keys.size(), i + depth);
    for (size_t k = i; k < end; ++k) {
      const char* argv[2] = {"GET", keys[k].data()};
      const size_t lens[2] = {3, keys[k].size()};
      if (redisAppendCommandArgv(ctx_, 2, argv, lens) != REDIS_OK) {
        fail_locked("append");
        return false;
      }
    }
    for (size_t k = i; k < end; ++k) {
      void* r = nullptr;
      sink_ = [&found, k](std::span<const uint8_t> bytes) { found(k, bytes); };
      const int rc = redisGetReply(ctx_, &r);
      sink_ = nullptr;
      if (rc != REDIS_OK) {
        fail_locked("GET");
        return false;
      }
      Reply reply(static_cast<redisReply*>(r));
      if (reply->type == REDIS_REPLY_STRING && reply->str != nullptr) {
        found(k, std::span<const uint8_t>(reinterpret_cast<const uint8_t*>(reply->str), reply->len));
      } else if (reply->type == REDIS_REPLY_ERROR) {
        fail_locked("GET error reply");
        return false;
      }
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
    case REDIS_REPLY_INTEGER: return std::to_string(reply->integer);
    case REDIS_REPLY_STRING:
    case REDIS_REPLY_STATUS: return std::string(reply->str, reply->len);
    case REDIS_REPLY_ERROR: return Status::io_error("redis: " + std::string(reply->str, reply->len));
    default: return std::string();
  }
}

RedisCounters RedisTier::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  return counters_;
}

}  // namespace kvbridge::store_internal
