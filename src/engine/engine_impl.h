// engine/engine_impl.h: the Engine implementation, for the engine's own
// files and for tests that build an engine around their own transports.
//
// EngineImpl divides as the files do: bookkeeping of memory (registry.h),
// the wire description (metadata.h), peers and transport choice (peers.cc),
// checking and resolving a batch (submit.cc), execution (transfers.h),
// control connections (control.h), counters (metrics.h).
//
// Thread-safety: as Engine. mu_ is the registry lock of transport.h: it
// guards the registry and the peer table, and transports' add_segment and
// remove_segment run under it; connect() opens links and control channels
// without it, since they wait on the peer. Ownership and teardown order:
// transports outlive links, links outlive transfers, and the destructor
// closes channels, ends transfers, stops the control thread, drops peers,
// then transports, so every child dies before its parent.
#pragma once

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/control.h"
#include "engine/metadata.h"
#include "engine/metrics.h"
#include "engine/registry.h"
#include "engine/transfers.h"
#include "kvbridge/engine.h"
#include "transport/transport.h"

namespace kvbridge::engine_internal {

// Test hooks; all optional.
struct EngineHooks {
  // Called before each notification is sent (after a transfer or notify());
  // true drops it: nothing is sent, and the sender waits for an
  // acknowledgement that never comes (so the transfer fails by its deadline).
  std::function<bool(std::string_view message)> drop_notification;
  // Called before each notify() or ask() is sent; true sends it twice (the
  // second copy's acknowledgement is ignored), as a control message
  // repeated on the way would arrive.
  std::function<bool(std::string_view message)> duplicate_notification;
  // Called before a submit names a prepared table of moves; true refuses
  // it as the engine refuses a table whose peer regions moved
  // (kUnavailable, "prepare again").
  std::function<bool()> refuse_table;
};

// Builds the transports that `options` asks for (every known one when empty,
// skipping those that cannot run here), in preference order, and reports on
// each. kInvalidArgument for an unknown name, kUnavailable when a transport
// named explicitly cannot run.
Result<std::vector<std::unique_ptr<transport::Transport>>> make_transports(const EngineOptions& options,
                                                                           std::vector<TransportReport>* reports);

// An engine over the given transports (in preference order).
Result<std::unique_ptr<Engine>> create_engine(const EngineOptions& options,
                                              std::vector<std::unique_ptr<transport::Transport>> transports,
                                              std::vector<TransportReport> reports = {}, EngineHooks hooks = {});

class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineOptions& options, std::vector<std::unique_ptr<transport::Transport>> transports,
             std::vector<TransportReport> reports, EngineHooks hooks);
  ~EngineImpl() override;
  Status init();

  const std::string& name() const override { return options_.name; }
  uint64_t instance() const override { return instance_; }
  bool has_secret() const override { return !options_.secret.empty(); }
  std::vector<TransportReport> transports() const override { return reports_; }
  Result<RegionId> register_memory(void* base, uint64_t bytes, std::string_view memory, RemoteAccess access) override;
  Status deregister_memory(RegionId id) override;
  Result<GrantId> grant_writes(PeerId peer, std::span<const WriteGrant> ranges,
                               std::span<const GrantRepeat> repeats = {}) override;
  void revoke_writes(GrantId grant) override;
  Result<GrantId> grant_reads(std::string_view peer_name, uint64_t peer_instance, std::span<const WriteGrant> ranges,
                              std::span<const GrantRepeat> repeats = {}) override;
  Result<GrantId> share_reads(GrantId like, std::string_view peer_name, uint64_t peer_instance) override;
  void revoke_reads(GrantId grant) override;
  std::string metadata() const override;
  Result<PeerId> connect(std::string_view metadata) override;
  Result<TransferId> submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                            SubmitOptions options) override;
  Result<PreparedId> prepare(PeerId peer, TransferOp op, std::span<const TransferItem> items) override;
  Result<TransferId> submit(PreparedId list, std::span<const uint32_t> selection, SubmitOptions options) override;
  Result<TransferId> submit_runs(PreparedId list, std::span<const ItemRun> runs, SubmitOptions options) override;
  Result<TransferId> submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                            std::span<const ItemRun> runs, SubmitOptions options) override;
  Result<PreparedId> prepare_moves(PeerId peer, TransferOp op, std::span<const RunMove> moves) override;
  Status release_prepared(PreparedId list) override;
  using Engine::submit;
  void begin_batch() override { transfers_->hold_wakes(); }
  void end_batch() override { transfers_->release_held(); }
  TransferStatus status(TransferId id) const override { return transfers_->status(id); }
  TransferStatus wait(TransferId id, std::chrono::milliseconds timeout) override {
    return transfers_->wait(id, timeout);
  }
  Status cancel(TransferId id) override { return transfers_->cancel(id); }
  Status release(TransferId id) override { return transfers_->release(id); }
  Status peer_status(PeerId peer) const override;
  Status notify(PeerId peer, std::string message) override;
  void notify(PeerId peer, std::string message, std::chrono::milliseconds timeout,
              std::function<void(Status)> done) override;
  void ask(PeerId peer, std::string message, std::chrono::milliseconds timeout,
           std::function<void(Status, std::string)> answered) override;
  std::vector<Notification> take_notifications() override;
  void set_notification_listener(std::function<void()> wake) override;
  void set_notification_answerer(std::function<std::string(const Notification&)> answer) override;
  EngineMetrics metrics() const override { return metrics_.snapshot(); }
  std::string metrics_prometheus() const override { return metrics_.prometheus(); }

  // Internal types, for the engine's own files.
  struct Peer {
    PeerId id = 0;
    uint64_t connection = 0;  // changes when the link and channel are reopened
    EngineMetadata metadata;
    // peer_text(metadata), for the messages of every transfer with it (each
    // holds it: shared, not copied per submit).
    std::shared_ptr<const std::string> text;
    // Set when an engine of the same name but another instance connected
    // after this one's connection was gone: who holds the name now.
    std::string replaced_by;
    struct RemoteRegion {
      MetadataRegion region;
      uint8_t access = 0;   // its segment's
      bool device = false;  // its segment is device memory
    };
    std::map<RegionId, RemoteRegion> regions;
    uint64_t generation = 0;  // bumped each time `regions` is refreshed
    // The links, in this engine's preference order: each moves some pair
    // of memory kinds that the ones before it do not (peers.cc).
    struct PeerLink {
      std::string transport;
      const transport::Transport* t = nullptr;
      std::shared_ptr<transport::Link> link;
      bool moves(bool local_device, bool remote_device) const { return t->moves(local_device, remote_device); }
    };
    std::vector<PeerLink> links;
    std::shared_ptr<Channel> channel;
  };

  // Where a batch runs: the peer's link that moves all its items, and
  // whether any item touches device memory (then it is one run).
  struct Route {
    const Peer::PeerLink* link = nullptr;
    bool device = false;
  };

  // Which (local device, peer device) pairs of memory kinds a batch moves,
  // and what first moved each (for the error when no link moves it).
  struct Kinds {
    bool pairs[2][2] = {{false, false}, {false, false}};
    size_t first[2][2] = {{0, 0}, {0, 0}};
    bool first_is_run[2][2] = {{false, false}, {false, false}};
    void note(bool local_device, bool remote_device, size_t index, bool run = false) {
      if (pairs[local_device][remote_device]) return;
      pairs[local_device][remote_device] = true;
      first[local_device][remote_device] = index;
      first_is_run[local_device][remote_device] = run;
    }
    std::string what(int a, int b) const {
      return (first_is_run[a][b] ? "run " : "item ") + std::to_string(first[a][b]);
    }
  };
  // A prepared list: items resolved once, its local regions held.
  struct PreparedList {
    std::shared_ptr<Peer> peer;
    TransferOp op = TransferOp::kRead;
    uint64_t generation = 0;                    // the peer's, when last checked
    std::shared_ptr<const CopyList> literal;    // one copy per item, in order
    std::vector<TransferItem> items;            // as prepared (the extents of moved ranges)
    Kinds kinds;                                // the memory kinds its items take
    Route route;                                // where its transfers run
    std::map<RegionId, MetadataRegion> remote;  // the peer regions it names, as they were
    std::vector<RegionHold> holds;              // its local regions
    // The extents of the ranges submit_runs() moved, found once each.
    struct Extent {
      bool one_region = true;
      RegionId local = 0, remote = 0;
      uint64_t local_low = UINT64_MAX, local_high = 0, remote_low = UINT64_MAX, remote_high = 0, bytes = 0;
    };
    std::map<std::pair<uint64_t, uint64_t>, Extent> extents;
  };

  // A prepared table of moves: per move where its region and shift put a
  // literal run's copies, and the literal extents every move has room for.
  struct PreparedMoves {
    std::shared_ptr<Peer> peer;
    TransferOp op = TransferOp::kRead;
    uint64_t generation = 0;  // the peer's, when last checked
    struct Move {
      uintptr_t local_at = 0;  // the local region's base plus the shift (modulo 2^64)
      uint64_t remote_at = 0;  // the peer region's address plus the shift
      uint32_t segment = 0;    // the peer region's
    };
    std::vector<Move> moves;
    // A literal run of extent [low, high) fits every move when low >= min
    // and high <= max, on each side (offsets in its own regions).
    uint64_t local_min = 0, local_max = UINT64_MAX, remote_min = 0, remote_max = UINT64_MAX;
    Kinds kinds;                                // the (local, peer) memory kinds its moves take
    std::map<RegionId, MetadataRegion> remote;  // the peer regions it names, as they were
    std::shared_ptr<const HeldRegions> held;    // its local regions, shared with the transfers using it
    // The moves as deltas from the regions of the literal run that used
    // the table last (a table run's moves: CopyRun), kept while it does.
    std::shared_ptr<const std::vector<CopyMove>> deltas;
    uintptr_t deltas_local_base = 0;
    uint64_t deltas_remote_base = 0;
  };

 private:
  // What check_items_locked() found of a run of items: whether they name
  // one local and one peer region (those of the first item, found), the
  // extent they span in each, and their bytes.
  struct ItemsExtent {
    bool one_region = true;
    const Region* local_region = nullptr;
    const Peer::RemoteRegion* remote_region = nullptr;
    uint64_t local_low = UINT64_MAX, local_high = 0, remote_low = UINT64_MAX, remote_high = 0;
    uint64_t bytes = 0;
  };
  // Requires mu_. Checks `items` (the batch's from index `index0`) against
  // this engine's and the peer's registrations (the errors submit()
  // documents) and appends their copies (merged where adjacent on both
  // sides, with `merge`) and their local regions; notes their kinds; with
  // `extent`, fills it in the same pass.
  Status check_items_locked(const Peer& p, TransferOp op, std::span<const TransferItem> items, size_t index0,
                            std::vector<transport::Copy>* copies, std::vector<RegionId>* regions, bool merge,
                            Kinds* kinds, ItemsExtent* extent = nullptr) const;
  // Requires mu_. The peer's link that moves every pair of memory kinds
  // the batch moves (kUnavailable naming the pair when none does).
  Status choose_route_locked(const Peer& p, const Kinds& kinds, Route* route) const;
  // Requires mu_. check_items_locked() and choose_route_locked() for a
  // whole batch; `regions` sorted, each once.
  Status resolve_locked(const Peer& p, TransferOp op, std::span<const TransferItem> items,
                        std::vector<transport::Copy>* copies, std::vector<RegionId>* regions, bool merge,
                        Route* route) const;
  // A literal run that moved runs repeat: its items' extent, and its
  // copies in the program.
  struct RunLiteral : ItemsExtent {
    uint64_t first = 0, count = 0;  // its items
    uint64_t copy_first = 0, copy_count = 0;
  };
  // Requires mu_. Checks moved run `run` (the batch's run `k`) of literal
  // `l` and appends it to `program` (a table run: the table to `tables`),
  // its local region to `regions`, its kinds, bytes and items.
  Status add_moved_run_locked(const Peer& p, TransferOp op, const ItemRun& run, size_t k, const RunLiteral& l,
                              CopyProgram* program, std::vector<RegionId>* regions, Kinds* kinds, uint64_t* bytes,
                              uint64_t* count, std::vector<std::shared_ptr<PreparedMoves>>* tables) const;
  // Requires mu_. Prepared list `id`, its peer still the one it was
  // prepared with and its peer regions where they were (kNotFound,
  // kUnavailable: prepare again).
  Result<std::shared_ptr<PreparedList>> live_list_locked(PreparedId id) const;
  // Requires mu_. A batch given as runs (Engine::submit with runs):
  // checks it and resolves it into `program`, whose literal copies are
  // the literal runs' (merged inside a run) and whose runs repeat them;
  // the tables of moves it names go to `tables` (their holds are the
  // transfer's too).
  Status resolve_runs_locked(const Peer& p, TransferOp op, std::span<const TransferItem> items,
                             std::span<const ItemRun> runs, CopyProgram* program, std::vector<RegionId>* regions,
                             Route* route, uint64_t* bytes, uint64_t* count,
                             std::vector<std::shared_ptr<PreparedMoves>>* tables) const;
  // Requires mu_. A table of moves `id` used with peer `p` for `op`: the
  // same op, the same connection, and (its registrations changed) the peer
  // regions it names where they were.
  Status check_moves_locked(const Peer& p, PreparedMoves& m, TransferOp op, PreparedId id) const;
  // Builds, splits and starts a transfer of resolved copies on `route` (the
  // holds are its; released here on failure).
  // A transfer given as a program (`copies` empty) is split by its runs,
  // and each chunk expands its share when it runs.
  Result<TransferId> start_transfer(const Peer& p, const Route& route, TransferOp op,
                                    std::vector<transport::Copy> copies, std::vector<RegionHold> holds, uint64_t bytes,
                                    size_t items, SubmitOptions options,
                                    std::shared_ptr<const CopyProgram> program = nullptr,
                                    std::vector<std::shared_ptr<const HeldRegions>> held = {});
  // Requires mu_. The metadata of this engine as it stands.
  EngineMetadata describe_locked() const;
  Result<GrantId> grant_locked(const std::string& label, std::span<const WriteGrant> ranges,
                               std::span<const GrantRepeat> repeats, bool read);
  // Picks the transport and opens a link and a channel (without mu_: it
  // waits on the peer).
  Status open_peer(Peer& peer);
  // Requires mu_. The peer `id`, or kNotFound; kUnavailable naming both
  // engines when its connection is gone and another engine took its name.
  Result<std::shared_ptr<Peer>> find_peer_locked(PeerId id, std::string_view what) const;
  // Answers a notification (the answerer's word) and queues it.
  std::string on_notification(Notification n);

  const EngineOptions options_;
  const std::vector<TransportReport> reports_;
  const EngineHooks hooks_;
  std::string hostname_;
  uint64_t pid_ = 0;
  uint64_t instance_ = 0;  // random, this engine's for its whole life
  // Declared first so they are destroyed last (after every Link).
  std::vector<std::unique_ptr<transport::Transport>> transports_;
  Metrics metrics_;

  mutable std::mutex mu_;  // the registry lock
  std::unique_ptr<Registry> registry_;
  std::map<PeerId, std::shared_ptr<Peer>> peers_;
  std::map<PreparedId, std::shared_ptr<PreparedList>> prepared_;
  std::map<PreparedId, std::shared_ptr<PreparedMoves>> moves_;
  PreparedId next_prepared_ = 1;
  PeerId next_peer_ = 1;
  GrantId next_grant_ = 1;
  std::atomic<uint64_t> next_connection_{1};

  std::unique_ptr<Control> control_;
  std::unique_ptr<Transfers> transfers_;

  std::mutex notes_mu_;
  std::vector<Notification> notes_;
  std::mutex listener_mu_;  // held while the listener runs, so replacing it waits for it
  std::function<void()> listener_;
  std::mutex answerer_mu_;  // held while the answerer runs, so replacing it waits for it
  std::function<std::string(const Notification&)> answerer_;
};

}  // namespace kvbridge::engine_internal
