// transport/copies.h: what several transports do with a list of copies:
// cut it into shares of about equal bytes, and run the shares on this thread
// and helpers with one error reported.
//
// Thread-safety: pure functions; run_shares() runs `run` on several threads
// at once; RunThreads::post from any thread.
#pragma once

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <mutex>
#include <span>
#include <thread>
#include <vector>

#include "device/device.h"
#include "kvbridge/status.h"
#include "transport/transport.h"

namespace kvbridge::transport {

// Cuts `copies` into `parts` shares of about equal bytes (the last takes the
// rest), cutting a copy at a share boundary, and pieces of at most
// `max_piece` bytes (0: no limit). Order is kept; fewer shares come back
// when there are fewer bytes than parts.
std::vector<std::vector<Copy>> split_by_bytes(std::span<const Copy> copies, size_t parts, uint64_t max_piece = 0);

// Runs `run(i, share, abort)` for every share, share 0 on this thread and the
// others on helper threads, and returns the first real error: once one
// share fails, `abort` is set so the others stop, and the error that caused
// it wins over their kCancelled. OK when every share succeeded.
using ShareRun = std::function<Status(size_t index, std::span<const Copy> share, const std::atomic<bool>& abort)>;
Status run_shares(const std::vector<std::vector<Copy>>& shares, const ShareRun& run);

// The threads that run a link's asynchronous runs (Link::start): up to
// `max` of them, started as jobs need them (none until the first), each
// taking queued jobs in order. The destructor lets queued jobs run, then
// joins. post() fails (kResourceExhausted, the job not queued) only when no
// thread runs and none can start; with one running, the job waits for it.
class RunThreads {
 public:
  RunThreads(size_t max, const char* name) : max_(std::max<size_t>(max, 1)), name_(name) {}
  ~RunThreads();
  RunThreads(const RunThreads&) = delete;
  RunThreads& operator=(const RunThreads&) = delete;
  Status post(std::function<void()> job);

 private:
  void loop();
  const size_t max_;
  const char* name_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
  size_t idle_ = 0;
  bool stopping_ = false;
};

// The content check's hash of `bytes` at `data` (host memory), one function
// for every side that computes it: XXH3-64 of each 64 KiB leaf, then of the
// leaves' hashes (common/xxh3.h), so that a device hashes leaves in
// parallel and gets the same value.
uint64_t content_hash(const void* data, uint64_t bytes);

// content_hash() of bytes given in pieces, in order: reset(), update()
// per piece, digest(). Not copyable.
class ContentHasher {
 public:
  ContentHasher();
  ~ContentHasher();
  ContentHasher(const ContentHasher&) = delete;
  ContentHasher& operator=(const ContentHasher&) = delete;
  void reset();
  void update(const void* data, uint64_t bytes);
  uint64_t digest() const;

 private:
  void* state_;                   // an XXH3_state_t: the leaf under way
  uint64_t in_leaf_ = 0;          // its bytes so far
  std::vector<uint64_t> leaves_;  // the hashes of the whole leaves before it
};

// content_hash() of each range of this process's memory, where it is: host
// memory on this thread; with `maybe_device`, device memory (this
// process's, or opened from another) by the device's kernel
// (device::Device::content_hashes), one per device, and a range across
// device allocations through the host. The device's error otherwise.
Status content_hashes_in_place(std::span<const device::DeviceRange> ranges, bool maybe_device,
                               std::vector<uint64_t>* hashes);

// Link::digest's default: reads the remote side of each copy again with
// `link.run()` into scratch memory, in pieces of at most `piece_bytes`, and
// hashes it. OK, or the run's error.
Status read_digests(Link& link, std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes,
                    uint64_t piece_bytes = uint64_t{4} << 20);

}  // namespace kvbridge::transport
