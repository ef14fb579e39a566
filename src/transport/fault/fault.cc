// The fault-injecting wrapper transport (fault.h).
#include "transport/fault/fault.h"

#include <algorithm>
#include <thread>

namespace kvbridge::transport {

void Faults::fail_run(uint64_t nth, Status error) {
  std::lock_guard<std::mutex> lock(mu_);
  fail_.emplace(started_ + std::max<uint64_t>(nth, 1), std::move(error));
}

void Faults::set_skip_copies(bool skip) {
  std::lock_guard<std::mutex> lock(mu_);
  skip_copies_ = skip;
}

void Faults::truncate_run(uint64_t nth, uint64_t bytes, Status error) {
  std::lock_guard<std::mutex> lock(mu_);
  truncate_at_ = started_ + std::max<uint64_t>(nth, 1);
  truncate_bytes_ = bytes;
  truncate_error_ = std::move(error);
}

void Faults::set_delay(std::chrono::milliseconds per_piece, uint64_t piece_bytes) {
  std::lock_guard<std::mutex> lock(mu_);
  delay_ = per_piece;
  delay_piece_ = std::max<uint64_t>(piece_bytes, 1);
}

void Faults::set_cancel_linger(std::chrono::milliseconds linger) {
  std::lock_guard<std::mutex> lock(mu_);
  linger_ = linger;
}

void Faults::drop_notifications(uint64_t count, std::string prefix) {
  std::lock_guard<std::mutex> lock(mu_);
  drops_ = count;
  drop_prefix_ = std::move(prefix);
}

void Faults::set_notification_chaos(uint32_t drop_per_mille, uint32_t duplicate_per_mille, uint64_t seed) {
  std::lock_guard<std::mutex> lock(mu_);
  chaos_drop_ = std::min<uint32_t>(drop_per_mille, 1000);
  chaos_duplicate_ = std::min<uint32_t>(duplicate_per_mille, 1000);
  chaos_state_ = seed;
}

void Faults::clear() {
  std::lock_guard<std::mutex> lock(mu_);
  fail_.reset();
  truncate_at_.reset();
  delay_ = linger_ = std::chrono::milliseconds(0);
  skip_copies_ = false;
  drops_ = 0;
  chaos_drop_ = chaos_duplicate_ = 0;
}

uint32_t Faults::draw() {
  // splitmix64: a small generator whose whole state is one word.
  uint64_t z = (chaos_state_ += 0x9e3779b97f4a7c15ull);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
  return static_cast<uint32_t>((z ^ (z >> 31)) % 1000);
}

bool Faults::take_notification_drop(std::string_view message) {
  std::lock_guard<std::mutex> lock(mu_);
  if (drops_ > 0 && message.substr(0, drop_prefix_.size()) == drop_prefix_) {
    --drops_;
    return true;
  }
  return chaos_drop_ > 0 && draw() < chaos_drop_;
}

bool Faults::take_notification_duplicate(std::string_view message) {
  (void)message;
  std::lock_guard<std::mutex> lock(mu_);
  return chaos_duplicate_ > 0 && draw() < chaos_duplicate_;
}

bool Faults::slows_runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return delay_.count() > 0 || linger_.count() > 0;
}

bool Faults::arms_runs() const {
  std::lock_guard<std::mutex> lock(mu_);
  return fail_ || truncate_at_ || delay_.count() > 0 || linger_.count() > 0 || skip_copies_;
}

uint64_t Faults::runs_started() const {
  std::lock_guard<std::mutex> lock(mu_);
  return started_;
}

uint64_t Faults::runs_active() const {
  std::lock_guard<std::mutex> lock(mu_);
  return active_;
}

Faults::Plan Faults::begin_run() {
  std::lock_guard<std::mutex> lock(mu_);
  const uint64_t n = ++started_;
  ++active_;
  Plan p;
  if (fail_ && fail_->first == n) {
    p.fail = fail_->second;
    fail_.reset();
  }
  if (truncate_at_ && *truncate_at_ == n) {
    p.truncate_bytes = truncate_bytes_;
    p.truncate_error = truncate_error_;
    truncate_at_.reset();
  }
  p.delay = delay_;
  p.delay_piece = delay_piece_;
  p.linger = linger_;
  p.skip_copies = skip_copies_;
  return p;
}

void Faults::end_run() {
  std::lock_guard<std::mutex> lock(mu_);
  --active_;
}

namespace {

class FaultLink final : public Link {
 public:
  FaultLink(std::unique_ptr<Link> inner, std::shared_ptr<Faults> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}

  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    Faults::Plan plan = faults_->begin_run();
    Status s = execute(plan, op, copies, control);
    faults_->end_run();
    return s;
  }

  Status refresh(const PeerInfo& peer) override { return inner_->refresh(peer); }
  // The inner link's, never faulted: a content check sees the bytes as
  // they are, so a run that lied about its copies is caught by it.
  Status digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes) override {
    return inner_->digest(copies, control, hashes);
  }
  // As the inner link, unless runs are armed to be slow: a test's slow
  // transfer must stay on the engine's threads, where it can be cancelled.
  bool runs_inline() const override { return inner_->runs_inline() && !faults_->slows_runs(); }
  // As the inner link while no fault of a run is armed: the faults are
  // played on the engine's thread, by run().
  bool runs_async() const override { return inner_->runs_async() && !faults_->arms_runs(); }
  void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done) override {
    Faults::Plan plan = faults_->begin_run();
    if (plan.any()) {
      // Armed since runs_async() said no: play it here, synchronously.
      Status s = execute(plan, op, copies, control);
      faults_->end_run();
      done(std::move(s));
      return;
    }
    inner_->start(op, copies, control, [faults = faults_, done = std::move(done)](Status s) {
      faults->end_run();
      done(std::move(s));
    });
  }

 private:
  Status execute(const Faults::Plan& plan, TransferOp op, std::span<const Copy> copies, RunControl& control) {
    if (plan.fail) return *plan.fail;
    if (!plan.any()) return inner_->run(op, copies, control);
    if (plan.skip_copies) {
      uint64_t bytes = 0;
      for (const Copy& c : copies) bytes += c.bytes;
      control.bytes_done.fetch_add(bytes, std::memory_order_release);
      return Status();
    }
    // Copy by copy, through a private RunControl, so this wrapper decides
    // when the inner link stops (the linger) and can cut a copy short.
    uint64_t budget = plan.truncate_bytes.value_or(UINT64_MAX);
    std::optional<Clock::time_point> stop_seen;
    auto should_return = [&]() -> std::optional<Status> {
      const bool cancel = control.cancel.load(std::memory_order_acquire);
      if (!cancel && Clock::now() < control.deadline) return std::nullopt;
      if (!stop_seen) stop_seen = Clock::now();
      if (Clock::now() - *stop_seen < plan.linger) return std::nullopt;
      return cancel ? Status::cancelled("fault: run cancelled") : Status::timeout("fault: run passed its deadline");
    };
    // Without a delay a copy is one piece.
    const uint64_t piece = plan.delay.count() > 0 ? plan.delay_piece : UINT64_MAX;
    for (const Copy& c : copies) {
      for (uint64_t off = 0; off < c.bytes;) {
        for (auto slept = std::chrono::milliseconds(0); slept < plan.delay;) {
          if (auto r = should_return()) return *r;
          const auto step = std::min(plan.delay - slept, std::chrono::milliseconds(2));
          std::this_thread::sleep_for(step);
          slept += step;
        }
        if (auto r = should_return()) return *r;
        Copy part{c.local + off, c.remote + off, std::min({c.bytes - off, piece, budget}), c.segment};
        off += std::min(c.bytes - off, piece);
        if (part.bytes > 0) {
          RunControl inner_control;
          Status s = inner_->run(op, std::span<const Copy>(&part, 1), inner_control);
          control.bytes_done.fetch_add(inner_control.bytes_done.load(std::memory_order_acquire),
                                       std::memory_order_release);
          if (!s.ok()) return s;
          budget -= part.bytes;
        }
        if (plan.truncate_bytes && budget == 0) return plan.truncate_error;
      }
    }
    if (plan.truncate_bytes) return plan.truncate_error;
    return Status();
  }

  std::unique_ptr<Link> inner_;
  std::shared_ptr<Faults> faults_;
};

class FaultTransport final : public Transport {
 public:
  FaultTransport(std::unique_ptr<Transport> inner, std::shared_ptr<Faults> faults)
      : inner_(std::move(inner)), faults_(std::move(faults)) {}
  std::string_view name() const override { return inner_->name(); }
  bool serves(std::string_view memory) const override { return inner_->serves(memory); }
  bool moves(bool local_device, bool remote_device) const override {
    return inner_->moves(local_device, remote_device);
  }
  std::string address() const override { return inner_->address(); }
  Status can_reach(const PeerInfo& peer) const override { return inner_->can_reach(peer); }
  Result<std::string> add_segment(const Segment& segment) override { return inner_->add_segment(segment); }
  Status remove_segment(uint32_t id) override { return inner_->remove_segment(id); }
  void set_local_identity(std::string_view name, uint64_t instance) override {
    inner_->set_local_identity(name, instance);
  }
  void grant(uint64_t grant, const std::string& label, std::shared_ptr<const GrantPlaces> places, bool read) override {
    inner_->grant(grant, label, std::move(places), read);
  }
  void share(uint64_t grant, const std::string& label, uint64_t like) override { inner_->share(grant, label, like); }
  void revoke(uint64_t grant) override { inner_->revoke(grant); }
  Result<std::unique_ptr<Link>> connect(const PeerInfo& peer) override {
    KVB_ASSIGN_OR_RETURN(std::unique_ptr<Link> link, inner_->connect(peer));
    return std::unique_ptr<Link>(std::make_unique<FaultLink>(std::move(link), faults_));
  }

 private:
  std::unique_ptr<Transport> inner_;
  std::shared_ptr<Faults> faults_;
};

}  // namespace

std::unique_ptr<Transport> make_fault_transport(std::unique_ptr<Transport> inner, std::shared_ptr<Faults> faults) {
  return std::make_unique<FaultTransport>(std::move(inner), std::move(faults));
}

}  // namespace kvbridge::transport
