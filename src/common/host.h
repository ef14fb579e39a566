// common/host.h: what this machine is, as transports and the engine name it
// in metadata and messages: the hostname and the boot id, read once here.
//
// Thread-safety: reentrant.
#pragma once

#include <string>

namespace kvbridge {

// gethostname(2); empty when it fails.
std::string this_hostname();

// The first line of a text file (e.g. under /proc); empty when it cannot be
// read.
std::string read_first_line(const std::string& path);

// This boot's id (/proc/sys/kernel/random/boot_id): two processes with the
// same hostname and boot id run under one kernel.
std::string boot_id();

// The CPUs this thread may run on (sched_getaffinity(2)): fewer than the
// machine's when the process is pinned or in a cpuset; at least 1.
unsigned usable_cpus();

}  // namespace kvbridge
