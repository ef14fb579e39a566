// Device memory across hosts through pinned host memory (staging.h).
#include "transport/staging.h"

#include <algorithm>
#include <map>
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
  if (o.pool_bytes / o.chunk_bytes < 2) {
    return Status::invalid_argument("staging_bytes (" + std::to_string(o.pool_bytes) +
                                    ") must hold at least two chunks of staging_chunk_bytes (" +
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
    if (!side_->has_local()) return inner_->run(op, copies, control);
    std::vector<Copy> direct;
    std::map<int, std::vector<Copy>> staged;  // device -> its copies
    for (const Copy& c : copies) {
      const int d = side_->local_device(c.local);
      if (d < 0) {
        direct.push_back(c);
      } else {
        staged[d].push_back(c);
      }
    }
    if (staged.empty()) return inner_->run(op, copies, control);
    if (!direct.empty()) KVB_RETURN_IF_ERROR(inner_->run(op, direct, control));
    for (const auto& [d, list] : staged) KVB_RETURN_IF_ERROR(run_staged(op, d, list, control));
    return Status();
  }

  bool runs_async() const override { return true; }
  void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done) override {
    if (!side_->has_local() && inner_->runs_async()) return inner_->start(op, copies, control, std::move(done));
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

  std::unique_ptr<Link> inner_;
  std::shared_ptr<StagingPool> pool_;
  std::shared_ptr<DeviceSide> side_;
  DeviceRunOptions options_;
  std::string who_;
  RunThreads threads_;  // last: joined first
};

Status StagedLink::run_staged(TransferOp op, int dev, std::span<const Copy> copies, RunControl& control) {
  device::Device& device = side_->device();
  Status stopped;
  auto give_up = [&] {
    if (control.cancel.load(std::memory_order_acquire)) stopped = Status::cancelled(who_ + ": run cancelled");
    if (stopped.ok() && Clock::now() >= control.deadline) stopped = Status::timeout(who_ + ": run passed its deadline");
    return !stopped.ok();
  };
  if (give_up()) return stopped;
  const std::vector<Chunk> chunks = pack_chunks(copies, pool_->chunk_bytes());
  if (chunks.empty()) return Status();

  // The ready events, on the host: nothing is queued before they completed.
  KVB_ASSIGN_OR_RETURN(std::vector<std::shared_ptr<void>> events, side_->ready().resolve(control));
  for (const std::shared_ptr<void>& e : events) {
    Status s = await_event(device, e.get(), give_up);
    if (!stopped.ok()) return stopped;
    KVB_RETURN_IF_ERROR(s.with_context(who_ + ": waiting for a ready event"));
  }
  KVB_ASSIGN_OR_RETURN(StreamPool::Slot * slot, side_->pool().acquire(dev));
  StagingPool::Lease leases[2];
  bool pending[2] = {false, false};
  const bool reading = op == TransferOp::kRead;

  // Chunk k's device side, queued on the stream: a scatter from its slot
  // (reads) or a gather into it (writes).
  std::vector<device::DeviceCopy> batch;
  auto queue = [&](size_t k) -> Status {
    const size_t i = k % 2;
    if (!leases[i]) {
      KVB_ASSIGN_OR_RETURN(leases[i], pool_->acquire(control.deadline, &control.cancel, who_));
    }
    batch.clear();
    for (const ChunkPiece& p : chunks[k].pieces) {
      uint8_t* staged = leases[i].data() + p.at;
      batch.push_back(reading ? device::DeviceCopy{p.local, staged, p.bytes}
                              : device::DeviceCopy{staged, p.local, p.bytes});
    }
    KVB_RETURN_IF_ERROR(
        device.copy(slot->stream, batch, choose_method(options_, batch), options_.max_blocks).with_context(who_));
    KVB_RETURN_IF_ERROR(device.record(slot->events[i], slot->stream).with_context(who_));
    pending[i] = true;
    count_staged_chunk();
    return Status();
  };
  auto settle = [&](size_t i) -> Status {
    if (!pending[i]) return Status();
    pending[i] = false;
    return await_event(device, slot->events[i], nullptr).with_context(who_ + ": a staged copy");
  };
  // Chunk k's network side: between its slot and the peer.
  std::vector<Copy> wire;
  size_t moved = 0;
  auto move = [&](size_t k) -> Status {
    wire.clear();
    for (const ChunkPiece& p : chunks[k].pieces)
      wire.push_back(Copy{leases[k % 2].data() + p.at, p.remote, p.bytes, p.segment});
    KVB_RETURN_IF_ERROR(inner_->run(op, wire, control));
    ++moved;
    return Status();
  };

  Status out;
  if (reading) {
    // The network fills chunk k's slot while the device scatters chunk k-1's.
    for (size_t k = 0; k < chunks.size() && out.ok(); ++k) {
      out = settle(k % 2);
      if (out.ok() && !leases[k % 2]) {
        Result<StagingPool::Lease> l = pool_->acquire(control.deadline, &control.cancel, who_);
        if (l.ok()) leases[k % 2] = std::move(*l);
        out = l.status();
      }
      if (out.ok()) out = move(k);
      if (out.ok()) out = queue(k);
    }
  } else {
    // The device gathers chunk k+1 while the network sends chunk k.
    out = queue(0);
    if (out.ok() && chunks.size() > 1) out = queue(1);
    for (size_t k = 0; k < chunks.size() && out.ok(); ++k) {
      out = settle(k % 2);
      if (out.ok()) out = move(k);
      if (out.ok() && k + 2 < chunks.size()) out = queue(k + 2);
    }
  }
  // A peer gone between chunks refuses the next chunk's dial: mid-run,
  // that is the peer lost, as it would be within one chunk.
  if (out.code() == Code::kUnavailable && moved > 0) {
    out = Status::io_error(who_ + ": lost the peer after " + std::to_string(moved) + " of " +
                           std::to_string(chunks.size()) + " chunks: " + out.message());
  }
  // Whatever was queued completes before the run returns.
  for (size_t i = 0; i < 2; ++i) {
    Status s = settle(i);
    if (out.ok()) out = s;
  }
  side_->pool().release(slot);
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
