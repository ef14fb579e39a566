// kvbridge/engine.h: registered memory, peers, and asynchronous transfers.
//
// One Engine per process. It registers memory (deduplicating identical
// registrations and merging overlapping ones), publishes self-describing,
// versioned metadata that a peer needs to reach it (docs/formats/engine-metadata.md),
// connects to peers from their metadata, and executes batches of copies
// between local registrations and a peer's registrations as reads (peer ->
// local) or writes (local -> peer), with an optional notification delivered
// to the peer after the last byte. Transports (local, cma, tcp, ucx) are
// chosen per peer from what both sides offer, in the engine's preference order.
//
// Safety contract:
//  - Every item is checked before anything is posted: the local handle and
//    range against this engine's registrations, the remote range against the
//    peer's advertised registrations. Out of bounds fails the whole submit;
//    nothing moves.
//  - A transfer ends exactly once as kDone, kFailed (first error, bytes
//    completed) or kCancelled. Transfers have deadlines: nothing waits forever.
//  - After cancel() returns, no further byte of that transfer lands in local
//    memory (for reads) nor in the peer's (for writes: every transport waits
//    for what it sent to be acknowledged, up to 200 ms for a peer that
//    stopped answering; past that the transfer's error says that bytes
//    already sent may still land).
//  - A registration cannot be removed while a transfer uses it.
//
// Thread-safety: every method may be called from any thread. Work runs on the
// engine's own threads, on a transport's own thread (ucx), or, for a small
// transfer on a same-host transport, inside submit() on the caller's thread
// (EngineOptions::inline_bytes); docs/thread_model.md. Ownership: registered
// memory stays owned by the caller and must stay valid until
// deregister_memory() returns OK.
#pragma once

#include <array>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/status.h"
#include "kvbridge/transfer_op.h"

namespace kvbridge {

using RegionId = uint32_t;    // a local registration handle, or a peer's
using PeerId = uint32_t;      // a connected peer
using TransferId = uint64_t;  // a submitted transfer

enum class TransferState : uint8_t { kInProgress, kDone, kFailed, kCancelled };
std::string_view transfer_state_name(TransferState state);

// One copy of a transfer. Offsets are from the start of each registration.
struct TransferItem {
  RegionId local = 0;
  uint64_t local_offset = 0;
  RegionId remote = 0;  // the id the peer advertised in its metadata
  uint64_t remote_offset = 0;
  uint64_t bytes = 0;
};

// A run of a batch's items (Engine::submit with runs): items [first,
// first + count) as they are, or, `moved`, the same items moved: each one
// names region `local` at its local offset plus `local_shift` and peer
// region `remote` at its remote offset plus `remote_shift` (modulo 2^64:
// a shift may move items lower). A moved run
// repeats exactly an earlier literal run of the batch, whose items all
// name one local and one peer region: the layers of a layer-major cache,
// whose items are the first layer's at other regions.
// A prepared table of moves (Engine::prepare_moves) is named by a
// PreparedId.
using PreparedId = uint64_t;

struct ItemRun {
  uint64_t first = 0, count = 0;
  bool moved = false;
  RegionId local = 0;
  uint64_t local_shift = 0;
  RegionId remote = 0;
  uint64_t remote_shift = 0;
  // Moved, when not 0: one moved run per move of this prepared table, in
  // its order (local, remote and the shifts above are not used).
  PreparedId moves = 0;
};

// Where a moved run takes items (ItemRun's local, remote and shifts), for
// a prepared table of them (Engine::prepare_moves).
struct RunMove {
  RegionId local = 0;
  uint64_t local_shift = 0;
  RegionId remote = 0;
  uint64_t remote_shift = 0;
  bool operator==(const RunMove&) const = default;
};

struct TransferStatus {
  TransferState state = TransferState::kInProgress;
  Status error;             // kFailed: the first error; kCancelled: why
  uint64_t bytes_done = 0;  // bytes known to have completed
  uint64_t bytes_total = 0;
  std::chrono::steady_clock::time_point ended_at{};  // when it ended (its last byte landed, for kDone)
};

// How a transfer is submitted.
struct SubmitOptions {
  // Delivered to the peer after the last byte, when not empty.
  std::string notification;
  // 0: EngineOptions::default_timeout.
  std::chrono::milliseconds timeout{0};
  // The completion: called exactly once when the transfer ends (done,
  // failed or cancelled), with its id and final status, on an engine or
  // transport thread, or inside submit() for a transfer that ended there
  // (then before submit() returns its id). It runs with no engine lock held
  // and must not block; it may call status() and release().
  std::function<void(TransferId, const TransferStatus&)> on_end;
  // Device memory only ("this KV is ready after this"): the transfer
  // copies nothing before these events completed, so it never reads KV
  // that the producer's kernels are still writing. IPC event handles
  // (cudaIpcEventHandle_t bytes, e.g. torch.cuda.Event(interprocess=True)
  // .ipc_handle()) from any process on this host, opened once and cached;
  // and an event of this process (a cudaEvent_t, recorded by the caller
  // before submit; 0: none). The wait runs on the host before the copy is
  // queued, so cancel() and the deadline still end a transfer whose
  // producer never finishes. kInvalidArgument for a transfer that touches
  // no device memory, or more than kMaxReadyEvents handles.
  std::vector<std::string> ready_event_handles;
  uintptr_t ready_event = 0;
  // The content check, end to end: once each run of the transfer returned
  // OK, the content hash (XXH3-64 of each 64 KiB leaf, then of the leaves'
  // hashes) of every copy's bytes here is compared with the same bytes on
  // the peer as they are then (after the producer's readiness, and after
  // they landed): hashed by the peer's own server where the transport has
  // one (tcp), in place where the peer is this process (local), else read
  // back into scratch memory and hashed here; device memory is hashed on
  // its device (a kernel, a thread per leaf). A difference fails the
  // transfer (kIoError "content check failed", naming the copy's bytes, the
  // peer's address and segment, and both hashes), so a transport or peer
  // that reports bytes it never moved, or bytes the source changed under
  // the read, is never reported done. It reads every byte once more:
  // measured by bench/engine_bench (BM_VerifyContent).
  bool verify_content = false;
};

inline constexpr size_t kMaxReadyEvents = 16;

// A list of items checked and resolved once (Engine::prepare): any subset
// is then submitted by index without checking again (PreparedId, above).

struct Notification {
  std::string peer;  // the sender's engine name, as its connection opened
  std::string message;
  uint64_t peer_instance = 0;  // the sender's engine instance (with a secret: proven)
};

// What peers may do to a registration. A peer learns of a registration only
// when it grants some access; the engine checks each remote range against
// what the peer advertised before posting, and the tcp transport's server
// refuses what a segment does not grant. (cma cannot enforce it: a process
// that may ptrace this one reads and writes all of its memory.)
// kGrantedWrite (and kReadGrantedWrite): peers may write only the ranges
// this engine granted them (Engine::grant_writes), as long as the grant
// lasts; peers see it as write access. Enforced where this engine serves
// peers' writes itself (tcp: a write outside every grant to its writer is
// refused and nothing of it lands); a peer that writes this process's memory
// directly (local, cma, ucx, cuda_ipc) is bound only by its own engine.
// kGrantedRead: peers may read only the ranges this engine granted them
// (Engine::grant_reads), as long as the grant lasts; peers see it as read
// access. Enforced the same way, where this engine serves reads itself
// (tcp): a read outside every grant to its reader is refused, and one a
// revoke overtakes stops.
enum class RemoteAccess : uint8_t {
  kNone = 0,
  kRead = 1,
  kWrite = 2,
  kReadWrite = 3,
  kGrantedWrite = 6,
  kReadGrantedWrite = 7,
  kGrantedRead = 9,
};
// "none", "read", "write", "read_write", "granted_write", "read_granted_write",
// "granted_read"
std::string_view remote_access_name(RemoteAccess access);
Result<RemoteAccess> parse_remote_access(std::string_view name);

// A range of a registration that a peer may write (Engine::grant_writes)
// or read (Engine::grant_reads).
struct WriteGrant {
  RegionId region = 0;
  uint64_t offset = 0;
  uint64_t bytes = 0;
};
// Ranges a grant gives again elsewhere: ranges [first, first + count) of
// its list, each again in region `region` at its offset plus `shift`
// (modulo 2^64: a shift may move them lower). The ranges repeated must all
// be of one region. A request's blocks in one tensor, repeated in each of
// the others, grant its places in a list that grows with its blocks, not
// with its layers.
struct GrantRepeat {
  uint64_t first = 0, count = 0;
  RegionId region = 0;
  uint64_t shift = 0;
};
using GrantId = uint64_t;

struct EngineOptions {
  // Shown to peers and in errors. Empty: a name of this engine's own,
  // "kvbridge-<host>-<pid>-<4 hex digits>". Names need not be unique: a peer
  // is told apart by the random instance id in its metadata, so two engines
  // with one name are two peers, never one.
  std::string name;
  // Transports in order of preference; empty means every available one
  // (local, cuda_ipc, cma, tcp, ucx). A peer is reached by the first one
  // both offer, and for memory kinds that one does not move (device memory
  // for cma, tcp, ucx; host memory on the peer for cuda_ipc), by the first
  // one that does: a same-host peer has cuda_ipc and cma.
  std::vector<std::string> transports;
  // Address every listener of this engine binds (control, tcp, and the
  // interface UCX may listen on): "host" or "[v6]".
  std::string host = "127.0.0.1";
  // Address peers are told to dial (in metadata()), when it is not `host`:
  // the host's address on the peers' network when `host` is a wildcard
  // ("0.0.0.0", "::"), which no peer can dial; create() refuses a wildcard
  // host without one. Empty: `host`.
  std::string advertise_host;
  // Shared secret: when not empty, every control connection and tcp stream
  // opens with mutual proof of it and every frame on them is tagged
  // (docs/security.md); peers must hold the same one. Empty: none.
  std::string secret;
  // The ucx transport alongside a secret. UCX's own listener takes no part
  // in the secret (UCX 1.13 has no hook to check one before its wire-up),
  // and UCX serves remote memory access itself: where a transport has no
  // hardware RMA (UCX_TLS=tcp), it emulates it with messages that read or
  // write the address they name, registered or not. So anyone who can reach
  // UCX's interface could read or write this process's memory. With a
  // secret, the default transport list leaves ucx out (transports() says
  // why), and create() refuses "ucx" listed in `transports` unless this is
  // true: every host that can reach that interface is trusted.
  bool ucx_trusted_network = false;
  std::chrono::milliseconds connect_timeout{5000};  // a control connection's opening, in connect()
  uint32_t tcp_streams = 4;                         // connections per peer for tcp
  uint32_t threads = 2;                             // worker threads
  // A transfer of at most this many bytes, without a notification, on a
  // transport whose copies never wait on a network (local, cma), runs on
  // the submitting thread: submit() returns with it ended (status() tells
  // how). Handing it to a worker thread would cost more than the copy (a
  // thread wake-up is several microseconds; 256 KiB of memcpy is ~40).
  // 0: every transfer runs on the engine's threads.
  uint64_t inline_bytes = uint64_t{256} << 10;
  std::chrono::milliseconds default_timeout{30000};
  // How device memory is copied (cuda_ipc, and local runs that touch device
  // memory): "copy_engine" (one cudaMemcpyBatchAsync per transfer; leaves
  // the SMs to the model), "kernel" (a gather/scatter kernel over the
  // descriptors on a grid of at most `device_copy_blocks` blocks, 0: 32), or
  // "auto": the kernel for a transfer of at least `device_copy_kernel_min`
  // copies of at most `device_copy_kernel_below` bytes on average, the copy
  // engines otherwise. The crossover is the device's: gpu_bench measures
  // and prints it; 0 (until measured) gives every transfer to the copy
  // engines. docs/gpu.md says how they compare.
  std::string device_copy = "copy_engine";
  uint32_t device_copy_blocks = 0;
  uint64_t device_copy_kernel_below = 0;
  uint32_t device_copy_kernel_min = 64;
  // Pin registered host memory for copies to and from devices
  // (cudaHostRegister at registration, undone at deregistration), when
  // this engine has a transport that moves device memory (local,
  // cuda_ipc) and the process has a device: a copy engine then moves it
  // directly instead of staging it through the driver, and device-to-host
  // copies do not block. Memory CUDA cannot pin stays registered unpinned.
  bool pin_host_memory = true;
  // Device memory over tcp (a peer on another host, or memory kinds no
  // same-host transport moves): staged through this much pinned host
  // memory, allocated and pinned at the first staged transfer, in chunks of
  // `staging_chunk_bytes` (64 KiB .. 1 GiB; the pool holds at least three);
  // as much again, pinned at the first staged request served, for serving
  // peers' transfers of this engine's device memory (tcp; ucx stages only
  // its own transfers). Each staged run holds three chunks while it runs
  // and each serving stream one; a transfer that finds no free chunk before its deadline fails
  // (resource_exhausted). docs/gpu.md ("Across hosts") says what it costs.
  uint64_t staging_bytes = uint64_t{64} << 20;
  uint64_t staging_chunk_bytes = uint64_t{2} << 20;
};

// A transport this engine can or cannot use, and why.
struct TransportReport {
  std::string name;
  bool available = false;
  std::string reason;  // why not, e.g. "ptrace_scope 3 forbids process_vm_readv"
};

inline constexpr size_t kLatencyBuckets = 16;  // 2^k microseconds, k = 0..15 (last: more)

struct EngineMetrics {
  uint64_t transfers_submitted = 0, transfers_done = 0, transfers_failed = 0, transfers_cancelled = 0;
  uint64_t descriptors = 0, bytes_read = 0, bytes_written = 0;
  uint64_t notifications_sent = 0, notifications_received = 0;
  // The content check (SubmitOptions::verify_content): bytes whose hashes
  // matched on both sides, and runs whose bytes differed.
  uint64_t bytes_content_checked = 0, content_check_failures = 0;
  // Times a submit (or the end of a batch, Engine::begin_batch()) woke the
  // engine's sleeping threads for the chunks it queued.
  uint64_t worker_wakeups = 0;
  std::array<uint64_t, kLatencyBuckets> latency_us_buckets{};  // completed transfers by latency
};

class Engine {
 public:
  // Starts the engine's threads and listeners. kUnavailable when a transport
  // named in options.transports cannot run here (the message says why).
  static Result<std::unique_ptr<Engine>> create(const EngineOptions& options);

  // Cancels every transfer still in progress (each completes as kCancelled),
  // closes peers, joins threads.
  virtual ~Engine() = default;

  virtual const std::string& name() const = 0;
  // This engine's instance: a random id for its whole life, which its
  // metadata carries and which its peers' notifications name it by
  // (Notification::peer_instance). A restarted process has another.
  virtual uint64_t instance() const = 0;
  // Whether the engine was created with a shared secret.
  virtual bool has_secret() const = 0;
  virtual std::vector<TransportReport> transports() const = 0;

  // Registers [base, base + bytes) of kind `memory` ("host", or "cuda:N":
  // device memory of device N, from cudaMalloc), granting peers `access`
  // to it. Registering the same range again returns the same id (reference
  // counted); overlapping ranges are merged for the transports.
  // kInvalidArgument for a null or empty range, an unknown memory kind, a
  // range that overlaps a registration of another kind or access, or a
  // cuda:N range that is not all device memory of device N (host, managed,
  // or another device's memory: the message says which byte and what it
  // is); kUnavailable for cuda:N without a device (a build without CUDA, no
  // driver, no GPU: the message says which). Device memory that CUDA IPC
  // cannot export (cuMemCreate) registers, and a peer's transfer of it
  // fails saying why (docs/gpu.md).
  virtual Result<RegionId> register_memory(void* base, uint64_t bytes, std::string_view memory,
                                           RemoteAccess access) = 0;
  Result<RegionId> register_memory(void* base, uint64_t bytes, std::string_view memory = "host") {
    return register_memory(base, bytes, memory, RemoteAccess::kReadWrite);
  }
  // Drops one reference. kUnavailable while a transfer uses it (nothing
  // changes); kNotFound for an unknown id.
  virtual Status deregister_memory(RegionId id) = 0;

  // Lets the connected engine `peer` (that instance, as its streams open:
  // with a secret, proven to hold it) write `ranges`, and each of
  // `repeats` of them, of registrations made with kGrantedWrite until
  // revoke_writes(); other registrations are not affected. Each range, as
  // it is and repeated, must lie inside its registration. A write that a
  // revoke overtakes is stopped: when revoke_writes() returns, no byte of a
  // peer's write lands in a range that no grant covers any more.
  // kNotFound for an unknown peer or region, kOutOfRange outside a
  // registration, kInvalidArgument for an empty range, or a repeat of no
  // ranges, of ranges past the list or of ranges of several regions.
  virtual Result<GrantId> grant_writes(PeerId peer, std::span<const WriteGrant> ranges,
                                       std::span<const GrantRepeat> repeats = {}) = 0;
  // Ends a grant; unknown ids are ignored.
  virtual void revoke_writes(GrantId grant) = 0;

  // Lets the engine named `peer_name` with instance `peer_instance` (as its
  // streams open: with a secret, proven to hold it; a Notification names
  // both) read `ranges`, and each of `repeats` of them, of registrations
  // made with kGrantedRead until revoke_reads(). No connection to it is
  // needed. When revoke_reads() returns, no byte outside every remaining
  // grant to that reader is sent to it. Errors as grant_writes', and
  // kInvalidArgument for an empty name.
  virtual Result<GrantId> grant_reads(std::string_view peer_name, uint64_t peer_instance,
                                      std::span<const WriteGrant> ranges,
                                      std::span<const GrantRepeat> repeats = {}) = 0;
  // The ranges of the live read grant `like` granted to another reader too,
  // as a grant of its own (revoked by itself): one copy of a hand-off's
  // ranges for every reader. kInvalidArgument for an empty name.
  virtual Result<GrantId> share_reads(GrantId like, std::string_view peer_name, uint64_t peer_instance) = 0;
  virtual void revoke_reads(GrantId grant) = 0;

  // The bytes a peer passes to connect(): versioned, bounded (at most
  // kMaxEngineMetadataBytes), listing transports and registrations.
  // Registrations made later need a fresh metadata() and refresh().
  virtual std::string metadata() const = 0;

  // Connects to the peer described by `metadata`. A peer is one engine:
  // its name and the random instance id in its metadata, never the name
  // alone. Connecting again to the same engine returns the same id and
  // refreshes its registrations; an engine with a known name but another
  // instance (a second engine under that name, or a restarted process) is a
  // new peer with a new id, and once the old one's connection is gone,
  // everything aimed at the old id fails naming both. kInvalidArgument for
  // malformed metadata, kIncompatible for a version mismatch, kUnavailable
  // when no transport is shared (the message lists both sides' transports).
  virtual Result<PeerId> connect(std::string_view metadata) = 0;

  // OK while the peer's control connection is open; once it is gone (its
  // process exited, or the connection broke) its error (kIoError naming the
  // peer, and who holds its name now when another engine connected under
  // it); kNotFound for an unknown id. Cheap: no message is sent.
  virtual Status peer_status(PeerId peer) const = 0;

  // Submits a transfer and returns at once (a small one on a same-host
  // transport may already have ended: EngineOptions::inline_bytes). Failures
  // of the transfer itself are reported by status()/wait(), never by
  // submit(). `notification`, when not empty,
  // is delivered to the peer after the last byte. Errors (nothing is posted):
  // kNotFound for an unknown peer or region, kOutOfRange for an item outside
  // a registration (naming the item and region), kPermissionDenied for a
  // remote region that does not grant the access (a read needs read, a
  // write write), kInvalidArgument for an empty batch or a zero-length item.
  virtual Result<TransferId> submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                                    SubmitOptions options) = 0;
  Result<TransferId> submit(PeerId peer, TransferOp op, std::span<const TransferItem> items, std::string notification,
                            std::chrono::milliseconds timeout) {
    SubmitOptions o;
    o.notification = std::move(notification);
    o.timeout = timeout;
    return submit(peer, op, items, std::move(o));
  }
  Result<TransferId> submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                            std::string notification = {}) {
    return submit(peer, op, items, std::move(notification), std::chrono::milliseconds(0));
  }

  // The same for the items `runs` give, in order (ItemRun): one transfer,
  // as if every run were expanded into items and submitted so. Its check
  // and resolve grow with the literal items and the runs, not with the
  // items the moved runs repeat: a moved run is checked as a whole (its
  // extent inside the regions it names, the peer region's access), and
  // the engine threads that run the transfer expand it as they copy
  // (for a transport with threads of its own, tcp and ucx, inside
  // submit(), as it is handed over).
  // Errors as submit()'s, naming the run; kInvalidArgument for no runs, a
  // run past the items, or a moved run that is not an earlier literal
  // run's range of one local and one peer region.
  virtual Result<TransferId> submit(PeerId peer, TransferOp op, std::span<const TransferItem> items,
                                    std::span<const ItemRun> runs, SubmitOptions options) = 0;
  // Checks `moves` for moved runs of transfers of `op` with `peer` once
  // (each region known, the peer's allowing `op`) and keeps them as a
  // table: a moved run that names it (ItemRun::moves) is then one moved run
  // per move, checked at submit by comparing its literal run's extent with
  // the room every move of the table leaves (found here), and its moves'
  // local regions are held by the table, not looked up. Errors as
  // submit()'s, naming the move; kInvalidArgument for no moves. The local
  // regions are held in use until release_prepared(); the table follows
  // the peer's registrations as a prepared list does (a submit that finds
  // a peer region it names moved or gone fails with kUnavailable, "prepare
  // again").
  virtual Result<PreparedId> prepare_moves(PeerId peer, TransferOp op, std::span<const RunMove> moves) = 0;

  // Checks and resolves `items` for transfers of `op` with `peer` once, as
  // submit() would (the same errors, naming the item), and keeps them: the
  // local regions they name are held in use until release_prepared(), so
  // they cannot be deregistered under the list. The list follows the peer's
  // registrations: when the peer's metadata changes (connect() again), a
  // submit that finds a region it names moved or gone fails with
  // kUnavailable ("prepare again") and posts nothing.
  virtual Result<PreparedId> prepare(PeerId peer, TransferOp op, std::span<const TransferItem> items) = 0;
  // Submits the items of `list` at the indices in `selection` (in that
  // order; adjacent ones merge into one copy), checking nothing but the
  // indices: kOutOfRange for an index past the list, kInvalidArgument for an
  // empty selection, kNotFound for an unknown list, kUnavailable for a list
  // whose peer is gone or changed. Then as submit().
  virtual Result<TransferId> submit(PreparedId list, std::span<const uint32_t> selection, SubmitOptions options) = 0;
  // Submits the items of `list` as `runs` give them (ItemRun, over the
  // list's items): a literal run copies its items as prepared; a moved run
  // copies items [first, first + count) of the list moved (to region `local`
  // at their offsets plus `local_shift`, and so on, or by each move of a
  // prepared table), with no literal run of them in the batch: the list is
  // their literal. So the first layer's items of a layer-major cache,
  // prepared once, give each later layer as one moved run per region, and
  // such a submit checks its runs only: a moved range must name one local
  // and one peer region (its extent found once per range and kept with the
  // list) and fit where it is moved. Errors as submit() with runs, and as
  // submit() with a selection for the list (kUnavailable: prepare again).
  virtual Result<TransferId> submit_runs(PreparedId list, std::span<const ItemRun> runs, SubmitOptions options) = 0;
  // Forgets a list or a table of moves and drops its holds on local
  // regions. kNotFound if unknown.
  virtual Status release_prepared(PreparedId list) = 0;

  // A batch of submits: between begin_batch() and end_batch() on one
  // thread, the transfers that thread submits are queued as they are
  // submitted, and the engine's sleeping threads are woken for the first,
  // then once per 16 chunks queued, and at end_batch() for the rest, not
  // once per transfer (a load's chunks, each its own transfer, cost a few
  // wake-ups, and its first copies start at once; a thread already awake
  // takes the others meanwhile). Batches nest; each begin_batch() needs its
  // end_batch() on the same thread (SubmitBatch does both).
  virtual void begin_batch() = 0;
  virtual void end_batch() = 0;

  // The state of a transfer; kNotFound in `error` for an unknown id.
  virtual TransferStatus status(TransferId id) const = 0;
  // Waits until the transfer ends or `timeout` passes (then kInProgress).
  virtual TransferStatus wait(TransferId id, std::chrono::milliseconds timeout) = 0;
  // Cancels; when it returns no further byte of the transfer lands locally.
  // OK also when the transfer had already ended (its state is kept).
  virtual Status cancel(TransferId id) = 0;
  // Forgets an ended transfer. kUnavailable while in progress.
  virtual Status release(TransferId id) = 0;

  // Sends a notification on its own, after every earlier transfer to the
  // peer, and waits for the peer's acknowledgement (up to default_timeout).
  virtual Status notify(PeerId peer, std::string message) = 0;
  // Sends a notification at once (not after earlier transfers) without
  // waiting: `done` runs exactly once, on an engine thread or on this one,
  // with OK when the peer acknowledged it or the error (kTimeout past
  // `timeout`, kIoError when the peer is gone, kNotFound for an unknown
  // peer). `done` must not block. A stopped or slow peer delays only its own
  // notifications.
  virtual void notify(PeerId peer, std::string message, std::chrono::milliseconds timeout,
                      std::function<void(Status)> done) = 0;
  // The same, and `answered` gets the peer's answer too: what its
  // answerer (set_notification_answerer) said of the message when it
  // arrived, at most kMaxNotificationAnswerBytes (empty when the peer has
  // none, and with every error).
  virtual void ask(PeerId peer, std::string message, std::chrono::milliseconds timeout,
                   std::function<void(Status, std::string)> answered) = 0;
  // Notifications received since the last call, in arrival order per peer.
  virtual std::vector<Notification> take_notifications() = 0;
  // `answer` runs for each notification as it arrives, before it is queued
  // for take_notifications(), on the engine thread that received it; what
  // it returns (cut to kMaxNotificationAnswerBytes) travels back to the
  // sender in the acknowledgement (ask()). It must not block or call back
  // into the engine. One answerer: a later call replaces it, an empty
  // function removes it (answers are then empty); when this returns, the
  // previous one is no longer running and will not run again.
  virtual void set_notification_answerer(std::function<std::string(const Notification&)> answer) = 0;
  // `wake` runs after each notification is queued (on the engine thread
  // that received it, no engine lock held), so a thread that sleeps on
  // other things too can be woken to take_notifications(); it must not
  // block or call back into the engine. One listener: a later call replaces
  // it, an empty function removes it; when this returns, the previous one
  // is no longer running and will not run again.
  virtual void set_notification_listener(std::function<void()> wake) = 0;

  virtual EngineMetrics metrics() const = 0;
  // Prometheus text exposition of metrics(), names prefixed "kvbridge_".
  virtual std::string metrics_prometheus() const = 0;
};

// Engine::begin_batch() for the life of the object.
class SubmitBatch {
 public:
  explicit SubmitBatch(Engine& engine) : engine_(engine) { engine_.begin_batch(); }
  ~SubmitBatch() { engine_.end_batch(); }
  SubmitBatch(const SubmitBatch&) = delete;
  SubmitBatch& operator=(const SubmitBatch&) = delete;

 private:
  Engine& engine_;
};

inline constexpr size_t kMaxEngineMetadataBytes = size_t{1} << 20;
inline constexpr size_t kMaxNotificationAnswerBytes = 256;

// The engine that metadata() bytes describe: its name and instance, as its
// notifications (Notification::peer, peer_instance) and its peers' grants
// name it. The rest of the metadata is the engine's own. The bytes are
// checked as connect() checks them: kInvalidArgument when malformed (the
// message names the field), kIncompatible for another version,
// kResourceExhausted past kMaxEngineMetadataBytes.
struct EngineLabel {
  std::string name;
  uint64_t instance = 0;
};
Result<EngineLabel> describe_metadata(std::string_view metadata);

}  // namespace kvbridge
