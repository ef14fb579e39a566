// WakeTokens: the engine's workers' counting semaphore on a Linux futex
// (transfers.h).
#include <linux/futex.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <climits>

#include "engine/transfers.h"

namespace kvbridge::engine_internal {

bool WakeTokens::release(uint32_t n, bool wake_sleepers) {
  if (n == 0) return false;
  tokens_.fetch_add(n, std::memory_order_seq_cst);
  // A sleeper counted itself before its futex_wait re-checks tokens_, so
  // either it sees the new tokens there or it is counted here and woken.
  return wake_sleepers && wake(n);
}

bool WakeTokens::wake(uint32_t n) {
  if (n == 0 || sleepers_.load(std::memory_order_seq_cst) == 0) return false;
  ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&tokens_), FUTEX_WAKE_PRIVATE,
            static_cast<int>(std::min<uint32_t>(n, INT_MAX)), nullptr, nullptr, 0);
  return true;
}

void WakeTokens::acquire() {
  while (true) {
    uint32_t v = tokens_.load(std::memory_order_acquire);
    while (v > 0) {
      if (tokens_.compare_exchange_weak(v, v - 1, std::memory_order_acquire)) return;
    }
    sleepers_.fetch_add(1, std::memory_order_seq_cst);
    // Sleeps only while tokens_ is still 0 (EAGAIN otherwise); EINTR and
    // spurious wake-ups just loop.
    ::syscall(SYS_futex, reinterpret_cast<uint32_t*>(&tokens_), FUTEX_WAIT_PRIVATE, 0u, nullptr, nullptr, 0);
    sleepers_.fetch_sub(1, std::memory_order_seq_cst);
  }
}

}  // namespace kvbridge::engine_internal
