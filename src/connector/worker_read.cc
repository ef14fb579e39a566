// A load's reads: each stage's items from one source, submitted as runs
// whose later layers are moved runs, and those moved runs through a table
// of moves the engine prepared once per (source, moves), so that a read's
// check and submit grow with its first layer's items only. A streamed
// load's stage moved from an earlier one reads that stage's items, prepared
// once per load and source, as moved runs: its check grows with its runs.
#include <algorithm>

#include "connector/worker_impl.h"

namespace kvbridge::connector {

namespace {

void put(std::string& key, uint64_t v) { key.append(reinterpret_cast<const char*>(&v), sizeof v); }

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

Status WorkerImpl::prepare_lists(Load& load) {
  for (size_t k = 0; k < load.stages.size(); ++k) {
    LoadStage& st = load.stages[k];
    for (size_t s = 0; s < st.lists.size(); ++s) {
      if (st.items[s].empty()) continue;
      const auto& sources = load.result.sources;
      const size_t at = static_cast<size_t>(std::find(sources.begin(), sources.end(), s) - sources.begin());
      Result<PreparedId> list = at < load.peers.size()
                                    ? engine_.prepare(load.peers[at], TransferOp::kRead, st.items[s])
                                    : Result<PreparedId>(Status::internal("no connection to a source read from"));
      if (!list.ok()) {
        release_holds(load);
        return list.error().with_context("request " + q(load.request) + ": preparing the reads from " + load.instance +
                                         " rank " + std::to_string(s));
      }
      st.lists[s] = *list;
      lists_held_.fetch_add(1, std::memory_order_relaxed);
      std::lock_guard<std::mutex> lock(mu_);
      ++stats_.prepared_lists;
    }
  }
  return Status();
}

// Requires mu_: submits the reads of stage `k` from source `s`, ordered
// after the producer's events of its layers and the consumer's pending work
// when they touch device memory.
Result<TransferId> WorkerImpl::submit_read(const Load& load, uint32_t k, size_t s, PeerId peer,
                                           const SubmitOptions& base) {
  const LoadStage& st = load.stages[k];
  auto submit = [&](SubmitOptions o) -> Result<TransferId> {
    if (st.from != LoadStage::kNotMoved) {
      // A stage moved from an earlier one: runs of that stage's items as
      // prepared, checked as runs only.
      ++stats_.reads_as_runs;
      ++stats_.moved_stage_reads;
      stats_.moved_runs += st.runs[s].size();
      return engine_.submit_runs(load.stages[st.from].lists[s], st.runs[s], std::move(o));
    }
    if (!st.lists.empty() && st.lists[s] != 0 && st.tables[s].empty()) {
      // Its own items, prepared for the stages moved from it.
      const ItemRun all{0, st.items[s].size()};
      if (st.runs[s].empty()) return engine_.submit_runs(st.lists[s], {&all, 1}, std::move(o));
      ++stats_.reads_as_runs;
      for (const ItemRun& r : st.runs[s]) stats_.moved_runs += r.moved;
      return engine_.submit_runs(st.lists[s], st.runs[s], std::move(o));
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
  if (st.device.empty() || st.device[s] == 0) return submit(base);
  SubmitOptions o = base;
  auto add = [&](const std::string& handle) {
    if (!handle.empty() &&
        std::find(o.ready_event_handles.begin(), o.ready_event_handles.end(), handle) == o.ready_event_handles.end()) {
      o.ready_event_handles.push_back(handle);
    }
  };
  if (load.stream) {
    for (uint32_t l = st.first_layer; l < st.end_layer; ++l) add(load.events[s][l]);
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
