// A load's reads: the stages that are ready start (start_ready_stages),
// reads a source refused go again, and each stage's items from one source
// are submitted as runs whose later layers are moved runs, those moved runs
// through a table of moves the engine prepared once per (source, moves), so
// that a read's check and submit grow with its first layer's items only. A
// streamed load's stage moved from an earlier one reads that stage's items,
// prepared once per load and source, as moved runs: its check grows with
// its runs.
#include <algorithm>

#include "connector/worker_impl.h"

namespace kvbridge::connector {

namespace {

void put(std::string& key, uint64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); }

// The connection to source rank `source` of the load (one it reads from).
PeerId peer_of(const Load& load, uint32_t source) {
  const auto& sources = load.result.sources;
  return load.peers[std::find(sources.begin(), sources.end(), source) - sources.begin()];
}

}  // namespace

std::vector<ItemRun> WorkerImpl::stage_runs(const Load& load, const LoadStage& st, size_t s) const {
  return expanded_runs(st, s, regions_, load.fetched->infos[s]);
}

PreparedId WorkerImpl::table_of(PeerId peer, std::vector<RunMove> moves) {
  std::string key;
  key.reserve(8 + 32 * moves.size());
  put(key, peer);
  for (const RunMove& m : moves) {
    put(key, m.local);
    put(key, m.local_shift);
    put(key, m.remote);
    put(key, m.remote_shift);
  }
  auto t = move_tables_.find(key);
  if (t == move_tables_.end()) {
    Result<PreparedId> made = engine_.prepare_moves(peer, TransferOp::kRead, moves);
    // The runs go as they are; their submit names what is wrong.
    if (!made.ok()) return 0;
    if (move_tables_.size() >= kMoveTablesKept) release_tables();
    t = move_tables_.emplace(key, *made).first;
    ++stats_.move_tables;
  }
  last_table_[peer] = {std::move(moves), t->second, nullptr, nullptr};
  return t->second;
}

std::vector<ItemRun> WorkerImpl::with_tables(PeerId peer, const Load& load, const LoadStage& st, size_t s, bool* used) {
  const std::vector<ItemRun>& runs = st.runs[s];
  const std::vector<LoadStage::TableRun>& tables = st.tables[s];
  std::vector<ItemRun> out;
  out.reserve(runs.size());
  for (size_t i = 0, t = 0; i < runs.size();) {
    if (t < tables.size() && tables[t].run == i) {
      // A table run: the stages of a load share its table (one object),
      // so the table named last for this peer is usually it.
      const LoadStage::TableRun& tr = tables[t++];
      LastTable& last = last_table_[peer];
      PreparedId id = last.id;
      if (id == 0 || last.plan_table != tr.table || last.fetched != load.fetched) {
        std::vector<RunMove> moves;
        table_moves(regions_, load.fetched->infos[s], *tr.table, &moves);
        id = table_of(peer, std::move(moves));
        if (id != 0) {
          LastTable& named = last_table_[peer];
          named.plan_table = tr.table;
          named.fetched = load.fetched;
        }
      }
      if (id == 0) {
        std::vector<RunMove> moves;
        table_moves(regions_, load.fetched->infos[s], *tr.table, &moves);
        for (const RunMove& m : moves) {
          out.push_back({runs[i].first, runs[i].count, true, m.local, m.local_shift, m.remote, m.remote_shift});
        }
      } else {
        ItemRun r{runs[i].first, runs[i].count, true};
        r.moves = id;
        out.push_back(r);
        *used = true;
      }
      ++i;
      continue;
    }
    // Moved runs of one literal run, one after another: one table.
    size_t j = i;
    while (j < runs.size() && runs[j].moved && runs[j].moves == 0 && runs[j].first == runs[i].first &&
           runs[j].count == runs[i].count && (t == tables.size() || tables[t].run != j)) {
      ++j;
    }
    if (j - i < 2) {
      out.push_back(runs[i]);
      i = std::max(j, i + 1);
      continue;
    }
    // Reads of a load's stages take the same moves one after another.
    const LastTable& last = last_table_[peer];
    auto same = [&] {
      if (last.id == 0 || last.moves.size() != j - i) return false;
      for (size_t k = i; k < j; ++k) {
        const RunMove& m = last.moves[k - i];
        if (m.local != runs[k].local || m.local_shift != runs[k].local_shift || m.remote != runs[k].remote ||
            m.remote_shift != runs[k].remote_shift) {
          return false;
        }
      }
      return true;
    };
    PreparedId id = last.id;
    if (!same()) {
      std::vector<RunMove> moves;
      moves.reserve(j - i);
      for (size_t k = i; k < j; ++k) {
        moves.push_back({runs[k].local, runs[k].local_shift, runs[k].remote, runs[k].remote_shift});
      }
      id = table_of(peer, std::move(moves));
    }
    if (id == 0) {
      out.insert(out.end(), runs.begin() + static_cast<ptrdiff_t>(i), runs.begin() + static_cast<ptrdiff_t>(j));
    } else {
      ItemRun r{runs[i].first, runs[i].count, true};
      r.moves = id;
      out.push_back(r);
      *used = true;
    }
    i = j;
  }
  return out;
}

void WorkerImpl::release_tables() {
  for (const auto& [key, id] : move_tables_) (void)engine_.release_prepared(id);
  move_tables_.clear();
  last_table_.clear();
}

// The options of a load's reads: their ends land in the pump's inbox.
SubmitOptions WorkerImpl::read_options() const {
  SubmitOptions o;
  o.timeout = options_.transfer_timeout;
  o.verify_content = options_.verify_content;
  o.on_end = [wake = wake_](TransferId id, const TransferStatus& ts) {
    {
      std::lock_guard<std::mutex> wl(wake->mu);
      wake->ended.push_back({id, ts.ended_at, ts.state == TransferState::kDone,
                             ts.state == TransferState::kFailed && ts.error.code() == Code::kPermissionDenied});
    }
    wake->cv.notify_one();
  };
  return o;
}

// Requires mu_: submits again the reads whose time came that a source
// refused as not granted; those of a load that is over (aborted, past its
// deadline) end as refused.
void WorkerImpl::submit_refused(Load& load, Clock::time_point now) {
  for (auto r = load.refused.begin(); r != load.refused.end();) {
    const bool over = load.aborted || load.expired || now >= load.deadline;
    if (!over && now < r->at) {
      ++r;
      continue;
    }
    LoadTransfer& t = load.transfers[r->transfer];
    const size_t index = r->transfer;
    r = load.refused.erase(r);
    Status failed;
    if (!over) {
      Result<TransferId> id = submit_read(load, t.stages, t.source, peer_of(load, t.source), read_options());
      if (id.ok()) {
        (void)engine_.release(t.id);
        t.id = *id;
        by_transfer_[*id] = {load.request, index};
        continue;
      }
      failed = id.error().with_context("request " + q(load.request) + ": reading from " + load.instance + " rank " +
                                       std::to_string(t.source) + " again");
    }
    // The refused transfer's status stays the read's outcome.
    if (!failed.ok() && load.start_error.ok()) load.start_error = failed;
    for (uint32_t k : t.stages) {
      load.stages[k].failed = true;
      --load.stages[k].pending;
    }
    --load.pending;
  }
}

// Requires mu_: submits every stage not submitted whose layers every
// source it reads from announced (all of them, when not streaming). A
// streamed load's stages read as runs of its prepared lists that became
// ready together and hold the same layers go as one read per source. The
// first submit error stops the load from starting more.
Status WorkerImpl::start_ready_stages(Load& load) {
  if (load.aborted || load.expired || !load.start_error.ok()) return load.start_error;
  if (load.push) return Status();  // the sources write
  // The reads started here are one batch of submits: a few wake-ups of
  // the engine's threads, not one per read.
  const SubmitBatch batch(engine_);
  // Streaming, after the first look: only the stages of the layers
  // announced since, in stage order.
  std::vector<uint32_t> look;
  const bool all = !load.stream || !load.looked;
  if (!all) {
    look.swap(load.to_look_at);
    std::sort(look.begin(), look.end());
    look.erase(std::unique(look.begin(), look.end()), look.end());
  }
  load.looked = true;
  load.to_look_at.clear();
  // Starts the reads of `stages` (of one layer range, or one stage) from
  // each source they read.
  auto start = [&](std::span<const uint32_t> stages) -> Status {
    const SubmitOptions o = read_options();
    std::vector<uint32_t> from;
    for (size_t s = 0; s < load.stages[stages.front()].items.size(); ++s) {
      from.clear();
      for (uint32_t k : stages) {
        if (load.stages[k].reads(s)) from.push_back(k);
      }
      if (from.empty()) continue;
      Result<TransferId> id = submit_read(load, from, s, peer_of(load, static_cast<uint32_t>(s)), o);
      if (!id.ok()) {
        for (uint32_t k : from) load.stages[k].failed = true;
        load.start_error = id.error().with_context("request " + q(load.request) + ": reading from " + load.instance +
                                                   " rank " + std::to_string(s));
        return load.start_error;
      }
      load.last_submit = Clock::now();
      by_transfer_[*id] = {load.request, load.transfers.size()};
      load.transfers.push_back({static_cast<uint32_t>(s), from, *id});
      for (uint32_t k : from) ++load.stages[k].pending;
      ++load.pending;
    }
    for (uint32_t k : stages) {
      LoadStage& st = load.stages[k];
      if (st.pending == 0) {
        st.landed_at = st.submitted_at;
        land(load, st);
      }
    }
    return Status();
  };
  // The ready stages read as runs of the lists, by layer range.
  std::vector<std::pair<std::pair<uint32_t, uint32_t>, std::vector<uint32_t>>> groups;
  const size_t n = all ? load.stages.size() : look.size();
  for (size_t i = 0; i < n; ++i) {
    const uint32_t k = all ? static_cast<uint32_t>(i) : look[i];
    LoadStage& st = load.stages[k];
    if (st.submitted) continue;
    bool ready = true, listed = load.stream;
    for (size_t s = 0; ready && s < st.items.size(); ++s) {
      if (!st.reads(s)) continue;
      listed = listed && on_list(load, st, s);
      for (uint32_t l = st.first_layer; ready && load.stream && l < st.end_layer; ++l) {
        ready = load.announced[s][l] != 0;
      }
    }
    if (!ready) continue;
    st.submitted = true;
    st.submitted_at = Clock::now();
    --load.unsubmitted;
    if (listed) {
      const std::pair<uint32_t, uint32_t> layers{st.first_layer, st.end_layer};
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == layers; });
      if (g == groups.end()) g = groups.insert(groups.end(), {layers, {}});
      g->second.push_back(k);
      continue;
    }
    KVB_RETURN_IF_ERROR(start({&k, 1}));
  }
  for (const auto& [layers, stages] : groups) KVB_RETURN_IF_ERROR(start(stages));
  return Status();
}

Status WorkerImpl::prepare_lists(Load& load) {
  const size_t sources = load.fetched->infos.size();
  load.lists.assign(sources, 0);
  std::vector<TransferItem> items;
  for (size_t s = 0; s < sources; ++s) {
    items.clear();
    for (LoadStage& st : load.stages) {
      if (st.list_at.empty() || st.items[s].empty() || !st.tables[s].empty()) continue;
      st.list_at[s] = items.size();
      items.insert(items.end(), st.items[s].begin(), st.items[s].end());
    }
    if (items.empty()) continue;
    const auto& read = load.result.sources;
    const size_t at = static_cast<size_t>(std::find(read.begin(), read.end(), s) - read.begin());
    Result<PreparedId> list = at < load.peers.size()
                                  ? engine_.prepare(load.peers[at], TransferOp::kRead, items)
                                  : Result<PreparedId>(Status::internal("no connection to a source read from"));
    if (!list.ok()) {
      release_holds(load);
      return list.error().with_context("request " + q(load.request) + ": preparing the reads from " + load.instance +
                                       " rank " + std::to_string(s));
    }
    load.lists[s] = *list;
    lists_held_.fetch_add(1, std::memory_order_relaxed);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.prepared_lists;
  }
  return Status();
}

bool WorkerImpl::on_list(const Load& load, const LoadStage& st, size_t s) {
  if (s >= load.lists.size() || load.lists[s] == 0) return false;
  const LoadStage& of = st.from != LoadStage::kNotMoved ? load.stages[st.from] : st;
  return s < of.list_at.size() && of.list_at[s] != LoadStage::kNoList;
}

void WorkerImpl::list_runs(const Load& load, const LoadStage& st, size_t s, std::vector<ItemRun>* out) {
  const bool moved = st.from != LoadStage::kNotMoved;
  const uint64_t at = (moved ? load.stages[st.from] : st).list_at[s];
  if (!moved && st.runs[s].empty()) {
    out->push_back({at, st.items[s].size()});
    return;
  }
  for (ItemRun r : st.runs[s]) {
    r.first += at;
    out->push_back(r);
  }
}

// Requires mu_: submits the reads of `stages` (one, or a streamed load's
// stages of one layer range read from its prepared lists) from source `s`,
// ordered after the producer's events of their layers and the consumer's
// pending work when they touch device memory.
Result<TransferId> WorkerImpl::submit_read(const Load& load, std::span<const uint32_t> stages, size_t s, PeerId peer,
                                           const SubmitOptions& base) {
  const LoadStage& st = load.stages[stages.front()];
  auto submit = [&](SubmitOptions o) -> Result<TransferId> {
    if (on_list(load, st, s)) {
      // Runs of the load's prepared list, checked as runs only: a stage
      // others are moved from reads its items, a moved stage those items
      // moved.
      std::vector<ItemRun> runs;
      for (uint32_t k : stages) {
        const LoadStage& x = load.stages[k];
        list_runs(load, x, s, &runs);
        stats_.moved_stage_reads += x.from != LoadStage::kNotMoved;
      }
      ++stats_.reads_as_runs;
      for (const ItemRun& r : runs) stats_.moved_runs += r.moved;
      return engine_.submit_runs(load.lists[s], runs, std::move(o));
    }
    if (st.from != LoadStage::kNotMoved) {
      return Status::internal("request " + q(load.request) + ": a stage moved from stage " + std::to_string(st.from) +
                              " reads rank " + std::to_string(s) + ", whose items for it were not prepared");
    }
    if (st.runs[s].empty()) return engine_.submit(peer, TransferOp::kRead, st.items[s], std::move(o));
    ++stats_.reads_as_runs;
    for (const ItemRun& r : st.runs[s]) stats_.moved_runs += r.moved;
    for (const LoadStage::TableRun& t : st.tables[s]) stats_.moved_runs += t.table->size() - 1;
    // The moved runs as prepared tables, one per (source, moves); a table
    // the engine no longer takes (the source reconnected or changed its
    // registrations: rare) is released with the others, and the runs go
    // as they are.
    bool used = false;
    std::vector<ItemRun> tabled = with_tables(peer, load, st, s, &used);
    if (used) {
      Result<TransferId> id = engine_.submit(peer, TransferOp::kRead, st.items[s], tabled, o);
      if (id.ok() || id.error().code() != Code::kUnavailable) return id;
      release_tables();
    } else if (!st.tables[s].empty()) {
      return engine_.submit(peer, TransferOp::kRead, st.items[s], tabled, std::move(o));
    }
    return engine_.submit(peer, TransferOp::kRead, st.items[s], stage_runs(load, st, s), std::move(o));
  };
  bool device = false;
  for (uint32_t k : stages) device = device || (!load.stages[k].device.empty() && load.stages[k].device[s] != 0);
  if (!device) return submit(base);
  SubmitOptions o = base;
  auto add = [&](const std::string& handle) {
    if (!handle.empty() &&
        std::find(o.ready_event_handles.begin(), o.ready_event_handles.end(), handle) == o.ready_event_handles.end()) {
      o.ready_event_handles.push_back(handle);
    }
  };
  if (load.stream) {
    for (uint32_t k : stages) {
      for (uint32_t l = load.stages[k].first_layer; l < load.stages[k].end_layer; ++l) add(load.events[s][l]);
    }
  }
  if (!load.ready.host_synchronized) {
    add(load.ready.event_handle);
    o.ready_event = load.ready.event;
  }
  if (o.ready_event_handles.size() > kMaxReadyEvents) {
    return Status::invalid_argument(
        "request " + q(load.request) + ": a stage of " + std::to_string(st.end_layer - st.first_layer) +
        " layers waits on " + std::to_string(o.ready_event_handles.size()) + " events, more than " +
        std::to_string(kMaxReadyEvents) + ": fewer layers per stage (stream_layers_per_stage), or one event per stage");
  }
  return submit(std::move(o));
}

}  // namespace kvbridge::connector
