// cma_shape_bench: the kernel's cross-memory attach alone, in the shape of
// a prefill instance of S ranks and a decode instance of D ranks (D a
// multiple of S), with no kvbridge code on the path: one process per rank,
// one thread each.
//
//   pull: each of the D readers process_vm_readv()s its share from its
//         source: every (D/S)-th piece of the source's buffer.
//   push: each of the S writers process_vm_writev()s the same pieces into
//         its D/S readers' buffers.
//
// The same bytes, the same pieces, the same iovec windows (IOV_MAX per
// call); the figure is the bytes of all ranks over the wall time from a
// common start to the last rank done. The baseline for the push-against-
// pull question (docs/connector.md, "Push against pull").
//
// A second line: one pass only, over pages their owners have just made
// resident and no other process has copied from or into yet, as a request's
// fresh blocks are. Under some hypervisors (a shadow-paging guest) that first
// cross-process copy is many times slower than the ones after it, and the
// demo's transfers pay it where its baseline, run after them, does not.
//
// The buffers are 4 KiB pages, or with --huge-pages 2 MiB pages where the
// kernel has transparent huge pages (kvbridge::HostMemory, which the demo's
// tensors use): a copy pins 512 times fewer pages.
//
// Usage: cma_shape_bench [--sources S] [--readers D] [--piece BYTES]
//                        [--mib PER_SOURCE] [--reps N] [--huge-pages]
#include <limits.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "kvbridge/host_memory.h"

namespace {

using kvbridge::HostMemory;
using kvbridge::Result;

struct Options {
  unsigned sources = 2, readers = 4;
  size_t piece = 8192;
  size_t mib = 128;  // per source
  unsigned reps = 10;
  bool huge_pages = false;  // each buffer advised for transparent huge pages, as HostMemory does
};

constexpr const char* kUsage =
    "usage: cma_shape_bench [--sources S] [--readers D] [--piece BYTES] [--mib N] [--reps N] [--huge-pages]\n";

[[noreturn]] void usage(const char* why) {
  std::fprintf(stderr, "cma_shape_bench: %s\n%s", why, kUsage);
  std::exit(2);
}

Options parse(int argc, char** argv) {
  Options o;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--help" || a == "-h") {
      std::fputs(kUsage, stdout);
      std::exit(0);
    }
    if (a == "--huge-pages") {
      o.huge_pages = true;
      continue;
    }
    if (i + 1 >= argc) usage(("missing value after " + a).c_str());
    char* end = nullptr;
    const unsigned long long v = std::strtoull(argv[++i], &end, 10);
    if (*end != '\0' || v == 0) usage(("bad value for " + a).c_str());
    if (a == "--sources") {
      o.sources = static_cast<unsigned>(v);
    } else if (a == "--readers") {
      o.readers = static_cast<unsigned>(v);
    } else if (a == "--piece") {
      o.piece = v;
    } else if (a == "--mib") {
      o.mib = v;
    } else if (a == "--reps") {
      o.reps = static_cast<unsigned>(v);
    } else {
      usage(("unknown option " + a).c_str());
    }
  }
  if (o.readers % o.sources != 0) usage("--readers must be a multiple of --sources");
  const size_t fan = o.readers / o.sources;
  if (((o.mib << 20) / o.piece) % fan != 0 || (o.mib << 20) % o.piece != 0) {
    usage("--mib MiB must hold a whole number of pieces, a multiple of readers/sources");
  }
  return o;
}

// Runs one mode; returns GB/s (all bytes over the wall time).
double run(const Options& o, bool push) {
  const unsigned ranks = o.sources + o.readers;
  const size_t src_bytes = o.mib << 20, fan = o.readers / o.sources, dst_bytes = src_bytes / fan;
  // Shared with the children: each rank's buffer address and pid.
  auto* table = static_cast<uintptr_t*>(
      ::mmap(nullptr, 2 * ranks * sizeof(uintptr_t), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0));
  if (table == MAP_FAILED) usage("mmap of the shared table failed");
  uintptr_t* addr = table;
  auto* pid = reinterpret_cast<pid_t*>(table + ranks);
  int ready[2], go[2];
  if (::pipe(ready) != 0 || ::pipe(go) != 0) usage("pipe failed");
  for (unsigned k = 0; k < ranks; ++k) {
    const pid_t c = ::fork();
    if (c < 0) usage("fork failed");
    if (c == 0) {
      ::close(go[1]);
      const bool source = k < o.sources;
      const size_t n = source ? src_bytes : dst_bytes;
      Result<HostMemory> memory = HostMemory::allocate(n);
      if (!memory.ok()) _exit(3);
      auto* b = reinterpret_cast<char*>(memory->data());
      // HostMemory advises huge pages; without --huge-pages, undo that.
      if (!o.huge_pages && ::madvise(b, n, MADV_NOHUGEPAGE) != 0) _exit(3);
      std::memset(b, static_cast<int>(k + 1), n);  // resident, as KV is
      addr[k] = reinterpret_cast<uintptr_t>(b);
      char x = 1;
      if (::write(ready[1], &x, 1) != 1) _exit(3);
      if (::read(go[0], &x, 1) < 0) _exit(3);  // EOF: go
      if (source != push) {
        ::pause();  // passive: its memory is read or written
        _exit(0);
      }
      const size_t pieces = dst_bytes / o.piece;  // per (source, reader) pair
      std::vector<iovec> l(IOV_MAX), r(IOV_MAX);
      for (unsigned rep = 0; rep < o.reps; ++rep) {
        // push: this source's readers; pull: this reader's one source.
        const unsigned first = push ? 0 : (k - o.sources) % static_cast<unsigned>(fan);
        const unsigned count = push ? static_cast<unsigned>(fan) : 1;
        for (unsigned t = first; t < first + count; ++t) {
          const unsigned src = push ? k : (k - o.sources) / static_cast<unsigned>(fan);
          const unsigned dst = o.sources + src * static_cast<unsigned>(fan) + t;
          for (size_t i = 0; i < pieces; i += IOV_MAX) {
            const size_t m = std::min<size_t>(IOV_MAX, pieces - i);
            for (size_t j = 0; j < m; ++j) {
              // Piece i+j of the pair: every fan-th piece of the source
              // buffer, consecutive in the reader's.
              char* at_src = reinterpret_cast<char*>(addr[src]) + ((i + j) * fan + t) * o.piece;
              char* at_dst = reinterpret_cast<char*>(addr[dst]) + (i + j) * o.piece;
              l[j] = iovec{push ? at_src : at_dst, o.piece};
              r[j] = iovec{push ? at_dst : at_src, o.piece};
            }
            const ssize_t got = push ? ::process_vm_writev(pid[dst], l.data(), m, r.data(), m, 0)
                                     : ::process_vm_readv(pid[src], l.data(), m, r.data(), m, 0);
            if (got != static_cast<ssize_t>(m * o.piece)) {
              std::perror(push ? "process_vm_writev" : "process_vm_readv");
              _exit(4);
            }
          }
        }
      }
      _exit(0);
    }
    pid[k] = c;
  }
  ::close(ready[1]);
  ::close(go[0]);
  char x;
  for (unsigned k = 0; k < ranks; ++k) {
    if (::read(ready[0], &x, 1) != 1) usage("a rank died before it was ready");
  }
  const auto t0 = std::chrono::steady_clock::now();
  ::close(go[1]);
  bool ok = true;
  for (unsigned k = 0; k < ranks; ++k) {
    const bool active = (k < o.sources) == push;
    if (!active) continue;
    int status = 0;
    ::waitpid(pid[k], &status, 0);
    ok = ok && WIFEXITED(status) && WEXITSTATUS(status) == 0;
  }
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  for (unsigned k = 0; k < ranks; ++k) {
    if ((k < o.sources) != push) {
      ::kill(pid[k], SIGKILL);
      ::waitpid(pid[k], nullptr, 0);
    }
  }
  ::close(ready[0]);
  ::munmap(table, 2 * ranks * sizeof(uintptr_t));
  if (!ok) usage("a copying rank failed");
  return static_cast<double>(o.reps) * static_cast<double>(o.sources) * static_cast<double>(src_bytes) / s / 1e9;
}

}  // namespace

int main(int argc, char** argv) {
  const Options o = parse(argc, argv);
  const double pull = run(o, false), push = run(o, true);
  std::printf(
      "cma shape: %u sources -> %u readers, %zu-byte pieces, %zu MiB per source x %u, %s pages: pull "
      "(process_vm_readv) %.2f GB/s, push (process_vm_writev) %.2f GB/s, push / pull %.2f\n",
      o.sources, o.readers, o.piece, o.mib, o.reps, o.huge_pages ? "huge" : "4 KiB", pull, push, push / pull);
  Options once = o;
  once.reps = 1;
  const double pull1 = run(once, false), push1 = run(once, true);
  std::printf(
      "first pass over fresh pages: pull %.2f GB/s (%.2fx the repeated passes), push %.2f GB/s (%.2fx), push / pull "
      "%.2f\n",
      pull1, pull1 / pull, push1, push1 / push, push1 / pull1);
  return 0;
}
