// The helpers that the Redis tier's sources (redis_tier.cc,
// redis_tier_read.cc, redis_tier_write.cc, redis_tier_cluster.cc) share: the
// SIGPIPE guard around socket I/O, ownership of hiredis replies and the RESP
// encoding of a bulk string. Not a public header.
#pragma once

#include <hiredis/hiredis.h>
#include <signal.h>

#include <memory>
#include <string>
#include <string_view>

namespace kvbridge::store_internal {

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

inline void append_bulk(std::string& out, std::string_view s) {
  out += '$';
  out += std::to_string(s.size());
  out += "\r\n";
  out.append(s);
  out += "\r\n";
}

}  // namespace kvbridge::store_internal
