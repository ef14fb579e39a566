#include "common/host.h"

#include <sched.h>
#include <unistd.h>

#include <algorithm>
#include <fstream>
#include <thread>

namespace kvbridge {

std::string this_hostname() {
  char host[256] = {};
  if (::gethostname(host, sizeof host - 1) != 0) return "";
  return host;
}

std::string read_first_line(const std::string& path) {
  std::ifstream in(path);
  std::string line;
  std::getline(in, line);
  return line;
}

std::string boot_id() { return read_first_line("/proc/sys/kernel/random/boot_id"); }

unsigned usable_cpus() {
  cpu_set_t allowed;
  CPU_ZERO(&allowed);
  if (::sched_getaffinity(0, sizeof allowed, &allowed) == 0) {
    const int n = CPU_COUNT(&allowed);
    if (n > 0) return static_cast<unsigned>(n);
  }
  return std::max(1u, std::thread::hardware_concurrency());
}

}  // namespace kvbridge
