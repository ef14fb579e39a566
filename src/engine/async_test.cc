// The engine's asynchronous runs (Link::runs_async), over a test transport:
// the local transport whose links run on a thread of their own, as the ucx
// link runs on its worker thread. This is the path's coverage in builds
// without UCX (the TSan build among them).
#include <gtest/gtest.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <thread>

#include "engine/engine_impl.h"
#include "kvbridge/engine.h"

namespace kvbridge {
namespace {

using namespace std::chrono_literals;
using transport::Copy;
using transport::Link;
using transport::RunControl;

// Runs the inner link's runs one at a time on its own thread; `delay`
// slows each copy (checking cancel and the deadline as a link must).
class ThreadLink final : public Link {
 public:
  ThreadLink(std::unique_ptr<Link> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay), thread_([this] { loop(); }) {}
  ~ThreadLink() override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  Status run(TransferOp op, std::span<const Copy> copies, RunControl& control) override {
    return inner_->run(op, copies, control);
  }
  Status refresh(const transport::PeerInfo& peer) override { return inner_->refresh(peer); }
  bool runs_async() const override { return true; }
  void start(TransferOp op, std::span<const Copy> copies, RunControl& control,
             std::function<void(Status)> done) override {
    {
      std::lock_guard<std::mutex> lock(mu_);
      work_.push_back(Work{op, copies, &control, std::move(done)});
    }
    cv_.notify_all();
  }

 private:
  struct Work {
    TransferOp op;
    std::span<const Copy> copies;
    RunControl* control;
    std::function<void(Status)> done;
  };
  void loop() {
    std::unique_lock<std::mutex> lock(mu_);
    while (true) {
      cv_.wait(lock, [&] { return quit_ || !work_.empty(); });
      if (work_.empty()) return;
      Work w = std::move(work_.front());
      work_.pop_front();
      lock.unlock();
      Status s;
      for (const Copy& c : w.copies) {
        if (delay_.count() > 0) {
          for (auto slept = 0ms; slept < delay_ && s.ok(); slept += 1ms) {
            std::this_thread::sleep_for(1ms);
            if (w.control->cancel.load())
              s = Status::cancelled("thread link: cancelled");
            else if (transport::Clock::now() >= w.control->deadline)
              s = Status::timeout("thread link: deadline");
          }
        }
        if (!s.ok()) break;
        s = inner_->run(w.op, std::span<const Copy>(&c, 1), *w.control);
        if (!s.ok()) break;
      }
      w.done(std::move(s));
      lock.lock();
    }
  }

  std::unique_ptr<Link> inner_;
  const std::chrono::milliseconds delay_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Work> work_;
  bool quit_ = false;
  std::thread thread_;
};

class ThreadTransport final : public transport::Transport {
 public:
  ThreadTransport(std::unique_ptr<transport::Transport> inner, std::chrono::milliseconds delay)
      : inner_(std::move(inner)), delay_(delay) {}
  std::string_view name() const override { return inner_->name(); }
  std::string address() const override { return inner_->address(); }
  Status can_reach(const transport::PeerInfo& peer) const override { return inner_->can_reach(peer); }
  Result<std::string> add_segment(const transport::Segment& s) override { return inner_->add_segment(s); }
  Status remove_segment(uint32_t id) override { return inner_->remove_segment(id); }
  Result<std::unique_ptr<Link>> connect(const transport::PeerInfo& peer) override {
    KVB_ASSIGN_OR_RETURN(std::unique_ptr<Link> link, inner_->connect(peer));
    return std::unique_ptr<Link>(std::make_unique<ThreadLink>(std::move(link), delay_));
  }

 private:
  std::unique_ptr<transport::Transport> inner_;
  std::chrono::milliseconds delay_;
};

std::unique_ptr<Engine> make_engine(const std::string& name, std::chrono::milliseconds delay = 0ms) {
  EngineOptions o;
  o.name = name;
  o.transports = {"local"};
  std::vector<std::unique_ptr<transport::Transport>> ts;
  ts.push_back(std::make_unique<ThreadTransport>(std::move(*transport::make_local_transport()), delay));
  Result<std::unique_ptr<Engine>> e = engine_internal::create_engine(o, std::move(ts));
  EXPECT_TRUE(e.ok()) << e.error().to_string();
  return e.ok() ? std::move(*e) : nullptr;
}

struct Pair {
  explicit Pair(std::chrono::milliseconds delay = 0ms, uint64_t bytes = 8 << 20)
      : a(make_engine("a", delay)), b(make_engine("b")), x(bytes, 0), y(bytes) {
    for (uint64_t i = 0; i < bytes; ++i) y[i] = static_cast<uint8_t>(i * 13 + i / 509);
    rx = *a->register_memory(x.data(), x.size());
    ry = *b->register_memory(y.data(), y.size());
    peer = *a->connect(b->metadata());
  }
  std::unique_ptr<Engine> a, b;
  std::vector<uint8_t> x, y;
  RegionId rx = 0, ry = 0;
  PeerId peer = 0;
};

TEST(AsyncRunsTest, ReadsAndWritesOfEverySizeLandExactly) {
  Pair p;
  // 3 MiB in 3,000 items splits into chunks; 1 and 4097 bytes stay one.
  for (uint64_t size : {uint64_t{1}, uint64_t{4097}, uint64_t{1} << 20, uint64_t{3} << 20}) {
    std::fill(p.x.begin(), p.x.end(), uint8_t{0});
    std::vector<TransferItem> items;
    const uint64_t piece = size >= (1 << 20) ? 1024 : size;
    for (uint64_t off = 0; off < size; off += piece)
      items.push_back({p.rx, off * 2, p.ry, off, piece});  // gaps: no merging
    TransferId id = *p.a->submit(p.peer, TransferOp::kRead, items);
    TransferStatus st = p.a->wait(id, 30s);
    ASSERT_EQ(st.state, TransferState::kDone) << st.error.to_string();
    EXPECT_EQ(st.bytes_done, size);
    for (const TransferItem& it : items) {
      ASSERT_TRUE(std::equal(p.y.begin() + it.remote_offset, p.y.begin() + it.remote_offset + it.bytes,
                             p.x.begin() + it.local_offset))
          << size;
    }
    ASSERT_TRUE(p.a->release(id).ok());
  }
  std::fill(p.x.begin(), p.x.end(), uint8_t{0x42});
  TransferItem w{p.rx, 0, p.ry, 100, 5000};
  TransferId id = *p.a->submit(p.peer, TransferOp::kWrite, std::span<const TransferItem>(&w, 1));
  ASSERT_EQ(p.a->wait(id, 30s).state, TransferState::kDone);
  EXPECT_EQ(p.y[99], static_cast<uint8_t>(99 * 13));
  EXPECT_EQ(p.y[100], 0x42);
  EXPECT_EQ(p.y[5099], 0x42);
  EngineMetrics m = p.a->metrics();
  EXPECT_EQ(m.transfers_submitted, 5u);
  EXPECT_EQ(m.transfers_done, 5u);
  EXPECT_TRUE(p.a->deregister_memory(p.rx).ok()) << "a region was still held after every transfer ended";
}

TEST(AsyncRunsTest, TheNotificationFollowsTheBytesFromAWorker) {
  Pair p;
  TransferItem w{p.rx, 0, p.ry, 0, 65536};
  std::fill(p.x.begin(), p.x.end(), uint8_t{7});
  TransferId id = *p.a->submit(p.peer, TransferOp::kWrite, std::span<const TransferItem>(&w, 1), "written");
  ASSERT_EQ(p.a->wait(id, 30s).state, TransferState::kDone);
  std::vector<Notification> got;
  for (int i = 0; i < 300 && got.empty(); ++i) {
    got = p.b->take_notifications();
    if (got.empty()) std::this_thread::sleep_for(10ms);
  }
  ASSERT_EQ(got.size(), 1u);
  EXPECT_EQ(got[0].message, "written");
  EXPECT_EQ(p.y[65535], 7);
  EXPECT_EQ(p.a->metrics().notifications_sent, 1u);
}

// A thread can sleep on its own condition and be woken by the listener
// instead of polling take_notifications(); removing it waits for a running
// call, and it is not called again.
TEST(AsyncRunsTest, TheNotificationListenerWakesASleeperOncePerNotification) {
  Pair p;
  std::mutex mu;
  std::condition_variable cv;
  int calls = 0;
  p.b->set_notification_listener([&] {
    std::lock_guard<std::mutex> lock(mu);
    ++calls;
    cv.notify_all();
  });
  ASSERT_TRUE(p.a->notify(p.peer, "one").ok());
  ASSERT_TRUE(p.a->notify(p.peer, "two").ok());
  {
    std::unique_lock<std::mutex> lock(mu);
    ASSERT_TRUE(cv.wait_for(lock, 10s, [&] { return calls == 2; })) << calls;
  }
  std::vector<Notification> got = p.b->take_notifications();
  ASSERT_EQ(got.size(), 2u);
  EXPECT_EQ(got[1].message, "two");
  p.b->set_notification_listener(nullptr);
  ASSERT_TRUE(p.a->notify(p.peer, "three").ok());
  std::lock_guard<std::mutex> lock(mu);
  EXPECT_EQ(calls, 2);
}

TEST(AsyncRunsTest, CancelWaitsForTheRunAndNothingLandsAfter) {
  Pair p(20ms);
  std::vector<TransferItem> items;
  for (uint64_t k = 0; k < 200; ++k) items.push_back({p.rx, k * 8192, p.ry, k * 8192, 4096});
  TransferId id = *p.a->submit(p.peer, TransferOp::kRead, items);
  while (p.a->status(id).bytes_done == 0) std::this_thread::sleep_for(1ms);
  ASSERT_TRUE(p.a->cancel(id).ok());
  TransferStatus st = p.a->status(id);
  EXPECT_EQ(st.state, TransferState::kCancelled);
  EXPECT_LT(st.bytes_done, st.bytes_total);
  const std::vector<uint8_t> snapshot = p.x;
  std::this_thread::sleep_for(100ms);
  EXPECT_TRUE(snapshot == p.x) << "bytes landed after cancel() returned";
  EXPECT_TRUE(p.a->deregister_memory(p.rx).ok()) << "the region was still held after cancel";
}

TEST(AsyncRunsTest, TheDeadlineEndsASlowRunAsTimeout) {
  Pair p(20ms);
  std::vector<TransferItem> items;
  for (uint64_t k = 0; k < 200; ++k) items.push_back({p.rx, k * 8192, p.ry, k * 8192, 4096});
  const auto start = transport::Clock::now();
  TransferId id = *p.a->submit(p.peer, TransferOp::kRead, items, "", 150ms);
  TransferStatus st = p.a->wait(id, 30s);
  EXPECT_EQ(st.state, TransferState::kFailed);
  EXPECT_EQ(st.error.code(), Code::kTimeout) << st.error.to_string();
  EXPECT_LT(transport::Clock::now() - start, 5s);
  EXPECT_EQ(p.a->metrics().transfers_failed, 1u);
}

TEST(AsyncRunsTest, AnEngineDestroyedWithRunsInFlightCancelsThemCleanly) {
  for (int round = 0; round < 3; ++round) {
    Pair p(5ms);
    std::vector<TransferId> ids;
    for (int t = 0; t < 4; ++t) {
      std::vector<TransferItem> items;
      for (uint64_t k = 0; k < 50; ++k) items.push_back({p.rx, (t * 50 + k) * 8192, p.ry, k * 8192, 4096});
      ids.push_back(*p.a->submit(p.peer, TransferOp::kRead, items, t % 2 ? "note" : ""));
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(round * 7));
    // 50 copies of 5 ms each: every transfer is still running.
    for (TransferId id : ids) ASSERT_EQ(p.a->status(id).state, TransferState::kInProgress);
    p.a.reset();  // must not hang, crash or leave a callback running (ASan, TSan)
  }
}

}  // namespace
}  // namespace kvbridge
