// connector/worker_impl.h: the ConnectorWorker made by ConnectorWorker::create
// (connector.h), in one class whose parts live in six files:
//  - worker.cc: the public methods, aborts, and poke(), send(), send_done();
//  - worker_init.cc: registration and teardown (init(), the destructor);
//  - worker_start.cc: the start thread, which plans queued loads and submits
//    their stages;
//  - worker_pump.cc: the pump and its inbox (Wakeups): transfer ends,
//    notifications, heartbeats, done messages;
//  - worker_end.cc: how a load ends (landed stages, reports, settling);
//  - worker_connect.cc: the connect thread (handshakes, engine connections).
//
// Bookkeeping is under mu_. Loads are engine transfers whose completions
// (SubmitOptions::on_end) land in a small shared inbox (Wakeups), and so do
// the engine's "a notification arrived" signals; one thread of the worker
// ("pump") sleeps on it until a transfer ends, a notification arrives, a
// heartbeat is due or a streamed load's deadline passes. It ends loads,
// starts streamed stages whose layers were announced, and sends heartbeats,
// done messages and announcements without waiting for them (Engine::notify
// with a callback). Nothing polls.
//
// Thread-safety: as ConnectorWorker's. Internal to the connector library.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <thread>
#include <vector>

#include "connector/announcer.h"
#include "connector/load.h"
#include "connector/messages.h"
#include "connector/pusher.h"
#include "connector/read_grants.h"
#include "connector/remotes.h"
#include "connector/resend.h"
#include "connector/side_channel.h"
#include "connector/worker_internal.h"
#include "kvbridge/connector.h"

namespace kvbridge::connector {

constexpr size_t kEndedKept = 4096;  // outcomes kept for wait_for_layer()
// Announcements (and push's "wrote") kept for loads not started yet.
constexpr size_t kEarlyKept = 65536;
// The least a done waits for its answer before it is asked again.
constexpr std::chrono::milliseconds kMinAskTimeout{200};
// A push-mode worker's side channel identity: the layout's, and this line;
// its hash the layout's xor this constant ("push"). A pull-mode worker's is
// the layout's alone, so a mismatch names the mode.
constexpr std::string_view kPushIdentityLine = "transfer_mode push\n";
constexpr uint64_t kPushHashXor = 0x7075736800000000ull;
using EngineKey = std::pair<std::string, uint64_t>;

// What a source said about a load (kept when it came before the load
// started): a layer announced (kReady: a = its ordinal), a stage written or
// not (push: a = the stage, b = the stage count).
struct Early {
  EngineKey engine;
  Message::Kind kind;
  uint32_t a = 0, b = 0;
  std::string event;   // kReady: the producer's event handle, if any
  uint64_t where = 0;  // kWrote: where the stage's writes went (write_places())
};

// The prefill side's word on reads: the requests whose blocks the engine
// freed (blocks_released()), which a reader's done is answered with. Shared
// with the engine's answerer, which runs on the engine's control thread.
struct Released {
  static constexpr size_t kKept = 65536;
  std::mutex mu;
  std::map<RequestId, std::set<std::string>> ids;  // -> the readers whose dones came before (blocks_released())
  std::deque<RequestId> order;                     // first released first, for the bound
  void add(RequestId request, const std::vector<std::string>& readers_done);
  // Whether a done from the engine named `reader` is answered "released".
  bool released_for(const RequestId& request, const std::string& reader);
};

// The answers a source gave to a load's done ("held" or "released"), or
// why it gave none.
struct Answer {
  RequestId request;
  EngineKey engine;
  Status status;
  std::string answer;
};

// The source ranks of a load: their engines and the connections to them.
struct Sources {
  std::set<EngineKey> engines;
  std::vector<PeerId> peers;
  Status unreachable;  // the first source that could not be connected to (left out)
};

// Push mode: every source of the stage said it wrote its part.
inline bool written(const LoadStage& st) {
  for (size_t s = 0; s < st.items.size(); ++s) {
    if (st.reads(s)) return false;
  }
  return true;
}

// What the engine's callbacks push and the pump takes. Shared, so a
// callback that outlives the worker touches nothing else.
struct Wakeups {
  std::mutex mu;
  std::condition_variable cv;
  struct Ended {
    TransferId id;
    Clock::time_point at;
    bool done;
    bool refused;  // failed as not granted by the source (kPermissionDenied)
  };
  std::vector<Ended> ended;
  bool notes = false;  // a notification arrived
  // Push mode: a heartbeat to a load's source failed because the source is
  // gone (request, the source's engine name, the error).
  struct Lost {
    RequestId request;
    std::string source;
    Status error;
  };
  std::vector<Lost> lost;
  std::vector<Answer> answers;  // pull: sources' answers to a load's done
  bool poke = false;            // stop, or look at the loads again (abort)
};

class WorkerImpl final : public ConnectorWorker {
 public:
  WorkerImpl(Engine& engine, Layout layout, const WorkerOptions& options)
      : engine_(engine),
        layout_(std::move(layout)),
        options_(options),
        order_(layer_order(layout_)),
        readers_(layout_.tp_size * layout_.pp_size) {
    for (size_t i = 0; i < order_.size(); ++i) ordinal_.emplace(order_[i], static_cast<uint32_t>(i));
  }

  ~WorkerImpl() override;

  Status init(std::span<const std::span<uint8_t>> tensors);

  std::string side_channel_address() const override { return server_->address(); }

  std::string incarnation() const override { return incarnation_; }

  const Layout& layout() const override { return layout_; }

  Status add_remote(const std::string& instance, std::vector<std::string> rank_addresses) override;

  Status remove_remote(const std::string& instance) override;

  Result<std::vector<connector_internal::RemoteRankView>> remote_ranks(const std::string& instance) const;

  Status connect(const std::string& instance) override;

  Status wait_connected(const std::string& instance, std::chrono::milliseconds timeout) override;

  Status start_load(RequestId request, const std::string& instance, const Request& blocks,
                    const LoadOptions& options) override;

  // Requires mu_: a connect attempt for `instance` is under way (started
  // now unless one is).
  void request_connect(const std::string& instance);

  // Plans and starts the queued load of generation `gen` (on the start
  // thread, its instance connected), if it is still queued (not aborted).
  Status start_now(const RequestId& request, const std::string& instance, const Request& blocks,
                   const LoadOptions& options, uint64_t gen, Clock::time_point called);

  Status wait_for_layer(RequestId request, std::string_view layer, std::chrono::milliseconds timeout) override;

  Status abort(RequestId request) override;

  // Push mode: the sources write, so only they can stop: each is asked to
  // cancel ("kvb/1 cancel"), and answers once none of its writes can land.
  // Waits for every answer, up to the handshake timeout. `sources`: the
  // engines and peers of a started load; none: of a load aborted while
  // queued, which may already be written to (its sources as plans choose
  // them, once the instance is connected).
  Status cancel_sources(const RequestId& request, const std::string& instance, std::optional<Sources> sources);

  std::vector<LoadResult> take_results() override;

  void wait_results(std::chrono::milliseconds timeout) override;

  std::vector<ReaderEvent> take_reader_events() override;

  void blocks_released(RequestId request, const std::vector<std::string>& readers_done) override;
  using ConnectorWorker::blocks_released;
  Status hand_off(RequestId request, const std::map<std::string, std::vector<int64_t>>& blocks) override;

  Status stream_to(RequestId request, const std::string& instance) override;

  Status save_layer(RequestId request, std::string_view layer, const Readiness& ready) override;

  Status wait_for_save(RequestId request, std::chrono::milliseconds timeout) override;

  Status push(RequestId request, const std::string& instance, const Request& blocks,
              const LoadOptions& options) override;

  WorkerStats stats() const override;

 private:
  void poke();

  // Requires mu_: `engine` announced `layer` (an ordinal) of `load`. Taken
  // only from the engine of a source rank of the load's instance.
  void announce(Load& load, const EngineKey& engine, uint32_t layer, const std::string& event);

  // Requires mu_: a message from `e.engine` about `load`: a layer announced
  // (pull streaming), a stage written or not (push). Taken only from the
  // engine of a source rank of the load's instance.
  void take(Load& load, const Early& e);

  // Requires mu_: submits every stage not submitted whose layers every
  // source it reads from announced (all of them, when not streaming). The
  // first submit error stops the load from starting more.
  Status start_ready_stages(Load& load);

  // Requires mu_: submits the reads of stage `k` of `load` from source `s`
  // (worker_read.cc).
  Result<TransferId> submit_read(const Load& load, std::span<const uint32_t> stages, size_t s, PeerId peer,
                                 const SubmitOptions& base);
  // Whether stage `st` reads source `s` as runs of the load's prepared list
  // of it (Load::lists), and those runs, appended to *out.
  static bool on_list(const Load& load, const LoadStage& st, size_t s);
  static void list_runs(const Load& load, const LoadStage& st, size_t s, std::vector<ItemRun>* out);
  // Requires mu_: the runs of stage `st` of `load` from source `s` as the
  // engine takes them without tables: each table run as its moved runs.
  std::vector<ItemRun> stage_runs(const Load& load, const LoadStage& st, size_t s) const;
  // Requires mu_: the same runs with each table run, and each sequence of
  // moved runs of one literal run, as one run naming a prepared table of
  // those moves (made now if new; *used set when any was named).
  std::vector<ItemRun> with_tables(PeerId peer, const Load& load, const LoadStage& st, size_t s, bool* used);
  // Requires mu_: the prepared table of `moves` for `peer` (0 when the
  // engine refuses to prepare it: the runs then go as they are).
  PreparedId table_of(PeerId peer, std::vector<RunMove> moves);
  // Requires mu_: releases every prepared table of moves.
  void release_tables();

  // Requires mu_: every transfer of `st` ended done.
  void land(Load& load, LoadStage& st);

  void drain_notifications();

  // Never blocks: the engine calls back when the peer acknowledged the
  // message, or at its deadline, or when the peer is gone; a stopped peer
  // delays nothing else.
  // Requires mu_: a heartbeat to the k-th source of a push load. Only the
  // source can write, so one that is gone (the engine says so: kIoError)
  // fails the load at once rather than at its deadline.
  void beat_push_source(const Load& load, size_t k);

  void send(PeerId peer, const std::string& message);
  // A reader's done to `peer`, sent again until acknowledged.
  void send_done(PeerId peer, const RequestId& request);

  // Sleeps until a transfer ends, a notification arrives, a heartbeat is
  // due or a streamed load's deadline passes; ends loads; sends done
  // messages and heartbeats (without waiting for their acknowledgements).
  void pump();

  // Requires mu_: the load is over (nothing in flight); reports it.
  void end_load(std::map<RequestId, Load>::iterator it);
  // The options of a load's reads: their ends land in the pump's inbox.
  SubmitOptions read_options() const;
  // Requires mu_: submits again the refused reads whose time came (or ends
  // them, for a load that is over).
  void submit_refused(Load& load, Clock::time_point now);

  // Requires mu_: a queued load that never started ended with `error`
  // (aborted, or its handshake, plan or submit failed); reports it.
  void end_queued(const RequestId& request, uint64_t skip_tokens, Status error, bool aborted);

  // Requires mu_: `result` is a load's last word.
  void report(LoadResult result);

  // The start thread: plans and starts the queued loads, in order; one
  // whose instance is not connected waits (parked) for the connect thread.
  void start_loop();

  // Requires mu_: `job` was aborted while queued, and its sources are owed a done message.
  bool abandoned(const RequestId& request, uint64_t gen) const {
    auto a = abandoned_.find(request);
    return a != abandoned_.end() && a->second == gen;
  }

  // Tells the ranks of `instance` a load of `request` would read from (the
  // fewest sources, as plans choose them) that this rank is done with it:
  // a load aborted before it started holds no byte of theirs.
  void release_sources(const std::string& instance, const RequestId& request);

  // The ranks of `instance` a load of this rank reads from (the fewest, as
  // plans choose them), connected: what a load that never started would
  // have used. The handshake's or planner's error otherwise.
  Result<Sources> planned_sources(const std::string& instance);

  // The connect thread: handshakes with instances and connects to their
  // engines, one at a time; then hands the loads parked on one back to the
  // start thread, or fails them with the attempt's error.
  void connect_loop();

  // Handshakes with every rank of `instance` and connects to each engine.
  Status connect_now(const std::string& instance);

  // Requires mu_: nothing of `load` is in flight.
  void finish(Load& load);
  // Ends the load's write grants (push) and releases its prepared lists
  // (Load::lists); any thread, any lock.
  void release_holds(Load& load);
  // Prepares, with the engine, the items of the stages others are moved
  // from, one list per source (Load::lists, LoadStage::list_at). On an
  // error, the lists made are released and it names the source.
  Status prepare_lists(Load& load);
  std::atomic<uint64_t> lists_held_{0};  // prepared lists not released yet

  // Requires mu_: every stage of a pull load landed. Asks each source read
  // whether the blocks were held ("done", answered by its engine, asked
  // again while unanswered until the deadline); the load ends once all
  // answered (the pump). Adds the dones to the sources not read (which
  // only count it) to `dones`.
  void confirm(Load& load, std::vector<std::pair<PeerId, RequestId>>* dones);
  // Requires mu_: a source's answer to a load's done (or why none came).
  void take_answer(Answer& a);
  // The done or heartbeat message of `request`, with this instance's rank
  // count (every rank of it reads its share: what the prefill's hold counts).
  std::string reader_message(Message::Kind kind, const RequestId& request) const;

  Engine& engine_;
  const Layout layout_;
  const WorkerOptions options_;
  const std::vector<std::string> order_;     // layer_order(layout_)
  std::map<std::string, uint32_t> ordinal_;  // layer name -> index into order_
  std::vector<uint8_t> layer_device_;        // by ordinal: the layer has device memory
  const uint32_t readers_;                   // this instance's ranks (tp_size * pp_size)
  std::string incarnation_;                  // hex16 of the engine's instance
  std::vector<RegionId> regions_;
  std::unique_ptr<Remotes> remotes_;
  std::unique_ptr<SideChannelServer> server_;

  mutable std::mutex mu_;
  std::condition_variable results_cv_;                              // results, landed layers, ended loads
  std::map<TransferId, std::pair<RequestId, size_t>> by_transfer_;  // -> (request, index in Load::transfers)
  // Prepared tables of moves (Engine::prepare_moves), by source peer and
  // moves, at most kMoveTablesKept (all released when more are needed).
  static constexpr size_t kMoveTablesKept = 256;
  std::map<std::string, PreparedId> move_tables_;
  struct LastTable {
    std::vector<RunMove> moves;
    PreparedId id = 0;  // 0: none
    // When it was named for a table run: the plan's table and the snapshot
    // of the source's registrations its moves were mapped with (held, so
    // that their addresses name them alone).
    std::shared_ptr<const std::vector<TensorShift>> plan_table;
    std::shared_ptr<const Fetched> fetched;
  };
  std::map<PeerId, LastTable> last_table_;  // per source peer, the table named last (one of move_tables_)
  const std::shared_ptr<Wakeups> wake_ = std::make_shared<Wakeups>();
  bool stop_ = false;
  std::map<RequestId, Load> loads_;
  std::map<RequestId, Status> ended_;  // the last kEndedKept outcomes
  std::deque<RequestId> ended_order_;
  std::map<RequestId, std::vector<Early>> early_;
  std::map<RequestId, std::set<EngineKey>> cancelling_;  // push: abort() waits for these sources' "cancelled"
  size_t early_count_ = 0;
  std::deque<RequestId> early_order_;  // requests of early_, first kept first
  // Loads queued for the start thread, and the connect thread's work.
  struct Queued {
    uint64_t gen = 0;  // which start_load (an id may be aborted and loaded again)
    uint64_t skip_tokens = 0;
    std::string instance;  // the remote's key in Remotes
  };
  struct Job {
    RequestId request;
    std::string instance;  // the remote's key in Remotes (Remotes::route())
    Request blocks;
    LoadOptions options;
    uint64_t gen = 0;
    Clock::time_point called;  // start_load()
  };
  // Requires mu_: why `job` cannot start, its instance's ranks being
  // unreachable (`why`), naming the hand-off's incarnations and how the
  // instance answers elsewhere.
  Status unreachable(const Job& job, const Status& why) const;
  // Requires mu_: fails the parked loads whose transfer timeout passed.
  void expire_parked(Clock::time_point now);
  std::map<RequestId, Queued> queued_;
  std::map<RequestId, uint64_t> abandoned_;  // aborted while queued (-> gen): owed a done to its sources
  uint64_t queued_gen_ = 0;
  std::deque<Job> jobs_;  // for the start thread
  std::condition_variable jobs_cv_;
  std::map<std::string, std::vector<Job>> parked_;  // waiting for their instance's connect
  std::deque<std::string> connects_;                // for the connect thread
  std::condition_variable connects_cv_;
  std::set<std::string> connecting_;              // connect() attempts under way
  std::map<std::string, Status> connect_errors_;  // the last attempt's outcome
  std::thread starter_;
  // Connect attempts run on these, one instance each at a time, so that a
  // silent instance (a bogus record, a dead host) delays only its own loads.
  static constexpr int kConnectThreads = 4;
  std::vector<std::thread> connectors_;
  std::vector<LoadResult> results_;
  std::vector<ReaderEvent> events_;
  WorkerStats stats_;
  const std::shared_ptr<SendFailures> sent_ = std::make_shared<SendFailures>();
  const std::shared_ptr<Released> released_ = std::make_shared<Released>();
  std::unique_ptr<Resender> resender_;       // dones and announcements, sent again when lost
  std::unique_ptr<Announcer> announcer_;     // prefill side of streaming
  StageCache stage_cache_;                   // the stages of loads (and, pushing, of the readers' loads)
  std::unique_ptr<Pusher> pusher_;           // prefill side of push mode
  std::unique_ptr<ReadGrants> read_grants_;  // prefill side of pull mode: what each reader may read
  std::thread pump_;
};

}  // namespace kvbridge::connector
