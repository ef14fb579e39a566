// connector/load.h: one decode rank's load of one request: its stages (the
// plan cut by plan_stages()), the engine transfers that read them, what the
// prefill ranks announced (streaming), and how its result is settled once
// nothing of it is in flight. Data only; the worker (worker.cc) drives it
// under its lock.
#pragma once

#include <chrono>
#include <cstdint>
#include <memory>
#include <set>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "connector/remotes.h"
#include "kvbridge/connector.h"
#include "kvbridge/plan.h"

namespace kvbridge::connector {

using Clock = std::chrono::steady_clock;

// One read of a load: a stage's bytes from one source rank (a streamed
// load's stages of one layer that became ready together: their bytes).
struct LoadTransfer {
  uint32_t source = 0;           // tp_rank
  std::vector<uint32_t> stages;  // indices into Load::stages
  TransferId id = 0;
  uint32_t refusals = 0;  // times the source refused it as not granted (it was submitted again)
};

// A read the source refused as not granted, to submit again at `at`: the
// source grants a reader its blocks when it hears the reader (its first
// heartbeat) and the hand-off came, and the read may overtake either.
struct Refused {
  size_t transfer = 0;  // index into Load::transfers
  std::chrono::steady_clock::time_point at;
};

struct LoadStage {
  uint64_t first_token = 0, end_token = 0, resume_token = 0;  // PlanStage's
  uint32_t first_layer = 0, end_layer = 0;
  std::vector<std::vector<TransferItem>> items;  // per source; emptied once landed (push: once written)
  // Per source: the runs its reads are submitted as (Engine::submit with
  // runs: the later layers repeat the first at other regions; push: what
  // the source writes), or none, when `items` is the whole list.
  std::vector<std::vector<ItemRun>> runs;
  // Per source: its table runs (the plan's, DescriptorRun::table), each an
  // entry of `runs` that is moved and names no regions; its read names a
  // prepared table of the table's moves, or takes its moved runs one by one
  // (WorkerImpl::stage_runs()).
  struct TableRun {
    size_t run = 0;  // in runs[s]
    std::shared_ptr<const std::vector<TensorShift>> table;
  };
  std::vector<std::vector<TableRun>> tables;
  // A stage moved from an earlier one (CompactStage::moved_from): that
  // stage's index. Each source's read is then `runs` over that stage's
  // items as prepared (Load::lists), all moved, and `items` stay empty.
  static constexpr uint32_t kNotMoved = UINT32_MAX;
  uint32_t from = kNotMoved;
  // Per source, for a stage others are moved from: where its items begin
  // in the load's prepared list of that source (Load::lists), which its
  // own read and the moved stages' reads take as runs; kNoList where none.
  static constexpr uint64_t kNoList = UINT64_MAX;
  std::vector<uint64_t> list_at;
  std::vector<uint8_t> device;  // per source: its items touch device memory (on either side)
  std::vector<uint64_t> where;  // push, per source: write_places() of what it writes
  uint32_t pending = 0;         // transfers submitted and not ended
  bool submitted = false, failed = false, landed = false;
  Clock::time_point submitted_at{}, landed_at{};  // pull: its reads submitted; the last of them ended
  // Whether it reads from source `s` (pull): its own items, or moved runs.
  bool reads(size_t s) const {
    return s < items.size() && (!items[s].empty() || (from != kNotMoved && !runs[s].empty()));
  }
};

// A literal run of a stage's compact plan (by its first descriptor) as each
// source's items of it: what a stage moved from it names.
struct LiteralItems {
  uint64_t first = 0, count = 0;  // its descriptors
  std::vector<ItemRun> sources;   // per source: its items' range
};

struct Load {
  RequestId request;
  std::string instance;  // the remote instance's name
  std::string remote;    // its key in Remotes (Remotes::route())
  std::shared_ptr<const Fetched> fetched;
  bool stream = false;
  bool push = false;                    // push mode: the sources write; a stage lands when each said "wrote"
  std::vector<LoadStage> stages;        // chunk by chunk, layer by layer
  std::vector<LoadTransfer> transfers;  // in submission order
  std::vector<Refused> refused;         // pull: reads to submit again (still counted pending)
  std::vector<bool> used;               // per source rank: read from
  std::vector<PeerId> peers;            // the source ranks read from
  // Every source rank this load would read from (source_ranks()), read or
  // not (a request that moves nothing): each hears its heartbeats and done.
  std::vector<PeerId> told;
  // Push: per source written from, the grant that lets it write exactly the
  // places this load's plan names (Engine::grant_writes), revoked when the
  // load ends, so a late or misdirected write is refused where the
  // transport serves writes itself.
  std::vector<GrantId> grants;
  std::vector<std::vector<uint8_t>> announced;   // streaming: per source, per layer ordinal
  std::vector<std::vector<std::string>> events;  // streaming: per source, per layer: the producer's event handle
  // Streaming: per layer ordinal, the stages holding it; and the stages an
  // announcement since the last look may have made ready (all of them
  // until the first look), so that a look grows with those, not the load.
  std::vector<std::vector<uint32_t>> stages_of_layer;
  std::vector<uint32_t> to_look_at;
  bool looked = false;
  Readiness ready;  // the consumer's pending work (LoadOptions::ready)
  // Per source: the items of every stage others are moved from, one after
  // another, prepared with the engine once for the load (Engine::prepare;
  // 0: none), and released when it is over.
  std::vector<PreparedId> lists;
  // Pull: once every stage landed, each source read is asked whether the
  // blocks were still held ("done", answered "held" or "released"); the
  // load is ok only when all said held.
  bool confirming = false;
  std::set<std::pair<std::string, uint64_t>> unconfirmed;  // the sources' engines still to answer
  Status confirm_error;
  std::vector<uint32_t> layer_left;  // per layer ordinal: its stages not landed yet
  size_t pending = 0;                // transfers not ended yet
  size_t unsubmitted = 0;            // stages not submitted yet
  Status start_error;                // a stage's submit() failed: no more stages start
  LoadResult result;
  Clock::time_point started, deadline;
  Clock::time_point last_byte{};           // the latest transfer end so far
  Clock::time_point called{};              // start_load()
  Clock::time_point last_submit{};         // pull: its latest read submitted
  std::chrono::nanoseconds submit_cpu{0};  // pull: the worker threads' CPU time planning and submitting it
  bool aborted = false, expired = false;
};

// What a load's plans name, as the engine names it: per local tensor its
// region and whether it is device memory; per source rank, per tensor, the
// same.
struct LoadTensors {
  std::span<const RegionId> local_regions;
  std::span<const RankInfo> sources;
  std::vector<uint8_t> local_device;
  std::vector<std::vector<uint8_t>> remote_device;
  LoadTensors(std::span<const RegionId> regions, const Layout& local, std::span<const RankInfo> infos,
              std::span<const Layout> remotes);
};

// The tokens per chunk a load is cut into (StageOptions::chunk_tokens), the
// same on a decode rank and the prefill ranks that push to it: a streamed
// load is cut by layers only (0: one chunk), a layer's chunks being ready
// together; otherwise WorkerOptions::load_chunk_tokens.
inline uint64_t chunk_tokens_of(bool stream, uint64_t load_chunk_tokens) { return stream ? 0 : load_chunk_tokens; }

// A stage of `load` from its compact plan: per source its items and the
// runs that repeat them (a moved run of the plan is a moved run of each
// source's items, checked and expanded by the engine; a pull reads them
// so, a push source writes them so). Marks the sources it reads in
// `load.used`. With `only_source`, the other sources' items and runs stay
// empty (a push source builds its own part alone).
// With `literal`, also each literal run's items per source. The plan was
// planned against `tensors.sources`: each descriptor's source is one of them.
LoadStage load_stage(Load& load, const CompactStage& stage, const LoadTensors& tensors, size_t only_source = SIZE_MAX,
                     std::vector<LiteralItems>* literal = nullptr);
// A stage moved from an earlier stage (CompactStage::moved_from) whose
// literal runs' items are `from`: per source, one moved run of those items
// per run of its plan. kInternal for a run that names no literal run of
// that stage (the plan's invariant broken).
Result<LoadStage> moved_load_stage(Load& load, const CompactStage& stage, const LoadTensors& tensors,
                                   std::span<const LiteralItems> from);

// A table run's moves, regions mapped from the plan's tensors: `regions`
// (the local tensors' registrations) and the source's.
void table_moves(std::span<const RegionId> regions, const RankInfo& source, const std::vector<TensorShift>& table,
                 std::vector<RunMove>* out);
// Source `s`'s runs of `st` with each table run as one moved run per move
// of its table (what a submit without a prepared table takes).
std::vector<ItemRun> expanded_runs(const LoadStage& st, size_t s, std::span<const RegionId> regions,
                                   const RankInfo& source);

// Appends the local places of `items` as `runs` give them (what a push
// source writes into this rank) in the form a grant takes
// (Engine::grant_writes): a literal run's places, and a moved run as a
// repeat of the places of the literal run it repeats, so that the grant
// grows with the first layer's items, not with the layers.
void grant_places(std::span<const TransferItem> items, std::span<const ItemRun> runs, std::vector<WriteGrant>* places,
                  std::vector<GrantRepeat>* repeats);

// Settles `load.result` once nothing of it is in flight: times, aborted,
// the error (the first stage in stage order that did not land: its
// transfer's error, or that it was never announced within `timeout`, or the
// submit error, or the abort, or that a source did not confirm its blocks
// were held), first_bad_token (where the earliest stage that did not land
// resumes; the first stage's for an abort or an unconfirmed read) and
// first_bad_layer. `statuses` are the final statuses of load.transfers, in
// order; `layers` is layer_order() of the local layout.
void settle(Load& load, std::span<const TransferStatus> statuses, const std::vector<std::string>& layers,
            std::chrono::milliseconds timeout, Clock::time_point now);

}  // namespace kvbridge::connector
