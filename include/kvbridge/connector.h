// kvbridge/connector.h: the P/D connector, in the shape of the KV-connector
// interfaces serving engines already have.
//
// Pull mode: a prefill instance computes a request's KV and keeps its blocks;
// each decode rank plans the request against the prefill ranks' layouts and
// reads the bytes. Three roles:
//
//  - PrefillScheduler (one per prefill instance): holds a finished request's
//    blocks under a lease, renewed by the readers' heartbeats, and says when
//    they may be freed: when every expected reader reported done, when the
//    lease expires, or when the request is aborted and no reader is left.
//    Each held request is released exactly once.
//  - DecodeScheduler (one per decode instance): tracks requests waiting for
//    remote KV, collects each rank's load result, and reports each request
//    once as finished, failed (policy kFail) or to be recomputed from a token
//    (policy kRecompute), or aborted.
//  - ConnectorWorker (one per rank, both instances): registers the rank's
//    tensors with an Engine, serves its metadata on a side channel (the
//    handshake: docs/formats/handshake.md), fetches remote ranks' metadata once
//    per remote rank, and runs plans as engine reads. It reports each load's
//    result with the first token whose KV did not arrive whole, sends
//    heartbeats and done messages to the prefill ranks it reads from, and, on
//    the prefill side, reports readers' heartbeats and done messages.
//
// The schedulers are pure bookkeeping (time is passed in), so an engine can
// drive them from its own loop; the worker runs on the engine's threads plus
// its own: the side channel's server, a pump for completions, heartbeats and
// done messages, a start thread that plans and submits loads, and four
// connect threads for handshakes, one instance each at a time
// (docs/connector.md, "Threads").
//
// Push mode (WorkerOptions::mode = kPush): the prefill ranks write instead.
// Each plans, for each decode rank, the plan that rank would run, and writes
// the descriptors whose source it is (ConnectorWorker::push); the decode
// ranks' start_load() waits for "kvb/1 wrote <request> <stage> <stages>"
// from every rank it would read, sent after each stage's bytes. The
// schedulers are the same in both modes.
//
// Messages between workers travel as engine notifications:
// "kvb/1 hb <request id> <readers>" and "kvb/1 done <request id> <readers>",
// from the decode rank's engine to each prefill rank it reads from (or
// would read from, when the request moves nothing), and "kvb/1 ready
// <request> <layer>" (streaming, with the producer's event when the layer is
// device memory) from a prefill rank's engine to each decode rank of the
// instance it streams to; in push mode "kvb/1 cancel <request>" (decode ->
// prefill) and "wrote", "unwritten" and "cancelled" (prefill -> decode,
// connector/messages.h); the sender is the engine (name and instance,
// proven with a secret), and a decode rank takes "ready" only from the
// engine of a prefill rank it reads from. The worker takes every
// notification of its engine (Engine::set_notification_listener) and
// answers each "done" (Engine::set_notification_answerer).
//
// The boundary contracts (DESIGN.md, docs/integration.md):
//  - Readiness: a layer is read or pushed only after its producer's event
//    (Readiness) completed; the consumer's pending work on the destination
//    blocks is waited for the same way (LoadOptions::ready).
//  - Finality: once abort() returns, no byte of the load lands; a pull load
//    is reported ok only once every prefill rank it read answered its done
//    "held": the blocks were still the request's when the reads ended
//    (blocks_released() says when they stop being), so a lease that expired
//    under a read fails the load instead of passing another request's bytes.
//  - Holds are derived: readers say how many they are (ReaderEvent::readers,
//    from their instance's layout), and PrefillScheduler::hold(request, now)
//    counts them; nobody configures the number.
//  - Identity is bound: a load may name the incarnation of each remote rank
//    it expects (LoadOptions::incarnations); another one fails it, naming both.
//  - Membership changes: add_remote() replaces an instance's addresses,
//    remove_remote() forgets it, and an instance whose rank is gone is
//    handshaken again by the next load, so a restarted prefill is read
//    without restarting its peers.
//
// Thread-safety: the schedulers are not thread-safe (one owner); every
// ConnectorWorker method may be called from any thread.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/engine.h"
#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/readiness.h"
#include "kvbridge/status.h"

namespace kvbridge {

// A request's id, as engines name requests ("req-1", "cmpl-7f3a..."): 1 to
// kMaxRequestIdBytes bytes of printable ASCII without spaces (it travels in
// the workers' text messages). The calls that start tracking a request
// (PrefillScheduler::hold, DecodeScheduler::expect, start_load, stream_to)
// check it (check_request_id); the others only look it up.
using RequestId = std::string;
inline constexpr size_t kMaxRequestIdBytes = 256;
// OK, or kInvalidArgument saying what is wrong, e.g. "request id 'a b' has a
// space at byte 1; ids are 1 to 256 bytes of printable ASCII without
// spaces".
Status check_request_id(std::string_view id);
using SteadyTime = std::chrono::steady_clock::time_point;

// ---------------------------------------------------------------------------
// Scheduler side.

// What a reader told this (prefill) rank.
struct ReaderEvent {
  enum class Kind : uint8_t { kHeartbeat, kDone } kind = Kind::kHeartbeat;
  RequestId request;
  std::string reader;    // the decode engine's name
  uint32_t readers = 0;  // how many ranks of the reader's instance read the request (0: not said)
};

enum class ReleaseReason : uint8_t { kRead, kLeaseExpired, kAborted };
std::string_view release_reason_name(ReleaseReason reason);

struct Release {
  RequestId request;
  ReleaseReason reason = ReleaseReason::kRead;
  std::vector<std::string> readers_missing;  // expected readers that never reported done
  uint32_t missing_count = 0;                // held by count: readers short of it
  // Held by derived count: readers that said different counts, e.g.
  // "readers disagree on how many they are: 'd/r0' says 2, 'd/r1' says 4"
  // (the hold waited for the largest). Empty when they agreed.
  std::string disagreement;
  // Readers that reported done before the release: their reads had ended
  // while the blocks were held, so their dones that reach other ranks of
  // this instance later are answered "held"
  // (ConnectorWorker::blocks_released(request, readers_done)).
  std::vector<std::string> readers_done;
};

class PrefillScheduler {
 public:
  // `lease`: how long a request is held without word from a reader.
  // `abort_grace`: how long an aborted request nobody was heard reading is
  // still held, so that a reader that started just before (its first
  // heartbeat, sent as it starts, on its way) is heard before its blocks go.
  explicit PrefillScheduler(std::chrono::milliseconds lease = std::chrono::seconds(30),
                            std::chrono::milliseconds abort_grace = std::chrono::milliseconds(2000))
      : lease_(lease), abort_grace_(abort_grace) {}

  // Holds `request` until every rank of the instance that reads it reported
  // done, or the lease (renewed by the readers' heartbeats) expires. The
  // readers say how many they are (ReaderEvent::readers: every rank of the
  // decode instance reads its share, so the count follows from that
  // instance's layout and nobody configures it); each distinct reader (by
  // engine name) counts once, and a reader that does not say (an older
  // peer) is counted without changing the number. kAlreadyExists when held;
  // kInvalidArgument for a bad id.
  Status hold(RequestId request, SteadyTime now);
  // Holds `request` until each of `readers` (decode engine names) reported
  // done, or the lease (renewed by heartbeats) expires: for a caller that
  // knows the reading ranks (a router that picked them). kAlreadyExists when
  // held; kInvalidArgument for an empty reader set or a bad id.
  Status hold(RequestId request, std::set<std::string> readers, SteadyTime now);
  // Held until `readers` distinct engines reported done (each counted once,
  // by name), or the lease expires. kInvalidArgument for 0.
  Status hold(RequestId request, uint32_t readers, SteadyTime now);
  // A reader's heartbeat or done message (what ConnectorWorker::
  // take_reader_events() returns). A heartbeat renews the lease; unknown
  // requests are ignored (a late message after release), and so are readers
  // not expected.
  void on_event(const ReaderEvent& event, SteadyTime now);
  void heartbeat(RequestId request, const std::string& reader, SteadyTime now);
  void reader_done(RequestId request, const std::string& reader, SteadyTime now);
  // Aborts: the blocks are released once no reader is reading: when every
  // reader heard from is done (now, if one was heard and all are), at the
  // next done, or at lease expiry; when none was heard, after abort_grace.
  // kNotFound when not held.
  Status abort(RequestId request, SteadyTime now);
  // Requests whose blocks may be freed now, each exactly once.
  std::vector<Release> take_releases(SteadyTime now);

  size_t held() const { return held_.size(); }
  std::optional<SteadyTime> next_expiry() const;

 private:
  struct Held {
    std::set<std::string> waiting;         // by name
    uint32_t count = 0;                    // by count: readers still to report done
    bool derived = false;                  // by derived count: `count` is what the readers said (0: nobody yet)
    std::map<std::string, uint32_t> said;  // derived: each reader heard and the count it said
    std::set<std::string> done;            // who reported done
    bool heard = false;                    // any heartbeat or done
    bool aborted = false;
    SteadyTime expires;
    SteadyTime abort_free_at;  // aborted: not freed before (a reader on its way is heard first)
  };
  // Records `reader` of a derived hold; the count the readers say.
  void count_reader(Held& h, const std::string& reader, uint32_t readers);
  // Releases `it` when every expected reader is done (aborted: every reader
  // heard from, past the abort grace). True when it did.
  bool settle_if_done(std::map<RequestId, Held>::iterator it, SteadyTime now);
  std::string disagreement(const Held& h) const;
  std::chrono::milliseconds lease_;
  std::chrono::milliseconds abort_grace_;
  std::map<RequestId, Held> held_;
  std::vector<Release> ready_;
};

// Who moves the bytes. kPull (the default): each decode rank reads from the
// prefill ranks. kPush: each prefill rank writes into the decode ranks'
// blocks (ConnectorWorker::push). Both ends of a connection must use the
// same mode: it is part of the side channel's compatibility check, and a
// mismatch fails the handshake naming it.
enum class TransferMode : uint8_t { kPull, kPush };
Result<TransferMode> parse_transfer_mode(std::string_view name);  // "pull", "push"
std::string_view transfer_mode_name(TransferMode mode);

enum class FailurePolicy : uint8_t { kFail, kRecompute };
Result<FailurePolicy> parse_failure_policy(std::string_view name);  // "fail", "recompute"

// One rank's result for one request (ConnectorWorker::take_results()).
struct LoadResult {
  RequestId request;
  Status error;  // OK when every byte arrived
  bool aborted = false;
  uint64_t first_bad_token = 0;  // error: KV before this token arrived whole, and a recompute may start here
  uint64_t bytes = 0, descriptors = 0;
  uint64_t naive_descriptors = 0;               // one per (layer, component, block) for comparison
  std::chrono::microseconds transfer_time{0};   // start_load to the last byte landing (streamed: waits included)
  std::chrono::microseconds completion_lag{0};  // the last byte landing to this result being ready
  // Pull: the reads of the stage that landed last, from their submit to
  // their last byte (streamed: about one layer's reads, what is left after
  // the prefill's last layer at best); 0 in push mode (the sources time it).
  std::chrono::microseconds last_stage_time{0};
  // Pull: start_load to its last read submitted, the host's part before the
  // bytes move (planning, checking, submitting; streamed: the waits for the
  // prefill's layers included); 0 in push mode.
  std::chrono::microseconds submit_time{0};
  // Pull: the CPU time the worker's threads spent planning, checking and
  // submitting this load's reads (the copies, on the engine's threads, not
  // included). Push: planning it and granting its writers their places.
  std::chrono::microseconds submit_cpu_time{0};
  std::vector<uint32_t> sources;  // prefill ranks read from (Layout::rank())
  uint32_t stages = 0;            // reads it was cut into: chunks, or streamed stages
  std::string first_bad_layer;    // error: the first layer of the first stage that did not land
};

enum class Outcome : uint8_t { kFinished, kFailed, kRecompute, kAborted };
std::string_view outcome_name(Outcome outcome);

struct RequestOutcome {
  RequestId request;
  Outcome outcome = Outcome::kFinished;
  Status error;                 // the first rank's error (by rank order)
  uint64_t recompute_from = 0;  // kRecompute: the first token to recompute
};

class DecodeScheduler {
 public:
  DecodeScheduler(uint32_t ranks, FailurePolicy policy) : ranks_(ranks), policy_(policy) {}

  // A request now waits for remote KV from every rank, until `deadline`.
  // `skip_tokens` is what the instance had already (recompute never goes below).
  Status expect(RequestId request, uint64_t skip_tokens, SteadyTime deadline);
  // A rank's load result; kNotFound for a request not waiting, kInvalidArgument
  // for a rank out of range or reported twice.
  Status rank_result(uint32_t rank, const LoadResult& result);
  // A rank is gone: every request waiting on it fails naming the rank.
  void rank_lost(uint32_t rank, const Status& why);
  Status abort(RequestId request);
  // Ended requests, each exactly once; requests past their deadline fail.
  std::vector<RequestOutcome> take_outcomes(SteadyTime now);
  size_t waiting() const { return waiting_.size(); }

 private:
  struct Waiting {
    uint64_t skip = 0;
    SteadyTime deadline;
    std::map<uint32_t, LoadResult> results;
  };
  void settle(RequestId id, Waiting& w);
  uint32_t ranks_;
  FailurePolicy policy_;
  std::map<RequestId, Waiting> waiting_;
  std::vector<RequestOutcome> ended_;
};

// ---------------------------------------------------------------------------
// Worker side.

struct WorkerOptions {
  std::string instance_id;                      // e.g. "prefill-0"; names this rank with its rank (Layout::rank())
  std::string side_channel_host = "127.0.0.1";  // the side channel's bind address
  // The address remote ranks are given for it (side_channel_address()) when
  // it is not side_channel_host: needed when that is a wildcard ("0.0.0.0"),
  // which create() refuses without one. Empty: side_channel_host.
  std::string side_channel_advertise_host;
  // Shared secret of the side channel: must be the engine's own
  // (EngineOptions::secret), so the handshake, the control channel and the
  // data plane share one trust; create() refuses a worker whose secret and
  // engine disagree on having one. Empty: none.
  std::string secret;
  std::chrono::milliseconds handshake_timeout{5000};
  std::chrono::milliseconds transfer_timeout{30000};
  std::chrono::milliseconds heartbeat_interval{1000};
  // Check every plan with verify() (verify.h) before it runs: the load fails
  // (kInternal, naming the first wrong byte) instead of moving a wrong byte.
  // Costs a simulated execution per request; for tests and debugging.
  bool verify_plans = false;
  // End-to-end integrity (SubmitOptions::verify_content): every read of a
  // load and every write of a push is hashed (XXH3-64 of each 64 KiB, then
  // of those; device memory on its device) where it landed and
  // at its source after the source's readiness, and a load whose bytes
  // differ anywhere fails naming the piece, instead of ending done. It moves
  // no byte differently; it hashes every byte on both sides, and over
  // transports without a hashing server (local, cma, ucx) reads it once more
  // (bench/engine_bench, BM_VerifyContent).
  bool verify_content = false;
  // Pull or push (TransferMode); the same on every rank of both instances.
  TransferMode mode = TransferMode::kPull;
  // What peers may do to this rank's tensors: kRead for a pull-mode
  // prefill rank (the default: decode ranks read it), or kGrantedRead (a
  // reader may read only the blocks of the requests handed off to it,
  // hand_off(), while they are held; enforced where the transport serves
  // the reads, tcp), kNone for a rank that
  // only reads from others (a pull-mode decode rank); in push mode
  // kGrantedWrite for a decode rank (each load grants its sources exactly
  // its blocks while it lasts, Engine::grant_writes; enforced where the
  // transport serves the writes, tcp) or kWrite, and kNone for a prefill
  // rank.
  RemoteAccess remote_access = RemoteAccess::kRead;
  // Loads are cut into token-ordered chunks of about this many tokens
  // (plan_chunks(), plan.h: rounded up to whole blocks of both sides), one
  // read per chunk and source rank, so that a load that fails part way
  // reports in LoadResult::first_bad_token the first chunk that did not
  // arrive whole, and a recompute starts there. A request whose KV cannot
  // resume mid-way (a state or scratch group, a sliding window moved only in
  // part) is one chunk whatever this says. 0: one chunk per load. A
  // streamed load is not cut by tokens (its stages are layer ranges: a
  // layer's chunks would become ready together and move together).
  uint64_t load_chunk_tokens = 2048;
  // A streamed load (LoadOptions::stream) moves in stages of this many
  // consecutive layers of layer_order() (plan_stages(), plan.h), each read
  // once every prefill rank it reads from said its layers are saved. 0: all
  // layers in one stage. A stage is its layers for every token (not cut by
  // load_chunk_tokens), one read (write) per source rank: a stage that
  // fails leaves those layers bad for every token, so first_bad_token is
  // then the first the load moves (a streamed load's failures are of whole
  // layers anyway: a source gone, a layer not announced in time). From a
  // shape's template on, a later layer's stage is the first layer's moved.
  uint32_t stream_layers_per_stage = 1;
};

// How start_load() moves one request.
struct LoadOptions {
  // Layer-wise streaming: start the load at admission, while the prefill is
  // still computing. Each stage (WorkerOptions::stream_layers_per_stage
  // layers) is read as soon as every prefill rank
  // it reads from has announced its layers (save_layer(), after stream_to()
  // this decode instance); wait_for_layer() says when a layer has landed.
  // A stage not announced within transfer_timeout of start_load fails the
  // load, naming the layer. Off (the default): the prefill has finished and
  // everything is read at once.
  bool stream = false;
  // Pull: the engine's pending work on this request's local blocks (e.g.
  // the previous owner's kernels): the reads into device memory wait for it
  // on the device. Host memory needs none.
  Readiness ready;
  // The incarnation of each remote rank (ConnectorWorker::incarnation() of
  // the ranks that handed the request off, in rank order), as the hand-off
  // named them: a rank that is now another process (it restarted, and the
  // request's KV went with it) fails the load naming both. Empty: not checked.
  std::vector<std::string> incarnations;
  // The remote ranks' side channels as the hand-off named them, in rank
  // order. Empty: the instance's (add_remote()). Other addresses are
  // handshaken with for this load (and kept for later loads that name them)
  // beside the instance's own, which they do not replace: a hand-off from a
  // process that is gone fails on its own, and names how the instance
  // answers elsewhere.
  std::vector<std::string> addresses;

  // Options with only `stream` set.
  static LoadOptions streaming(bool on = true) {
    LoadOptions o;
    o.stream = on;
    return o;
  }
};

struct WorkerStats {
  uint64_t handshakes = 0;         // remote ranks fetched (once per remote rank per instance)
  uint64_t handshakes_served = 0;  // served by this rank's side channel
  uint64_t handshakes_rejected = 0;
  std::string last_rejection;
  uint64_t loads_started = 0, loads_ok = 0, loads_failed = 0, loads_aborted = 0;
  uint64_t loads_queued = 0;                        // waited for their instance's handshake (it was not connected yet)
  uint64_t plans_verified = 0, plans_rejected = 0;  // with WorkerOptions::verify_plans
  // Loads are planned from stage templates (StageTemplate, plan.h), one per
  // (remote instance, request shape, streaming or not), built by the second
  // load of its shape (a push-mode prefill rank plans its readers' loads so
  // too; a shape is exact, token counts included): templates built, loads
  // planned from one, and loads planned afresh (the first of their shape, or
  // one whose template cannot serve, with the last reason why).
  uint64_t plan_templates = 0, plans_from_templates = 0, plans_not_templated = 0;
  std::string plan_template_fallback;
  // Pull reads submitted as runs (a template's later layers as moved runs
  // of its first: checked as a whole, expanded by the engine's threads as
  // they copy), and the moved runs in them.
  uint64_t reads_as_runs = 0, moved_runs = 0;
  // Push: stage writes submitted as runs (the same: a template's later
  // layers as moved runs of its first).
  uint64_t writes_as_runs = 0;
  // Tables of moves prepared with the engine (Engine::prepare_moves), one
  // per (source rank, a stage's moves), so that a read's moved runs are
  // checked as one: prepared, and kept now.
  uint64_t move_tables = 0, move_tables_kept = 0;
  // Streamed: reads of a stage that is an earlier stage moved (a later
  // layer's: StageTemplate::instantiate_moved), each submitted as runs of
  // that stage's items, prepared with the engine once per load and source
  // (Engine::submit_runs); the lists prepared (also for moved_stage_writes)
  // and those held now (by loads and pushes not over yet).
  uint64_t moved_stage_reads = 0, prepared_lists = 0, prepared_lists_held = 0;
  // Push, streamed: writes of a stage that is an earlier stage moved, each
  // submitted as runs of that stage's items, prepared with the engine once
  // per push and decode rank, released when wait_for_save() returns.
  uint64_t moved_stage_writes = 0;
  // Pull, streamed: layer announcements sent to decode ranks, and those not
  // sent to a rank that answered an earlier one "unread" (it reads nothing
  // from this rank).
  uint64_t announcements_sent = 0, announcements_skipped = 0;
  uint64_t notifications_failed = 0;
  // Pull: reads a source refused as not granted (WorkerOptions::remote_access
  // kGrantedRead there: the read overtook the hand-off or this rank's
  // heartbeat), each tried again until the load's deadline.
  uint64_t reads_refused = 0;
  std::string last_notification_error;
};

class ConnectorWorker {
 public:
  // Registers each tensor of `layout` (memory given per tensor, in layout
  // order, each exactly the tensor's bytes) with `engine`, and starts the
  // side channel. The engine and the memory must outlive the worker.
  static Result<std::unique_ptr<ConnectorWorker>> create(Engine& engine, const Layout& layout,
                                                         std::span<const std::span<uint8_t>> tensors,
                                                         const WorkerOptions& options);
  // Cancels every load in progress (as abort()), stops the side channel.
  virtual ~ConnectorWorker() = default;

  virtual std::string side_channel_address() const = 0;
  virtual const Layout& layout() const = 0;

  // This rank's incarnation: its engine's instance id, 16 hex digits. A
  // restarted rank has another one; a hand-off names it so that a reader
  // never takes a stranger's bytes for the request's (LoadOptions).
  virtual std::string incarnation() const = 0;

  // The side channels of a remote instance's ranks, in rank order
  // (Layout::rank(): tp_rank, stage by stage for pipeline stages). Their
  // metadata is fetched on the first load from that instance, once per rank,
  // and again by the first load after one of its ranks is gone (a restart).
  // Other addresses for a known instance replace the old ones (it moved or
  // restarted): later loads handshake with the new ranks, and loads under
  // way keep the ranks they read. Each rank must describe itself as a rank
  // of `instance` (RankInfo::instance_id), or the handshake fails naming
  // both. kInvalidArgument, naming the rank and the text, for an address
  // that is not host:port (checked here, not at the first load).
  virtual Status add_remote(const std::string& instance, std::vector<std::string> rank_addresses) = 0;
  // Forgets `instance` (it left): loads queued for it fail naming it; loads
  // under way keep their ranks. kNotFound when unknown.
  virtual Status remove_remote(const std::string& instance) = 0;
  // Handshakes with every rank of `instance` and connects to its engines,
  // ahead of the first load, on the worker's connect thread: returns at
  // once (kNotFound for an instance never added). wait_connected() returns
  // OK once connected, the attempt's error (naming the rank) if it failed,
  // or kTimeout; it starts an attempt when none is under way, and a failed
  // attempt is retried by the next connect(), wait_connected() or load.
  virtual Status connect(const std::string& instance) = 0;
  virtual Status wait_connected(const std::string& instance, std::chrono::milliseconds timeout) = 0;

  // Decode side: queues `request` (local ids = this rank's blocks, remote
  // ids = the prefill instance's) and returns; the worker's start thread
  // plans and submits it, after the connect thread's handshake when the
  // instance is not connected yet (connect(), or an earlier load). It never
  // waits on the network or on the planner. Here: kInvalidArgument for a bad
  // id, kNotFound for an instance never added, kAlreadyExists for a request
  // loading or queued. Every later error (handshake, plan, submit, the
  // reads) arrives as its LoadResult (first_bad_token: skip_tokens when
  // nothing moved), which the caller reports as failed at that token.
  Status start_load(RequestId request, const std::string& instance, const Request& blocks) {
    return start_load(request, instance, blocks, LoadOptions{});
  }
  virtual Status start_load(RequestId request, const std::string& instance, const Request& blocks,
                            const LoadOptions& options) = 0;
  // Decode side: returns once every byte of `layer` (a name of
  // layer_order()) that the load of `request` moves has landed (OK), or the
  // load ended without it (its error), or `timeout` passed (kTimeout). A
  // layer the load does not move has landed at once. For a request that
  // ended: its outcome, as long as it is among the last 4096 ended;
  // kNotFound for one never loaded; kInvalidArgument for an unknown layer.
  virtual Status wait_for_layer(RequestId request, std::string_view layer, std::chrono::milliseconds timeout) = 0;
  // Cancels the request's transfers; when it returns no byte of it lands in
  // local memory, and no stage not yet started will start. Its result comes
  // with aborted = true. The prefill ranks it reads from are told it is done
  // (so they free its blocks without waiting for the lease), also for a load
  // aborted while queued, once its instance is connected. kNotFound if unknown.
  virtual Status abort(RequestId request) = 0;
  // Loads that ended since the last call.
  virtual std::vector<LoadResult> take_results() = 0;
  // Waits until a result is ready or `timeout` passes.
  virtual void wait_results(std::chrono::milliseconds timeout) = 0;

  // Prefill side: readers' heartbeats and done messages since the last call.
  virtual std::vector<ReaderEvent> take_reader_events() = 0;
  // Prefill side: the engine frees the request's blocks now (its hold ended:
  // read, lease expired, or aborted). A reader's done that comes later is
  // answered "released", so a load whose reads may have seen the blocks'
  // next owner fails instead of passing those bytes as the request's;
  // except from the engines named in `readers_done` (Release::readers_done:
  // readers whose done some rank of this instance heard before the release,
  // so whose reads ended while the blocks were held; a reader of several
  // ranks sends each its done, and one may arrive after another made the
  // hold end). Call it before anything can write to those blocks again (an
  // engine's step: before the forward pass of the step whose scheduler freed
  // them). The last 65,536 released requests are remembered.
  virtual void blocks_released(RequestId request, const std::vector<std::string>& readers_done) = 0;
  void blocks_released(RequestId request) { blocks_released(std::move(request), {}); }
  // Prefill side, pull mode: `request`'s KV is in this rank's blocks
  // `blocks` (by group name, as the hand-off names them; ids below 0
  // skipped), and is handed off to a reader. With WorkerOptions::
  // remote_access kGrantedRead, a reader's engine may read exactly those
  // blocks' bytes from its first heartbeat for the request (before or after
  // this call) until blocks_released(), and nothing else of this rank's KV
  // that another hand-off does not grant it: a read of blocks not handed off
  // for a request it reads is refused where the transport serves reads
  // itself (tcp; a reader retries a refused read until its transfer
  // timeout, so a heartbeat that overtakes the hand-off costs a retry).
  // Otherwise it only checks its arguments. kInvalidArgument naming an
  // unknown group or a bad id, kOutOfRange a block past its group,
  // kAlreadyExists for a request handed off and not released.
  virtual Status hand_off(RequestId request, const std::map<std::string, std::vector<int64_t>>& blocks) = 0;

  // Prefill side, layer-wise streaming (the hooks engines already call):
  // stream_to() names the decode instance (known by add_remote()) whose
  // ranks load `request` streamed; save_layer() says that this rank has
  // written every token of `layer` of the request (a name of layer_order()),
  // or queued the work that writes it, after which `ready` completes; so
  // readers may read it now (after `ready`); wait_for_save() returns once
  // every announcement was acknowledged by every decode rank, with the
  // first error, and forgets the request. Either of stream_to() and
  // save_layer() may come first: layers saved before stream_to() are
  // announced once the instance is connected. Saving a layer again is a
  // no-op. Neither blocks: stream_to() hands the decode instance's handshake
  // and connects to the connect thread, whose errors wait_for_save()
  // returns. save_layer() of a layer in device memory needs `ready`
  // (Readiness: in pull mode event_handle, which the announcement carries
  // to the readers; in push mode either event): kInvalidArgument naming the
  // layer without it. kInvalidArgument for an unknown layer; kNotFound from
  // wait_for_save() for a request never streamed; kTimeout when
  // acknowledgements are still missing after `timeout` (a poll, with 0), and
  // only then; kUnavailable, with the cause, when the decode instance could
  // not be reached or an announcement failed.
  virtual Status stream_to(RequestId request, const std::string& instance) = 0;
  virtual Status save_layer(RequestId request, std::string_view layer, const Readiness& ready) = 0;
  Status save_layer(RequestId request, std::string_view layer) {
    return save_layer(std::move(request), layer, Readiness{});
  }
  virtual Status wait_for_save(RequestId request, std::chrono::milliseconds timeout) = 0;

  // Push mode (WorkerOptions::mode), prefill side: writes this rank's part
  // of `request` into the blocks of the decode instance `instance` (known by
  // add_remote()). `blocks` is what that instance's ranks pass to
  // start_load(): local ids are the decode instance's, remote ids this
  // instance's. For each decode rank the worker plans as that rank does
  // (plan_stages() with the same stage options: both sides must agree on
  // load_chunk_tokens and stream_layers_per_stage), over every rank of this
  // instance, so this instance must be known by add_remote() too; it writes
  // the descriptors whose source is this rank, and after each stage's bytes
  // it tells the decode rank ("kvb/1 wrote"), whose start_load() waits for
  // that from every rank it would read. Without options.stream everything
  // is written now (the KV is computed); with it, each stage once this rank
  // has saved its layers (save_layer()). wait_for_save() returns once every
  // write ended, with the first error. A decode rank's abort() cancels the
  // writes to it ("kvb/1 cancel"), and the rank confirms when none can land
  // any more ("kvb/1 cancelled"); a request cancelled before push() is
  // never written to that rank. push() dials the decode instance's ranks
  // once per instance and plans on the caller's thread; the writes run on
  // the engine's. kInvalidArgument in pull mode; kNotFound for an instance
  // (or this one) not added; kAlreadyExists for a
  // request pushed already; plan errors as plan_stages()'s.
  virtual Status push(RequestId request, const std::string& instance, const Request& blocks,
                      const LoadOptions& options) = 0;

  virtual WorkerStats stats() const = 0;
};

}  // namespace kvbridge
