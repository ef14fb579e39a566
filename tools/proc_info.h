// tools/proc_info.h: what /proc says about a process's sockets and threads,
// for the demo's report (where its ranks listen, what their listener threads
// cost under a flood), and the demo's pinning of its ranks to cores.
//
// Thread-safety: reentrant; reads /proc only.
#pragma once

#include <sys/types.h>

#include <cstddef>
#include <map>
#include <string>
#include <string_view>
#include <vector>

namespace kvbridge::cli {

// "ip:port" ("[v6]:port") of every TCP socket `pid` holds in the listening
// state: its socket inodes (/proc/<pid>/fd) matched against
// /proc/<pid>/net/tcp and tcp6 (the process's network namespace).
std::vector<std::string> listening_addresses(pid_t pid);

// The calling process (number `index` of those pinned) onto one core of
// those it may use, round robin; nothing where the affinity is unreadable.
void pin_to_core(size_t index);

// User plus system CPU seconds of each thread of `pid` whose name
// (/proc/<pid>/task/<tid>/comm) starts with `prefix`, keyed "name/tid".
std::map<std::string, double> thread_cpu_seconds(pid_t pid, std::string_view prefix);

}  // namespace kvbridge::cli
