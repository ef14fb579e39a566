// tools/demo_runner.h: what a `kvbridge demo` rank plays of an engine's
// model runner: the KV memory its forward pass writes and its decode reads
// (host memory, or with --memory cuda device memory with a host mirror),
// and the compute a layer spends.
//
// Thread-safety: none; one rank thread uses it.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "device/device.h"
#include "kvbridge/content.h"
#include "kvbridge/host_memory.h"
#include "kvbridge/layout.h"
#include "kvbridge/plan.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::demo {

// One rank's tensors. In host memory (huge pages where the kernel has them,
// as an engine's host KV cache should be: cma's copies pin every page they
// touch), registered() and host() are the same spans. After to_device()
// registered() names device memory of one GPU and host() is a mirror that
// the content functions fill and check; sync() copies a request's cells
// between the two.
class RankMemory {
 public:
  // One buffer per tensor of `layout`. With `sentinel`, each is populated
  // and set to it (a decode rank: every byte no request holds keeps it);
  // without, left unpopulated (a prefill's pool can be far larger than what
  // its requests use: make_resident() maps a request's blocks first).
  static Result<RankMemory> allocate(const Layout& layout, std::optional<uint8_t> sentinel);

  // --memory cuda: moves every tensor to device memory of GPU `rank` mod
  // the device count, makes one interprocess event per layer of `layout`
  // (a streamed layer's readers wait on its latest record), and sets the
  // tensors' memory in `layout` to cuda:N.
  Status to_device(Layout& layout, uint32_t rank);

  bool on_device() const { return device_; }
  // What the worker registers, and what the content functions read and write.
  std::vector<std::span<uint8_t>>& registered() { return spans_; }
  std::vector<std::span<uint8_t>>& host() { return host_; }

  // Copies the cells of `q` on `side` (from `first_token`) between the host
  // mirror and device memory as one batched copy on stream(), and waits for
  // it unless `queue_only` (the caller then orders what reads the bytes
  // after the stream's events). Nothing in host memory.
  Status sync(const Layout& layout, const Request& q, RequestSide side, uint64_t first_token, bool to_device,
              bool queue_only = false);
  // The whole of tensor `t` from device memory into its mirror (nothing in
  // host memory).
  Status pull(size_t t);
  // Faults in the pages of `q`'s cells (its remote side: the prefill's),
  // adjacent cells of a tensor in one call, leaving the bytes as they are:
  // an engine's KV memory is resident before a request is admitted.
  Status make_resident(const Layout& layout, const Request& q);

  // --memory cuda: the stream the KV is written on, and per layer ordinal
  // (layer_order) its interprocess event and that event's IPC handle.
  device::Stream stream() const { return stream_; }
  device::Event layer_event(size_t layer) const { return layer_events_.at(layer); }
  const std::string& layer_handle(size_t layer) const { return layer_handles_.at(layer); }

 private:
  std::vector<HostMemory> memory_;         // the tensors' host memory
  std::vector<std::span<uint8_t>> spans_;  // registered (device memory after to_device())
  std::vector<std::span<uint8_t>> host_;   // the mirror (spans_ in host memory)
  bool device_ = false;
  int gpu_ = 0;
  device::Stream stream_ = nullptr;
  device::Event event_ = nullptr;            // sync()'s wait
  std::vector<device::Event> layer_events_;  // per layer ordinal, interprocess
  std::vector<std::string> layer_handles_;   // their IPC handles
};

// Real CPU work until `until`, as a layer's compute: multiply-adds on a
// small matrix until the clock says so (a sleep would leave the core to the
// transfer threads).
void busy_until(std::chrono::steady_clock::time_point until);

}  // namespace kvbridge::cli::demo
