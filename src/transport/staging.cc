// Device memory across hosts through pinned host memory (staging.h).
#include "transport/staging.h"

#include <algorithm>
#include <cstring>
#include <map>
#include <optional>
#include <thread>

#include "transport/copies.h"

namespace kvbridge::transport {

namespace {
std::atomic<uint64_t> g_staged_chunks{0};
}  // namespace

uint64_t staged_chunks() { return g_staged_chunks.load(std::memory_order_relaxed); }
void count_staged_chunk() { g_staged_chunks.fetch_add(1, std::memory_order_relaxed); }

std::vector<Chunk> pack_chunks(std::span<const Copy> copies, uint64_t chunk_bytes) {
  std::vector<Chunk> chunks;
  for (const Copy& c : copies) {
    for (uint64_t done = 0; done < c.bytes;) {
      if (chunks.empty() || chunks.back().bytes == chunk_bytes) chunks.emplace_back();
      Chunk& k = chunks.back();
      const uint64_t n = std::min(c.bytes - done, chunk_bytes - k.bytes);
      k.pieces.push_back(ChunkPiece{c.local + done, c.remote + done, n, c.segment, k.bytes});
      k.bytes += n;
      done += n;
    }
  }
  return chunks;
}

Status check_staging_options(const StagingOptions& o) {
  if (o.chunk_bytes < (uint64_t{64} << 10) || o.chunk_bytes > (uint64_t{1} << 30)) {
    return Status::invalid_argument("staging_chunk_bytes must be between 64 KiB and 1 GiB, not " +
                                    std::to_string(o.chunk_bytes));
  }
  if (o.pool_bytes / o.chunk_bytes < 3) {
    return Status::invalid_argument("staging_bytes (" + std::to_string(o.pool_bytes) +
                                    ") must hold at least three chunks of staging_chunk_bytes (" +
                                    std::to_string(o.chunk_bytes) + ")");
  }
  return Status();
}

// --- StagingPool ---------------------------------------------------------------

StagingPool::StagingPool(device::Device& device, StagingOptions options) : device_(device), options_(options) {}

StagingPool::~StagingPool() {
  if (pinned_) (void)device_.unregister_host(memory_.data());
}

size_t StagingPool::slots() const { return static_cast<size_t>(options_.pool_bytes / options_.chunk_bytes); }

StagingPool::Lease& StagingPool::Lease::operator=(Lease&& o) noexcept {
  if (this != &o) {
    reset();
    std::swap(pool_, o.pool_);
    std::swap(data_, o.data_);
  }
  return *this;
}

void StagingPool::Lease::reset() {
  if (data_ == nullptr) return;
  {
    std::lock_guard lock(pool_->mu_);
    pool_->free_.push_back(data_);
  }
  pool_->freed_.notify_one();
  data_ = nullptr;
  pool_ = nullptr;
}

Status StagingPool::allocate_locked() {
  const uint64_t bytes = slots() * options_.chunk_bytes;
  KVB_ASSIGN_OR_RETURN(memory_, HostMemory::allocate(bytes));
  Status pinned = device_.register_host(memory_.data(), bytes);
  if (!pinned.ok()) {
    memory_ = HostMemory();
    return Status::resource_exhausted("staging pool: cannot pin " + std::to_string(bytes) +
                                      " bytes of host memory: " + pinned.message());
  }
  pinned_ = true;
  for (size_t i = slots(); i-- > 0;) free_.push_back(memory_.data() + i * options_.chunk_bytes);
  return Status();
}

Result<StagingPool::Lease> StagingPool::acquire(Clock::time_point deadline, const std::atomic<bool>* cancel,
                                                const std::string& who) {
  std::unique_lock lock(mu_);
  if (!pinned_) KVB_RETURN_IF_ERROR(allocate_locked().with_context(who));
  while (free_.empty()) {
    if (cancel != nullptr && cancel->load()) return Status::cancelled(who + ": cancelled waiting for a staging slot");
    if (Clock::now() >= deadline) {
      return Status::resource_exhausted(who + ": no staging slot freed before the deadline (all " +
                                        std::to_string(slots()) + " slots of " + std::to_string(options_.chunk_bytes) +
                                        " bytes busy; a larger staging_bytes stages more runs at once)");
    }
    freed_.wait_until(lock, std::min(deadline, Clock::now() + std::chrono::milliseconds(5)));
  }
  Lease lease;
  lease.pool_ = this;
  lease.data_ = free_.back();
  free_.pop_back();
  return lease;
}

// --- Between device memory and host memory -----------------------------------

namespace {

// Why a staged run stops between chunks: its cancel or its deadline (the
// first seen is kept).
class RunStop {
 public:
  RunStop(const RunControl& control, std::string who) : control_(control), who_(std::move(who)) {}
  bool operator()() {
    if (control_.cancel.load(std::memory_order_acquire)) why_ = Status::cancelled(who_ + ": run cancelled");
    if (why_.ok() && Clock::now() >= control_.deadline) why_ = Status::timeout(who_ + ": run passed its deadline");
    return !why_.ok();
  }
  const Status& why() const { return why_; }

 private:
  const RunControl& control_;
  std::string who_;
  Status why_;
};

// Waits, on the host, for the run's ready events (the producer's "this KV
// is ready after this") before its first device copy, as device_run.h's
// runs do; stops as `stop` says.
Status await_ready(DeviceSide& side, RunControl& control, RunStop& stop, const std::string& who) {
  KVB_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<void>> events, side.ready().resolve(control));
  for (const std::shared_ptr<void>& e : events) {
    Status s = await_event(side.device(), e.get(), [&] { return stop(); });
    if (!stop.why().ok()) return stop.why();
    KVB_RETURN_IF_ERROR(s.with_context(who + ": waiting for a ready event"));
  }
  return Status();
}

}  // namespace

Status run_host_staged(StagingPool& pool, DeviceSide& side, int device, std::span<const device::DeviceCopy> copies,
                       bool to_device, const DeviceRunOptions& options, RunControl& control, const std::string& who) {
  device::Device& dev = side.device();
  RunStop stop(control, who);
  if (stop()) return stop.why();
  // A chunk piece's `local` is the device side, its `remote` the host side.
  std::vector<Copy> as_copies;
  as_copies.reserve(copies.size());
  for (const device::DeviceCopy& c : copies) {
    const void* host = to_device ? c.src : c.dst;
    const void* on_device = to_device ? c.dst : c.src;
    as_copies.push_back(
        Copy{static_cast<uint8_t*>(const_cast<void*>(on_device)), reinterpret_cast<uint64_t>(host), c.bytes, 0});
  }
  const std::vector<Chunk> chunks = pack_chunks(as_copies, pool.chunk_bytes());
  if (chunks.empty()) return Status();

  KVB_RETURN_IF_ERROR(await_ready(side, control, stop, who));
  KVB_ASSIGN_OR_RETURN(StreamPool::Slot * slot, side.pool().acquire(device));
  StagingPool::Lease leases[2];
  bool queued[2] = {false, false};
  std::vector<device::DeviceCopy> batch;
  // Chunk k in place k % 2: to the device, the host fills the slot and the
  // device scatters it; from the device, the device gathers into the slot.
  auto queue = [&](size_t k) -> Status {
    const size_t i = k % 2;
    if (stop()) return stop.why();
    if (!leases[i]) {
      KVB_ASSIGN_OR_RETURN(leases[i], pool.acquire(control.deadline, &control.cancel, who));
    }
    batch.clear();
    for (const ChunkPiece& p : chunks[k].pieces) {
      uint8_t* staged = leases[i].data() + p.at;
      auto* host = reinterpret_cast<uint8_t*>(p.remote);
      if (to_device) {
        std::memcpy(staged, host, p.bytes);
        batch.push_back(device::DeviceCopy{p.local, staged, p.bytes});
      } else {
        batch.push_back(device::DeviceCopy{staged, p.local, p.bytes});
      }
    }
    KVB_RETURN_IF_ERROR(
        dev.copy(slot->stream, batch, choose_method(options, batch), options.max_blocks).with_context(who));
    KVB_RETURN_IF_ERROR(dev.record(slot->events[i], slot->stream).with_context(who));
    queued[i] = true;
    count_staged_chunk();
    return Status();
  };
  // Chunk k's device copy completed; from the device, the host copies its
  // pieces out of the slot.
  auto settle = [&](size_t k, bool copy_out) -> Status {
    const size_t i = k % 2;
    if (!queued[i]) return Status();
    queued[i] = false;
    KVB_RETURN_IF_ERROR(await_event(dev, slot->events[i], nullptr).with_context(who + ": a staged copy"));
    if (!to_device && copy_out) {
      for (const ChunkPiece& p : chunks[k].pieces) {
        std::memcpy(reinterpret_cast<uint8_t*>(p.remote), leases[i].data() + p.at, p.bytes);
      }
    }
    return Status();
  };
  const size_t n = chunks.size();
  Status out;
  if (to_device) {
    // The host fills chunk k while the device scatters chunk k-1.
    for (size_t k = 0; k < n && out.ok(); ++k) {
      if (k >= 2) out = settle(k - 2, true);
      if (out.ok()) out = queue(k);
    }
  } else {
    // The host empties chunk k while the device gathers chunk k+1.
    out = queue(0);
    for (size_t k = 0; k < n && out.ok(); ++k) {
      if (k + 1 < n) out = queue(k + 1);
      if (out.ok()) out = settle(k, true);
    }
  }
  for (size_t k = n >= 2 ? n - 2 : 0; to_device && k < n && out.ok(); ++k) out = settle(k, true);
  // After a failure what is queued still completes before the run returns
  // (nothing is copied out of it).
  for (size_t i = 0; i < 2; ++i) {
    Status s = settle(i, false);
    if (out.ok()) out = s;
  }
  side.pool().release(slot);
  return out;
}

// --- StagedLink ---------------------------------------------------------------

namespace {

class StagedLink final : public Link {
 public:
  StagedLink(std::unique_ptr<Link> inner, std::shared_ptr<StagingPool> pool, std::shared_ptr<DeviceSide> side,
             DeviceRunOptions options, std::string who)
      : inner_(std::move(inner)),
        pool_(std::move(pool)),
        side_(std::move(side)),
        options_(options),
        who_(std::move(who)),
        threads_(4, "kvb-stage-run") {}

  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    if (!any_staged(copies)) return inner_->run(op, copies, control);
    std::vector<Copy> direct;
    std::map<int, std::vector<Copy>> staged;  // device -> its copies
    DeviceSide::Span span;
    for (const Copy& c : copies) {
      if (!span.contains(c.local)) span = side_->local_span(c.local);
      if (span.device < 0) {
        direct.push_back(c);
      } else {
        staged[span.device].push_back(c);
      }
    }
    if (!direct.empty()) KVB_RETURN_IF_ERROR(inner_->run(op, direct, control));
    for (const auto& [d, list] : staged) KVB_RETURN_IF_ERROR(run_staged(op, d, list, control));
    return Status();
  }

  bool runs_async() const override { return true; }
  void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done) override {
    // A run of host memory only goes to the inner link as it is.
    if (inner_->runs_async() && !any_staged(copies)) return inner_->start(op, copies, control, std::move(done));
    auto shared_done = std::make_shared<std::function<void(Status)>>(std::move(done));
    Status posted =
        threads_.post([this, op, copies, &control, shared_done] { (*shared_done)(run(op, copies, control)); });
    if (!posted.ok()) (*shared_done)(posted.with_context(who_));
  }
  Status refresh(const PeerInfo& peer) override { return inner_->refresh(peer); }
  Status digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes) override {
    return inner_->digest(copies, control, hashes);
  }

 private:
  Status run_staged(TransferOp op, int dev, std::span<const Copy> copies, RunControl& control);
  // Whether any copy's local bytes are device memory (a lookup per span
  // of one kind, none without device segments).
  bool any_staged(std::span<const Copy> copies) const {
    if (!side_->has_local()) return false;
    DeviceSide::Span span;
    for (const Copy& c : copies) {
      if (!span.contains(c.local)) span = side_->local_span(c.local);
      if (span.device >= 0) return true;
    }
    return false;
  }

  std::unique_ptr<Link> inner_;
  std::shared_ptr<StagingPool> pool_;
  std::shared_ptr<DeviceSide> side_;
  DeviceRunOptions options_;
  std::string who_;
  RunThreads threads_;  // last: joined first
};

// The outcomes of the network runs a staged run has in flight, one per
// ring place, set by the inner link's `done` (any thread).
class Outcomes {
 public:
  void reset(size_t i) {
    std::lock_guard lock(mu_);
    status_[i].reset();
  }
  // Notifies under the lock: the waiter may return and destroy this as
  // soon as it sees the status.
  void set(size_t i, Status s) {
    std::lock_guard lock(mu_);
    status_[i] = std::move(s);
    cv_.notify_all();
  }
  Status wait(size_t i) {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [&] { return status_[i].has_value(); });
    return *status_[i];
  }

 private:
  std::mutex mu_;
  std::condition_variable cv_;
  std::optional<Status> status_[3];
};

Status StagedLink::run_staged(TransferOp op, int dev, std::span<const Copy> copies, RunControl& control) {
  device::Device& device = side_->device();
  RunStop stop(control, who_);
  if (stop()) return stop.why();
  const std::vector<Chunk> chunks = pack_chunks(copies, pool_->chunk_bytes());
  if (chunks.empty()) return Status();

  // The ready events, on the host: nothing is queued before they completed.
  KVB_RETURN_IF_ERROR(await_ready(*side_, control, stop, who_));
  KVB_ASSIGN_OR_RETURN(StreamPool::Slot * slot, side_->pool().acquire(dev));
  const bool reading = op == TransferOp::kRead;
  const size_t n = chunks.size();

  // Chunk k uses ring place k % 3: its slot, its device copy's event, its
  // network run. Three places, so that the device's copy of one chunk and
  // the network's moves of the next two overlap.
  StagingPool::Lease leases[3];
  bool copying[3] = {false, false, false};  // a device copy is queued
  bool moving[3] = {false, false, false};   // a network run is in flight
  std::vector<Copy> wire[3];
  std::vector<device::DeviceCopy> batch;
  Outcomes outcomes;
  Status out;
  size_t moved = 0;

  auto lease = [&](size_t i) -> Status {
    if (leases[i]) return Status();
    KVB_ASSIGN_OR_RETURN(leases[i], pool_->acquire(control.deadline, &control.cancel, who_));
    return Status();
  };
  // Chunk k's device side, queued on the stream: a scatter from its slot
  // (reads) or a gather into it (writes).
  auto copy = [&](size_t k) -> Status {
    const size_t i = k % 3;
    KVB_RETURN_IF_ERROR(lease(i));
    batch.clear();
    for (const ChunkPiece& p : chunks[k].pieces) {
      uint8_t* staged = leases[i].data() + p.at;
      batch.push_back(reading ? device::DeviceCopy{p.local, staged, p.bytes}
                              : device::DeviceCopy{staged, p.local, p.bytes});
    }
    KVB_RETURN_IF_ERROR(
        device.copy(slot->stream, batch, choose_method(options_, batch), options_.max_blocks).with_context(who_));
    KVB_RETURN_IF_ERROR(device.record(slot->events[i], slot->stream).with_context(who_));
    copying[i] = true;
    count_staged_chunk();
    return Status();
  };
  auto settle_copy = [&](size_t i) -> Status {
    if (!copying[i]) return Status();
    copying[i] = false;
    return await_event(device, slot->events[i], nullptr).with_context(who_ + ": a staged copy");
  };
  // Chunk k's network side, between its slot and the peer, started on the
  // inner link (its own threads when it has them).
  auto start = [&](size_t k) -> Status {
    const size_t i = k % 3;
    KVB_RETURN_IF_ERROR(lease(i));
    wire[i].clear();
    for (const ChunkPiece& p : chunks[k].pieces)
      wire[i].push_back(Copy{leases[i].data() + p.at, p.remote, p.bytes, p.segment});
    outcomes.reset(i);
    moving[i] = true;
    if (inner_->runs_async()) {
      inner_->start(op, wire[i], control, [&outcomes, i](Status s) { outcomes.set(i, std::move(s)); });
    } else {
      outcomes.set(i, inner_->run(op, wire[i], control));
    }
    return Status();
  };
  auto settle_move = [&](size_t i) -> Status {
    if (!moving[i]) return Status();
    moving[i] = false;
    Status s = outcomes.wait(i);
    if (s.ok()) ++moved;
    return s;
  };

  if (reading) {
    // Chunk k arrives while chunk k+1 is on its way and chunk k-1 scatters.
    for (size_t k = 0; k < std::min<size_t>(n, 2) && out.ok(); ++k) out = start(k);
    for (size_t k = 0; k < n && out.ok(); ++k) {
      out = settle_move(k % 3);
      if (out.ok()) out = copy(k);
      // Chunk k+2 goes into the place of chunk k-1, once that scattered.
      if (out.ok() && k + 2 < n) out = settle_copy((k + 2) % 3);
      if (out.ok() && k + 2 < n) out = start(k + 2);
    }
  } else {
    // Chunk k is sent while chunk k-1 is still on its way and chunk k+1 is
    // gathered.
    out = copy(0);
    for (size_t k = 0; k < n && out.ok(); ++k) {
      // Chunk k+1 goes into the place of chunk k-2, once that was sent.
      if (k + 1 < n) {
        out = settle_move((k + 1) % 3);
        if (out.ok()) out = copy(k + 1);
      }
      if (out.ok()) out = settle_copy(k % 3);
      if (out.ok()) out = start(k);
    }
  }
  // Whatever is in flight ends before the run returns: the network's runs
  // (their slots), then the device's copies.
  for (size_t i = 0; i < 3; ++i) {
    Status s = settle_move(i);
    if (out.ok()) out = s;
  }
  for (size_t i = 0; i < 3; ++i) {
    Status s = settle_copy(i);
    if (out.ok()) out = s;
  }
  side_->pool().release(slot);
  // A peer gone between chunks refuses the next chunk's dial: mid-run,
  // that is the peer lost, as it would be within one chunk.
  if (out.code() == Code::kUnavailable && moved > 0) {
    out = Status::io_error(who_ + ": lost the peer after " + std::to_string(moved) + " of " + std::to_string(n) +
                           " chunks: " + out.message());
  }
  return out;
}

}  // namespace

std::unique_ptr<Link> make_staged_link(std::unique_ptr<Link> inner, std::shared_ptr<StagingPool> pool,
                                       std::shared_ptr<DeviceSide> side, DeviceRunOptions device_options,
                                       std::string who) {
  return std::make_unique<StagedLink>(std::move(inner), std::move(pool), std::move(side), device_options,
                                      std::move(who));
}

}  // namespace kvbridge::transport
