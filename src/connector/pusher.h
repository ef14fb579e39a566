// connector/pusher.h: the prefill side of push mode (ConnectorWorker::push).
// For each pushed request and each rank of the decode instance: the stages
// of that rank's plan (plan_stages(), planned as the decode rank plans it,
// over every rank of this instance) whose bytes come from this rank, written
// as engine writes once their layers are saved (all at once when not
// streaming), each followed by "kvb/1 wrote <request> <stage> <stages>"
// (the write's notification: delivered after its last byte) or, when the
// write failed, "kvb/1 unwritten ...". A decode rank's "kvb/1 cancel"
// cancels the writes to it (when Engine::cancel() returns none can land)
// and is answered "kvb/1 cancelled"; a cancel that comes before push() is
// kept, so that nothing is written to that rank.
//
// Thread-safety: every method from any thread. push() dials and plans
// without holding the lock the others take; cancel() cancels outside it.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <string_view>
#include <vector>

#include "connector/announcer.h"
#include "connector/remotes.h"
#include "connector/stage_cache.h"
#include "kvbridge/connector.h"

namespace kvbridge::connector {

class Pusher {
 public:
  // `local` is this rank's layout and `regions` its tensors' registrations
  // (in layout order); `layers` is layer_order(local) and `device` says
  // which of them are device memory (by ordinal). The engine, `local` and
  // `remotes` must outlive this.
  // `wake` asks the worker's pump for a call of retry_due() (it must not
  // block or call back into this).
  // `stages` plans what each decode rank reads (it must outlive this).
  Pusher(Engine& engine, Remotes& remotes, StageCache& stages, const Layout& local, std::vector<RegionId> regions,
         std::vector<std::string> layers, std::vector<uint8_t> device, const WorkerOptions& options,
         std::shared_ptr<SendFailures> failures, std::function<void()> wake);

  // As ConnectorWorker's. options.ready is the producer's readiness for the
  // whole request (the KV is computed, or will be once it completes) when
  // not streaming; each streamed layer's comes with save_layer().
  Status push(RequestId request, const std::string& instance, const Request& blocks, const LoadOptions& options);
  // Layers saved before push() are kept for it. A layer in device memory
  // needs `ready` (either event, or host_synchronized): kInvalidArgument
  // naming it without.
  Status save_layer(RequestId request, std::string_view layer, const Readiness& ready);
  // kNotFound for a request never pushed.
  Status wait_for_save(RequestId request, std::chrono::milliseconds timeout);
  // `engine` (a decode rank) asked to cancel `request`: cancels the writes
  // to it, marks the rest never to start, and answers "kvb/1 cancelled".
  void cancel(const RequestId& request, const std::pair<std::string, uint64_t>& engine);
  // Answers the cancels whose sender was not reachable yet (an instance
  // not fetched when they came); after a connect.
  void answer_pending();
  bool unanswered() const;

  // Forgets requests untouched since `before` (never waited for).
  void forget_older_than(std::chrono::steady_clock::time_point before);

  // A write the decode rank refused as not granted (kPermissionDenied: a
  // decode grants a push's places when its start_load() plans them, which
  // may come after the prefill's push) is submitted again, after 1, 2, 4 ..
  // up to 20 ms, until the write's timeout from its first try; then it
  // fails with the refusal. The pump calls retry_due() after `wake` and by
  // next_retry() (time_point::max(): none).
  void retry_due();
  std::chrono::steady_clock::time_point next_retry() const;
  // Stage writes submitted as runs (WorkerStats::writes_as_runs).
  uint64_t writes_as_runs() const { return writes_as_runs_.load(std::memory_order_relaxed); }
  // Writes of a stage moved from another (WorkerStats::moved_stage_writes),
  // and the lists of items prepared for them: in all, and held now.
  uint64_t moved_stage_writes() const { return moved_stage_writes_.load(std::memory_order_relaxed); }
  uint64_t lists_prepared() const { return lists_prepared_.load(std::memory_order_relaxed); }
  uint64_t lists_held() const { return lists_held_.load(std::memory_order_relaxed); }

 private:
  struct Acks {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t outstanding = 0;  // writes not ended
    Status first_error;
  };
  // The transfer now carrying a stage's write (a refused write is
  // submitted again) and whether the decode rank cancelled it. Shared with
  // the write's callbacks.
  struct Flight {
    std::mutex mu;
    TransferId id = 0;  // the latest submitted
    bool cancelled = false;
  };
  // A list of items prepared with the engine for writes to one decode rank
  // (Engine::prepare), released with the stages holding it, under mu_ (the
  // engine outlives the worker; a write tried again after that fails).
  struct WriteList {
    Engine* engine = nullptr;
    PreparedId id = 0;
    std::atomic<uint64_t>* held = nullptr;  // the Pusher's count
    WriteList(Engine* e, PreparedId i, std::atomic<uint64_t>* h) : engine(e), id(i), held(h) { ++*held; }
    WriteList(const WriteList&) = delete;
    WriteList& operator=(const WriteList&) = delete;
    ~WriteList() {
      (void)engine->release_prepared(id);
      --*held;
    }
  };
  struct Stage {
    uint32_t first_layer = 0, end_layer = 0;
    bool device = false;  // a write of device memory (either side): it waits on the producer's events
    // From this rank: the items, or (a stage moved from another) that
    // stage's items, shared.
    std::shared_ptr<const std::vector<TransferItem>> items;
    std::vector<ItemRun> runs;  // that repeat them (the later layers'), or none: the items alone
    // A stage moved from another: the runs are over that stage's items,
    // prepared (moved runs only; Engine::submit_runs).
    std::shared_ptr<const WriteList> list;
    uint64_t where = 0;  // write_places() of the items and runs, as the "wrote" says
    std::shared_ptr<Flight> flight = std::make_shared<Flight>();
    bool submitted = false;
  };
  // One stage's write to one decode rank, as submitted and submitted again.
  struct Write {
    PeerId peer = 0;
    std::shared_ptr<const std::vector<TransferItem>> items;  // shared by its tries, never copied
    std::shared_ptr<const std::vector<ItemRun>> runs;        // none: the items alone
    PreparedId list = 0;                                     // not 0: the runs are over this list's items
    std::string what;                                        // "request R: writing to I rank N", for a submit's error
    SubmitOptions options;                                   // without on_end
    std::string unwritten;                                   // the message that tells the decode rank it failed
    std::chrono::steady_clock::time_point give_up;
    std::chrono::milliseconds backoff{1};
    Status refused;  // the last refusal, if any: what the write fails with when time runs out
    std::shared_ptr<Flight> flight;
    std::shared_ptr<Acks> acks;
  };
  // What a write's callbacks hold (they may outlive this Pusher): the
  // engine, which outlives the worker, and the writes due again.
  struct Shared {
    Engine* engine = nullptr;
    std::shared_ptr<SendFailures> failures;
    std::chrono::milliseconds timeout{0};
    std::function<void()> wake;
    mutable std::mutex mu;
    std::vector<std::pair<std::chrono::steady_clock::time_point, Write>> due;
  };
  // Submits `w` (or ends it, when cancelled meanwhile); its on_end queues it
  // again when refused as not granted, else ends it.
  static void start_write(const std::shared_ptr<Shared>& shared, Write w);
  struct Target {  // one decode rank
    uint32_t rank = 0;
    PeerId peer = 0;
    std::pair<std::string, uint64_t> engine;
    uint32_t stages = 0;             // of its whole plan (the count its messages carry)
    std::map<uint32_t, Stage> mine;  // by stage index: the stages with bytes from this rank
    bool cancelled = false;
  };
  struct Pushed {
    std::string instance;
    bool stream = false;
    Readiness ready;  // not streamed: the producer's, for every stage
    std::vector<Target> targets;
    std::shared_ptr<Acks> acks = std::make_shared<Acks>();
    std::chrono::steady_clock::time_point touched;
  };

  // A write to `peer` ended (on an engine thread, or in submit() under
  // mu_: takes only the acks' lock, and touches no member, so that a write
  // may end after this Pusher is gone): counts it, and on `error` tells the
  // decode rank ("unwritten") and keeps the first error.
  static void ended(Engine& engine, Acks& acks, const std::shared_ptr<SendFailures>& failures, PeerId peer,
                    const std::string& unwritten, std::chrono::milliseconds timeout, const Status& error);
  // A layer saved, and what its bytes wait for.
  struct Saved {
    bool saved = false;
    Readiness ready;
  };
  Status build_target(const RequestId& request, const std::string& instance, const Fetched& decode, const Fetched& own,
                      const std::vector<CompactStage>& stages, Target* target);
  // Requires mu_: submits every stage of `p` whose layers are saved.
  void submit_ready(const RequestId& request, Pushed& p);
  std::vector<Saved>& saved_locked(const RequestId& request);
  // The events a write of `st` waits on: the producer's of its layers (or
  // of the whole request), at most one of this process's.
  Status ready_events(const Pushed& p, const Stage& st, const std::vector<Saved>& saved, SubmitOptions* o) const;

  using EngineKey = std::pair<std::string, uint64_t>;
  // The engine connection to `engine`, if it is a rank of a fetched instance.
  std::optional<PeerId> find_peer(const EngineKey& engine);
  void confirm(const RequestId& request, const EngineKey& engine);

  Engine& engine_;
  Remotes& remotes_;
  StageCache& stages_;
  std::atomic<uint64_t> writes_as_runs_{0}, moved_stage_writes_{0}, lists_prepared_{0}, lists_held_{0};
  const Layout& local_;
  const std::vector<RegionId> regions_;
  const std::vector<std::string> layers_;
  const std::vector<uint8_t> device_;
  const WorkerOptions options_;
  const std::shared_ptr<SendFailures> failures_;
  const std::shared_ptr<Shared> shared_;
  mutable std::mutex mu_;
  std::map<RequestId, Pushed> pushed_;
  // Layers saved per request (by ordinal), also before push().
  std::map<RequestId, std::pair<std::vector<Saved>, std::chrono::steady_clock::time_point>> saved_;
  // Cancels that came before push(): (request, engine), bounded.
  std::set<std::pair<RequestId, EngineKey>> early_cancels_;
  std::deque<std::pair<RequestId, EngineKey>> early_order_;
  std::vector<std::pair<RequestId, EngineKey>> unanswered_;  // cancels to confirm once reachable
};

}  // namespace kvbridge::connector
