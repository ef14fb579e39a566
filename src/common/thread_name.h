// common/thread_name.h: names for kvbridge's threads, as top, ps -L and
// /proc/<pid>/task/<tid>/comm show them ("kvb-control", "kvb-tcp-serve").
//
// Thread-safety: names the calling thread.
#pragma once

#include <pthread.h>

#include <string>
#include <string_view>

namespace kvbridge {

// Names the calling thread; Linux keeps the first 15 bytes.
inline void set_thread_name(std::string_view name) {
  const std::string n(name.substr(0, 15));
  ::pthread_setname_np(::pthread_self(), n.c_str());
}

}  // namespace kvbridge
