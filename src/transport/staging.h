// transport/staging.h: device memory across hosts, through pinned host
// memory. The network transports (tcp) move host memory; a run whose local
// side is device memory goes through a staging pool instead:
//
//   read:  network -> pinned chunk -> scatter into the device (one batch)
//   write: gather from the device (one batch) -> pinned chunk -> network
//
// A run is cut, in order, into chunks of `chunk_bytes` (pack_chunks: a copy
// cut where a chunk fills), so the network moves whole chunks whatever the
// descriptor size and the device does one batched copy per chunk. Three
// chunks are in flight, each in a slot of its own: the device's gather or
// scatter of one overlaps the network's moves of two others (started on
// the inner link's own threads), so the peer prepares one chunk while it
// sends another. The serving side of a transport (tcp's server) stages its
// own device memory the same way, chunk by chunk per stream, so that device
// to device, device to host and host to device all cross hosts.
//
// The pool is pinned once (Device::register_host, on first use) and its
// slots are reused; a run that cannot get a slot within its deadline fails
// with kResourceExhausted naming the pool's size (EngineOptions'
// staging_bytes).
//
// Ordering: a staged run waits for its ready events (the producer's "this
// KV is ready after this") on the host before its first device copy, as
// device_run.h's runs do. A run returns only when every network run and
// device copy it started completed (the Link contract: nothing lands after
// run() returns).
//
// Thread-safety: a StagingPool and a StagedLink may be used from any
// thread; pack_chunks is pure.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

#include "device/device.h"
#include "kvbridge/host_memory.h"
#include "kvbridge/status.h"
#include "transport/device_run.h"
#include "transport/transport.h"

namespace kvbridge::transport {

// One piece of a chunk: the copy's `bytes` at `local` (device or host
// memory here) and `remote` (the peer's address in `segment`), staged at
// offset `at` of the chunk.
struct ChunkPiece {
  uint8_t* local = nullptr;
  uint64_t remote = 0;
  uint64_t bytes = 0;
  uint32_t segment = 0;
  uint64_t at = 0;
};
struct Chunk {
  uint64_t bytes = 0;
  std::vector<ChunkPiece> pieces;
};
// Cuts `copies`, in order, into chunks of at most `chunk_bytes` (> 0) each,
// cutting a copy where a chunk fills; zero-byte copies are dropped.
std::vector<Chunk> pack_chunks(std::span<const Copy> copies, uint64_t chunk_bytes);

// StagingOptions (transport.h): the pool's and a chunk's bytes.
// kInvalidArgument naming what is wrong: a chunk under 64 KiB or over 1 GiB,
// a pool smaller than three chunks (what one run holds).
Status check_staging_options(const StagingOptions& options);

class StagingPool {
 public:
  StagingPool(device::Device& device, StagingOptions options);
  ~StagingPool();  // unpins and frees; no lease may be out
  StagingPool(const StagingPool&) = delete;
  StagingPool& operator=(const StagingPool&) = delete;

  // One slot of chunk_bytes, back to the pool when the lease goes.
  class Lease {
   public:
    Lease() = default;
    Lease(Lease&& o) noexcept : pool_(o.pool_), data_(o.data_) { o.pool_ = nullptr, o.data_ = nullptr; }
    Lease& operator=(Lease&& o) noexcept;
    ~Lease() { reset(); }
    uint8_t* data() const { return data_; }
    explicit operator bool() const { return data_ != nullptr; }
    void reset();

   private:
    friend class StagingPool;
    StagingPool* pool_ = nullptr;
    uint8_t* data_ = nullptr;
  };
  // A free slot, waiting for one until `deadline` or `cancel`: kTimeout or
  // kCancelled, or kResourceExhausted when the pool cannot be pinned.
  // kResourceExhausted also when every slot stayed busy past the deadline,
  // naming the pool's size. The pool is allocated and pinned on first use.
  Result<Lease> acquire(Clock::time_point deadline, const std::atomic<bool>* cancel, const std::string& who);

  uint64_t chunk_bytes() const { return options_.chunk_bytes; }
  size_t slots() const;
  device::Device& device() { return device_; }

 private:
  Status allocate_locked();
  device::Device& device_;
  const StagingOptions options_;
  mutable std::mutex mu_;
  std::condition_variable freed_;
  HostMemory memory_;
  bool pinned_ = false;
  std::vector<uint8_t*> free_;
};

// How many chunks this process has staged (gathered or scattered through
// a slot), client and server sides: tests and the bench see that staging
// happened, and count chunks against bytes.
uint64_t staged_chunks();
void count_staged_chunk();

// Copies between device memory of `device` and host memory that need not
// be pinned (the prefix store's objects) through `pool`: `to_device`, each
// copy's src is host memory and its dst device memory (the host copies a
// chunk's pieces into a slot, the device scatters the slot in one batch);
// otherwise the reverse (one batched gather into a slot, then the host
// copies the pieces out). Two chunks in flight: the host's copy of one
// overlaps the device's copy of the other. Waits for control's ready
// events first, on the host; stops between chunks at control's cancel or
// deadline; returns once every device copy it queued completed.
Status run_host_staged(StagingPool& pool, DeviceSide& side, int device, std::span<const device::DeviceCopy> copies,
                       bool to_device, const DeviceRunOptions& options, RunControl& control, const std::string& who);

// A Link whose local side may be device memory: copies whose local bytes
// lie in a device segment of `side` are staged through `pool` and moved by
// `inner` between the pool and the peer; the others go to `inner` as they
// are. `inner` moves host memory only. Digests are `inner`'s (the peer
// hashes its side).
std::unique_ptr<Link> make_staged_link(std::unique_ptr<Link> inner, std::shared_ptr<StagingPool> pool,
                                       std::shared_ptr<DeviceSide> side, DeviceRunOptions device_options,
                                       std::string who);

}  // namespace kvbridge::transport
