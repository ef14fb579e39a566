// /proc readers (see proc_info.h; proc(5) for the formats).
#include "proc_info.h"

#include <arpa/inet.h>
#include <sched.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

namespace kvbridge::cli {
namespace {

namespace fs = std::filesystem;

std::set<std::string> socket_inodes(pid_t pid) {
  std::set<std::string> out;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/fd", ec)) {
    std::error_code link_ec;
    const std::string target = fs::read_symlink(e.path(), link_ec).string();
    if (target.rfind("socket:[", 0) == 0) out.insert(target.substr(8, target.size() - 9));
  }
  return out;
}

// "0100007F:1F90" (tcp) or 32 hex digits then ":PORT" (tcp6): each 32-bit
// word of the address is in host order as printed by the kernel.
std::string address_of(const std::string& hex, bool v6) {
  const size_t colon = hex.find(':');
  if (colon == std::string::npos) return "?";
  const unsigned port = std::stoul(hex.substr(colon + 1), nullptr, 16);
  char text[INET6_ADDRSTRLEN] = "?";
  if (!v6) {
    in_addr a{};
    a.s_addr = static_cast<uint32_t>(std::stoul(hex.substr(0, 8), nullptr, 16));
    ::inet_ntop(AF_INET, &a, text, sizeof text);
    return std::string(text) + ":" + std::to_string(port);
  }
  in6_addr a{};
  for (int w = 0; w < 4; ++w) {
    const uint32_t word = static_cast<uint32_t>(std::stoul(hex.substr(w * 8, 8), nullptr, 16));
    std::memcpy(reinterpret_cast<uint8_t*>(&a) + 4 * w, &word, 4);
  }
  ::inet_ntop(AF_INET6, &a, text, sizeof text);
  return "[" + std::string(text) + "]:" + std::to_string(port);
}

}  // namespace

std::vector<std::string> listening_addresses(pid_t pid) {
  const std::set<std::string> inodes = socket_inodes(pid);
  std::vector<std::string> out;
  for (const bool v6 : {false, true}) {
    std::ifstream in("/proc/" + std::to_string(pid) + "/net/" + (v6 ? "tcp6" : "tcp"));
    std::string line;
    std::getline(in, line);  // the header
    while (std::getline(in, line)) {
      std::istringstream f(line);
      std::string slot, local, remote, state, queues, timer, retransmits, uid, timeout, inode;
      f >> slot >> local >> remote >> state >> queues >> timer >> retransmits >> uid >> timeout >> inode;
      if (state == "0A" && inodes.count(inode)) out.push_back(address_of(local, v6));  // 0A: TCP_LISTEN
    }
  }
  return out;
}

std::map<std::string, double> thread_cpu_seconds(pid_t pid, std::string_view prefix) {
  std::map<std::string, double> out;
  const double ticks = static_cast<double>(::sysconf(_SC_CLK_TCK));
  std::error_code ec;
  for (const auto& e : fs::directory_iterator("/proc/" + std::to_string(pid) + "/task", ec)) {
    std::string name;
    std::getline(std::ifstream(e.path() / "comm"), name);
    if (name.rfind(prefix, 0) != 0) continue;
    std::string stat;
    std::getline(std::ifstream(e.path() / "stat"), stat);
    const size_t close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream f(stat.substr(close + 2));
    std::string field;
    double utime = 0, stime = 0;
    // After the name: state (field 3) ... utime is field 14, stime 15.
    for (int i = 3; i <= 15 && f >> field; ++i) {
      if (i == 14) utime = std::stod(field);
      if (i == 15) stime = std::stod(field);
    }
    out[name + "/" + e.path().filename().string()] = (utime + stime) / ticks;
  }
  return out;
}

void pin_to_core(size_t index) {
  cpu_set_t allowed;
  if (::sched_getaffinity(0, sizeof allowed, &allowed) != 0) return;
  std::vector<int> cpus;
  for (int c = 0; c < CPU_SETSIZE; ++c)
    if (CPU_ISSET(c, &allowed)) cpus.push_back(c);
  if (cpus.empty()) return;
  cpu_set_t one;
  CPU_ZERO(&one);
  CPU_SET(cpus[index % cpus.size()], &one);
  (void)::sched_setaffinity(0, sizeof one, &one);
}

}  // namespace kvbridge::cli
