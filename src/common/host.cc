#include "common/host.h"

#include <unistd.h>

#include <fstream>

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

}  // namespace kvbridge
