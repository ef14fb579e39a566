// kvbridge/store.h: the prefix store: hash-addressed KV blocks that any TP
// size and any block size can read.
//
// Engines keep prompt prefixes' KV in a store so that a later request with the
// same prefix skips prefill. An object of the store is one hash block of one
// storable group (store_key.h), held in a TP-independent canonical order
// (layer, component, position, global head, cell): docs/formats/store-object.md.
// A rank writes and reads only its own head slice, through plans of the planner
// between its layout and the canonical layout, so an instance at TP 2 with
// 16-token blocks reads what one at TP 8 with 32-token blocks wrote.
//
// Two classes:
//  - Store: the shared part, one per process: the memory tier (host memory,
//    capacity in bytes, LRU, objects pinned by readers never evicted), the
//    optional disk tier (files under a directory, LRU, kept across restarts),
//    the optional shared tier on Redis (write-through, reads from the nearest
//    tier, promotion on hit), and the assembly of objects that several ranks
//    write (an object becomes visible once every rank of the writing instance
//    has written its part: in this process, or in Redis when the ranks are
//    separate processes, StoreOptions::assembly).
//  - RankStore: one rank's view (its layout), which puts, looks up and gets
//    requests. docs/store.md has the rules: which groups and blocks are stored,
//    and the lookup rule (a hit needs every group that resuming there needs).
//
// A Redis that is down or slow degrades to a miss (or a write that is only in
// memory) with a counted error, within the configured timeouts: never a hang.
//
// Thread-safety: Store is thread-safe. A RankStore may be used by one thread at
// a time; RankStores of one Store may run concurrently (one per rank thread).
// Ownership: RankStore holds its Store (shared_ptr). Tensor memory passed to
// put/get is the caller's and is only accessed during the call. A rank's
// tensors may be device memory (RankStoreOptions::memory): its copies then
// move through pinned host memory, into and out of every tier.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "kvbridge/content.h"
#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/readiness.h"
#include "kvbridge/status.h"
#include "kvbridge/store_key.h"

namespace kvbridge {

struct RedisOptions {
  std::string host = "127.0.0.1";
  uint16_t port = 6379;
  // Bounds on one attempt: the TCP connect, and each socket read or write.
  std::chrono::milliseconds connect_timeout{300};
  std::chrono::milliseconds command_timeout{2000};
  // After a failure the tier is "down" for this long: operations are skipped
  // (counted) instead of paying a timeout each, then one reconnect is tried.
  std::chrono::milliseconds retry_interval{1000};
  std::string key_prefix = "kvb1:";
  // Value-sized commands in flight (GETs, SETs, part transactions).
  uint32_t pipeline_depth = 16;
  // Lifetime of an object still being assembled from parts in Redis
  // (Assembly::kShared), refreshed by every part: a writer that dies half way
  // leaves a staging key that expires, never an object.
  std::chrono::milliseconds incomplete_ttl{60000};
  // host:port is one node of a Redis Cluster (a seed): the slot map comes
  // from CLUSTER SLOTS, each key goes to the master of its slot, MOVED and
  // ASK redirects are followed and a failover is found by reading the map
  // again (docs/store.md, "Redis Cluster"). Keys carry a hash tag
  // (ObjectKey::cluster_text), so a cluster's keys differ from a single
  // server's.
  bool cluster = false;
};

// The local disk tier (docs/store.md, "The disk tier"): whole objects in
// files under `directory`, between the memory tier and Redis. Objects are
// written when they become visible here and when they are read from Redis;
// a get reads what memory lacks from disk before Redis, promoting it into
// memory. One Store per directory (it is locked while open). Files survive
// the process: a Store opened on the directory later serves them.
struct DiskOptions {
  std::string directory;
  // Bound on the files' bytes (headers included); least recently used files
  // are deleted past it.
  uint64_t capacity_bytes = uint64_t{8} << 30;
  // Size of each read (a pread at an offset aligned to it).
  uint64_t io_bytes = uint64_t{1} << 20;
  // fdatasync each file before it is renamed into place (an object survives
  // a power loss). Without it, a file torn by a power loss fails its checksum
  // when read and counts as a miss.
  bool sync = false;
};

// Where the parts of an object meet when the writing instance has TP > 1
// (each rank writes its head slice of every object).
enum class Assembly {
  // Every rank of a writing instance puts through this Store (one process):
  // parts meet in memory and the whole object goes to Redis in one SET.
  kInProcess,
  // Ranks may run in separate processes (one per rank, the usual
  // deployment): each rank writes its part into Redis, where the object
  // appears once every part is there (docs/formats/store-object.md). The
  // memory tier holds only whole objects, so a rank's part is not kept here;
  // gets bring the whole object from Redis. Needs `redis`; without it parts
  // meet in memory as with kInProcess. TP sizes up to 64.
  kShared,
};

struct StoreOptions {
  // Tokens per hash block (per object). Must divide the block size of every
  // stored group of every layout that uses the store, be a multiple of each
  // stored group's tokens_per_state, and not exceed a sliding window.
  uint64_t hash_block_tokens = 16;
  // Extra parts of the key (adapter name, cache salt): instances share objects
  // only when these are equal.
  std::vector<std::string> extra_keys;
  // Capacity of the memory tier, objects, staging and pooled buffers together.
  uint64_t memory_bytes = uint64_t{1} << 30;
  // The disk tier; absent: none.
  std::optional<DiskOptions> disk;
  // The shared tier; absent: memory only.
  std::optional<RedisOptions> redis;
  Assembly assembly = Assembly::kInProcess;
};

struct StoreStats {
  // Memory tier.
  uint64_t memory_objects = 0;  // visible objects held
  uint64_t memory_bytes = 0;    // their bytes (headers included)
  uint64_t capacity_bytes = 0;
  uint64_t pooled_bytes = 0;     // free buffers kept for reuse (count toward capacity)
  uint64_t staging_objects = 0;  // objects waiting for parts
  uint64_t pinned_objects = 0;   // objects under a reader's lease now
  uint64_t evictions = 0;        // objects evicted (LRU)
  uint64_t rejected = 0;         // objects that did not fit (everything pinned)
  uint64_t published = 0;        // objects that became visible here
  // Reads, in objects.
  uint64_t memory_hits = 0;
  uint64_t disk_hits = 0;   // read from the disk tier (and promoted)
  uint64_t redis_hits = 0;  // read from Redis (and promoted)
  uint64_t misses = 0;      // needed by a lookup, in no tier
  // Disk tier.
  bool disk_configured = false;
  uint64_t disk_objects = 0;
  uint64_t disk_bytes = 0;  // their files' bytes
  uint64_t disk_capacity_bytes = 0;
  uint64_t disk_writes = 0;       // objects written
  uint64_t disk_evictions = 0;    // files deleted to make room
  uint64_t disk_errors = 0;       // failed reads or writes (I/O errors, a full disk)
  uint64_t disk_bad_objects = 0;  // files dropped: wrong size, or failed the format or checksum check
  // Shared tier.
  bool redis_configured = false;
  bool redis_up = false;
  uint64_t redis_writes = 0;            // objects written (whole, or completed by a part)
  uint64_t redis_parts = 0;             // parts written (Assembly::kShared)
  uint64_t redis_errors = 0;            // failed operations (connect, timeout, error reply)
  uint64_t redis_skipped = 0;           // operations skipped while Redis was down
  uint64_t redis_bad_objects = 0;       // objects that failed the format or checksum check
  uint64_t redis_redirects = 0;         // MOVED/ASK replies followed (cluster)
  uint64_t redis_slot_map_updates = 0;  // slot maps read (cluster)
  uint32_t redis_nodes = 0;             // masters serving slots (cluster)
  std::string redis_last_error;         // "host:port: operation: cause" of the latest error; empty if none
};

class Store {
 public:
  // kInvalidArgument for hash_block_tokens == 0 or memory_bytes == 0. Opens
  // the disk tier when one is configured (its errors: an empty directory or
  // zero capacity, kInvalidArgument; the directory held by another Store,
  // kUnavailable; a directory that cannot be created or read, kIoError; one
  // that is a symbolic link, of another user, or writable by other users, or
  // a LOCK that is a link, kPermissionDenied). Asks a shared tier once
  // (PING), so stats() says from the start when it cannot be reached.
  static Result<std::shared_ptr<Store>> create(StoreOptions options);
  ~Store();
  Store(const Store&) = delete;
  Store& operator=(const Store&) = delete;

  const StoreOptions& options() const;
  StoreStats stats() const;
  // Drops every unpinned visible object of the memory tier (not Redis), and
  // frees the pooled buffers unless `keep_buffers` (then the objects' buffers
  // join the pool for reuse). For tools and tests.
  void clear_memory(bool keep_buffers = false);

  struct RedisInfo {
    uint64_t keys = 0;               // DBSIZE: every key of the database
    uint64_t used_memory_bytes = 0;  // INFO memory: used_memory
  };
  // Asks the shared tier. kNotFound when none is configured; kUnavailable or
  // kIoError (counted in stats) when it cannot be reached.
  Result<RedisInfo> redis_info();

  struct Impl;

 private:
  explicit Store(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
  friend class RankStore;
};

struct PutResult {
  uint64_t parts_written = 0;      // objects whose part this rank wrote
  uint64_t objects_present = 0;    // skipped: already visible (memory, or Redis with kShared)
  uint64_t objects_published = 0;  // became visible with this call (here, or in Redis with kShared)
  uint64_t objects_rejected = 0;   // did not fit the memory tier
  uint64_t bytes_copied = 0;       // bytes copied out of the rank's memory
};

struct LookupResult {
  uint64_t hit_tokens = 0;      // the longest prefix every needed group can resume from
  uint64_t memory_objects = 0;  // objects that resuming there reads from memory
  uint64_t disk_objects = 0;    // ... from the disk tier
  uint64_t redis_objects = 0;   // ... and from Redis
};

struct GetResult {
  uint64_t hit_tokens = 0;    // tokens the rank's memory now holds from the store
  uint64_t bytes_copied = 0;  // bytes written into the rank's memory
  uint64_t memory_objects = 0;
  uint64_t disk_objects = 0;
  uint64_t redis_objects = 0;
};

// Where a rank's tensors are, and how RankStore::put and get reach them.
struct RankStoreOptions {
  // "host", or "cuda:N": device memory of device N. Device memory moves
  // through a pool of pinned host memory (allocated and pinned at the first
  // put or get that copies), `staging_chunk_bytes` at a time: one batched
  // device copy per chunk, the host's copy of one chunk between the pool
  // and the objects overlapping the device's copy of the next.
  std::string memory = "host";
  uint64_t staging_bytes = uint64_t{8} << 20;  // at least three chunks
  uint64_t staging_chunk_bytes = uint64_t{2} << 20;
  // How the device copies a chunk: "copy_engine", "kernel" or "auto"
  // (EngineOptions::device_copy).
  std::string device_copy = "copy_engine";
  // Device memory: a put or get whose ready event has not completed within
  // this fails (kTimeout) having copied nothing.
  std::chrono::milliseconds timeout{30000};
};

class RankStore {
 public:
  // Binds a rank's layout to the store. kInvalidArgument when the layout is
  // invalid, is a rank of a pipeline stage (pp_size above 1: not supported
  // by the store), or the store's hash block does not fit a stored group
  // (naming the group and the rule), or `options` names an unknown memory kind or
  // bad staging sizes; kUnavailable for cuda:N without that device.
  static Result<RankStore> create(std::shared_ptr<Store> store, const Layout& layout,
                                  const RankStoreOptions& options = RankStoreOptions());
  RankStore(RankStore&&) noexcept;
  RankStore& operator=(RankStore&&) noexcept;
  ~RankStore();

  const Layout& layout() const;
  // Hits are multiples of this: the lcm of the stored groups' block sizes.
  uint64_t resume_align_tokens() const;
  // The chained hashes of the full hash blocks of `tokens`.
  std::vector<BlockHash> hashes(std::span<const uint32_t> tokens) const;

  // Stores the full hash blocks of tokens [0, request.num_tokens) that the
  // rank's memory holds: request.blocks[group].local are the rank's block ids
  // (-1 where none). Per group kind (docs/store.md): attention, the blocks at
  // or after request.skip_tokens; sliding_window, the blocks inside the window
  // ending at the last full hash block; state, the states at hash-block
  // boundaries that the list keeps; scratch and non-prefix-cacheable groups,
  // nothing. Objects already visible are skipped. `memory` is one span per
  // layout tensor. Errors: kInvalidArgument (num_tokens > tokens.size(), a
  // missing group, a list too short, memory not matching the layout). Redis
  // failures are not errors (counted in stats).
  //
  // Device memory (RankStoreOptions::memory): `memory` is device memory of
  // that device (else kInvalidArgument naming the tensor and the byte), and
  // `ready` is the producer's word that the kernels writing the blocks are
  // done (an event recorded after them: of this process, or an IPC handle);
  // the copies out of the device wait for it on the host first. Host
  // memory takes no event (kInvalidArgument).
  Result<PutResult> put(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                        const Readiness& ready = Readiness());

  // The longest prefix of tokens[0, min(tokens.size(), limit_tokens)) that can
  // be resumed from the store: a multiple of resume_align_tokens() for which
  // every needed object is present (attention blocks before it, the window
  // before it, the state at it). Queries Redis for what memory lacks.
  Result<LookupResult> lookup(std::span<const uint32_t> tokens, uint64_t limit_tokens = UINT64_MAX);

  // Looks up request.num_tokens tokens and writes the hit into the rank's
  // memory: attention positions [request.skip_tokens, hit), the window before
  // the hit, the state at the hit into the list entry that holds it (entry
  // ceil(hit / block_tokens) - 1). Objects are pinned while they are read;
  // objects read from Redis are promoted into memory and copied into the
  // rank as they arrive. A hit of 0 writes nothing, with one exception: when
  // an object fails in the middle of the get (Redis dies, a corrupt object),
  // the hit drops below what the lookup promised, and blocks of the request
  // past the returned hit (at or after skip_tokens: the request's own, which
  // prefill computes) may already hold bytes of later objects. Errors as for
  // put(). Device memory: `ready` is the work still reading the blocks
  // (their previous owner's kernels), waited for before the first copy
  // into them; get() returns once every byte is in device memory, so
  // kernels queued after it on any stream read it.
  Result<GetResult> get(std::span<const uint32_t> tokens, const Request& request, TensorMemory memory,
                        const Readiness& ready = Readiness());

  struct Impl;

 private:
  explicit RankStore(std::unique_ptr<Impl> impl);
  std::unique_ptr<Impl> impl_;
};

}  // namespace kvbridge
