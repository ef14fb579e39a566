// common/thread_name.h: names for kvbridge's threads, as top, ps -L and
// /proc/<pid>/task/<tid>/comm show them ("kvb-control", "kvb-tcp-serve"),
// and the CPU time a thread has used (what a piece of work cost the host,
// apart from what other threads did meanwhile).
//
// Thread-safety: names the calling thread.
#pragma once

#include <pthread.h>
#include <time.h>

#include <chrono>

#include <string>
#include <string_view>

namespace kvbridge {

// Names the calling thread; Linux keeps the first 15 bytes.
inline void set_thread_name(std::string_view name) {
  const std::string n(name.substr(0, 15));
  ::pthread_setname_np(::pthread_self(), n.c_str());
}

// The CPU time the calling thread has used.
inline std::chrono::nanoseconds thread_cpu_time() {
  timespec ts{};
  ::clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return std::chrono::seconds(ts.tv_sec) + std::chrono::nanoseconds(ts.tv_nsec);
}

}  // namespace kvbridge
