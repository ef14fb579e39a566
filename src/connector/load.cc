#include "connector/load.h"

#include "common/text.h"

#include <algorithm>
#include <map>
#include <utility>

namespace kvbridge::connector {

LoadTensors::LoadTensors(std::span<const RegionId> regions, const Layout& local, std::span<const RankInfo> infos,
                         std::span<const Layout> remotes)
    : local_regions(regions), sources(infos), remote_device(remotes.size()) {
  for (const Tensor& t : local.tensors) local_device.push_back(t.memory != "host");
  for (size_t r = 0; r < remotes.size(); ++r) {
    for (const Tensor& t : remotes[r].tensors) remote_device[r].push_back(t.memory != "host");
  }
}

namespace {

// A stage's cut, and its per-source lists sized and empty.
LoadStage empty_stage(const CompactStage& stage, size_t sources) {
  LoadStage ls;
  ls.first_token = stage.first_token;
  ls.end_token = stage.end_token;
  ls.resume_token = stage.resume_token;
  ls.first_layer = stage.first_layer;
  ls.end_layer = stage.end_layer;
  ls.items.resize(sources);
  ls.runs.resize(sources);
  ls.tables.resize(sources);
  ls.device.assign(sources, 0);
  return ls;
}

}  // namespace

LoadStage load_stage(Load& load, const CompactStage& stage, const LoadTensors& tensors, size_t only_source,
                     std::vector<LiteralItems>* literal_out) {
  const CompactPlan& plan = stage.plan;
  const size_t sources = tensors.sources.size();
  LoadStage ls = empty_stage(stage, sources);
  for (size_t r = 0; r < plan.sources.size() && r < sources; ++r) {
    const uint64_t n = plan.sources[r].descriptors;
    if (n == 0 || (only_source != SIZE_MAX && r != only_source)) continue;
    ls.items[r].reserve(std::min<uint64_t>(n, plan.literal.size()));
    ls.runs[r].reserve(plan.runs.size());
  }
  // A source's items come in runs of one pair of tensors (the sources'
  // items interleave: a block's heads from several ranks): per source, the
  // regions and memory kinds of its last pair; and for literal_items()
  // below, its items in the run and where the next goes.
  struct Last {
    uint32_t tensors = UINT32_MAX;
    RegionId local = 0, remote = 0;
    uint64_t count = 0;
    TransferItem* at = nullptr;
  };
  std::vector<Last> last(sources);
  // Source s's last pair of tensors made (lt, rt).
  auto pair_of = [&](size_t s, uint16_t lt, uint16_t rt) -> Last& {
    Last& l = last[s];
    if (const uint32_t pair = uint32_t{lt} << 16 | rt; pair != l.tensors) {
      l.tensors = pair;
      l.local = tensors.local_regions[lt];
      l.remote = tensors.sources[s].tensors[rt].region;
      ls.device[s] |= tensors.local_device[lt] | tensors.remote_device[s][rt];
    }
    return l;
  };
  auto item = [&](const Descriptor& d, uint16_t lt, uint16_t rt, uint64_t lo, uint64_t ro) {
    const uint16_t s = d.source;
    if (only_source != SIZE_MAX && s != only_source) return;
    const Last& l = pair_of(s, lt, rt);
    ls.items[s].push_back(TransferItem{l.local, lo, l.remote, ro, d.bytes});
  };
  // A literal run's items, the common case and most of a load's items: its
  // descriptors counted per source, each source's items sized at once and
  // written in place (as item() would, without its per-item checks of
  // capacity and source).
  auto literal_items = [&](const Descriptor* ds, uint64_t n) {
    for (Last& l : last) l.count = 0;
    for (uint64_t k = 0; k < n; ++k) ++last[ds[k].source].count;
    for (size_t s = 0; s < sources; ++s) {
      Last& l = last[s];
      if (only_source != SIZE_MAX && s != only_source) l.count = 0;
      const size_t size = ls.items[s].size();
      ls.items[s].resize(size + l.count);
      l.at = ls.items[s].data() + size;
    }
    for (uint64_t k = 0; k < n; ++k) {
      const Descriptor& d = ds[k];
      if (last[d.source].count == 0) continue;
      Last& l = pair_of(d.source, d.local_tensor, d.remote_tensor);
      *l.at++ = TransferItem{l.local, d.local_offset, l.remote, d.remote_offset, d.bytes};
    }
  };
  // Per literal run (by its first descriptor): each source's items of it.
  std::vector<std::pair<uint64_t, std::vector<ItemRun>>> literal;
  // A moved run's shifts: its table's, or its own.
  auto shifts = [](const DescriptorRun& run) -> std::span<const TensorShift> {
    if (run.table != nullptr) return *run.table;
    return {};
  };
  auto as_items = [&](const Descriptor* ds, const DescriptorRun& run) {
    std::span<const TensorShift> table = shifts(run);
    const TensorShift own{run.local_tensor, run.remote_tensor, run.local_shift, run.remote_shift};
    if (table.empty()) table = {&own, 1};
    for (const TensorShift& m : table) {
      for (uint64_t k = 0; k < run.count; ++k) {
        item(ds[k], m.local_tensor, m.remote_tensor, ds[k].local_offset + m.local_shift,
             ds[k].remote_offset + m.remote_shift);
      }
    }
  };
  for (const DescriptorRun& run : plan.runs) {
    const Descriptor* ds = plan.literal.data() + run.first;
    // A moved run repeats an earlier literal run (CompactPlan's invariant),
    // usually the latest; one that does not is taken as items.
    auto from = literal.rend();
    if (run.moved) {
      from = std::find_if(literal.rbegin(), literal.rend(), [&](const auto& l) { return l.first == run.first; });
    }
    if (from == literal.rend()) {
      std::vector<ItemRun> per(sources);
      for (size_t s = 0; s < sources; ++s) per[s].first = ls.items[s].size();
      if (run.moved) {
        as_items(ds, run);
      } else {
        literal_items(ds, run.count);
      }
      for (size_t s = 0; s < sources; ++s) {
        per[s].count = ls.items[s].size() - per[s].first;
        if (per[s].count > 0) ls.runs[s].push_back(per[s]);
      }
      if (!run.moved && literal_out != nullptr) literal_out->push_back({run.first, run.count, per});
      if (!run.moved) literal.emplace_back(run.first, std::move(per));
      continue;
    }
    for (size_t s = 0; s < sources; ++s) {
      const ItemRun& l = from->second[s];
      if (l.count == 0) continue;
      if (run.table != nullptr) {
        ls.tables[s].push_back({ls.runs[s].size(), run.table});
        ls.runs[s].push_back({l.first, l.count, true});
        for (const TensorShift& m : *run.table) {
          ls.device[s] |= tensors.local_device[m.local_tensor] | tensors.remote_device[s][m.remote_tensor];
        }
        continue;
      }
      ls.runs[s].push_back({l.first, l.count, true, tensors.local_regions[run.local_tensor], run.local_shift,
                            tensors.sources[s].tensors[run.remote_tensor].region, run.remote_shift});
      ls.device[s] |= tensors.local_device[run.local_tensor] | tensors.remote_device[s][run.remote_tensor];
    }
  }
  for (size_t s = 0; s < sources; ++s) {
    if (!ls.items[s].empty()) load.used[s] = true;
  }
  // A source none of whose runs is moved is submitted as items alone (the
  // engine merges items adjacent on both sides across them).
  for (std::vector<ItemRun>& runs : ls.runs) {
    if (std::none_of(runs.begin(), runs.end(), [](const ItemRun& r) { return r.moved; })) runs.clear();
  }
  return ls;
}

Result<LoadStage> moved_load_stage(Load& load, const CompactStage& stage, const LoadTensors& tensors,
                                   std::span<const LiteralItems> from) {
  const size_t sources = tensors.sources.size();
  LoadStage ls = empty_stage(stage, sources);
  ls.from = static_cast<uint32_t>(stage.moved_from);
  for (const DescriptorRun& run : stage.plan.runs) {
    // The literal runs come in the order of their first descriptors.
    auto l = std::lower_bound(from.begin(), from.end(), run.first,
                              [](const LiteralItems& x, uint64_t first) { return x.first < first; });
    if (!run.moved || run.table != nullptr || l == from.end() || l->first != run.first || l->count != run.count) {
      return Status::internal("a stage moved from stage " + std::to_string(stage.moved_from) + " names descriptors [" +
                              std::to_string(run.first) + ", " + std::to_string(run.first + run.count) +
                              "), no literal run of that stage");
    }
    for (size_t s = 0; s < sources && s < l->sources.size(); ++s) {
      const ItemRun& r = l->sources[s];
      if (r.count == 0) continue;
      ls.runs[s].push_back({r.first, r.count, true, tensors.local_regions[run.local_tensor], run.local_shift,
                            tensors.sources[s].tensors[run.remote_tensor].region, run.remote_shift});
      ls.device[s] |= tensors.local_device[run.local_tensor] | tensors.remote_device[s][run.remote_tensor];
      load.used[s] = true;
    }
  }
  return ls;
}

void table_moves(std::span<const RegionId> regions, const RankInfo& source, const std::vector<TensorShift>& table,
                 std::vector<RunMove>* out) {
  out->reserve(out->size() + table.size());
  for (const TensorShift& m : table) {
    out->push_back({regions[m.local_tensor], m.local_shift, source.tensors[m.remote_tensor].region, m.remote_shift});
  }
}

std::vector<ItemRun> expanded_runs(const LoadStage& st, size_t s, std::span<const RegionId> regions,
                                   const RankInfo& source) {
  const std::vector<ItemRun>& runs = st.runs[s];
  const std::vector<LoadStage::TableRun>& tables = st.tables[s];
  if (tables.empty()) return runs;
  std::vector<ItemRun> out;
  std::vector<RunMove> moves;
  for (size_t i = 0, t = 0; i < runs.size(); ++i) {
    if (t == tables.size() || tables[t].run != i) {
      out.push_back(runs[i]);
      continue;
    }
    moves.clear();
    table_moves(regions, source, *tables[t++].table, &moves);
    for (const RunMove& m : moves) {
      out.push_back({runs[i].first, runs[i].count, true, m.local, m.local_shift, m.remote, m.remote_shift});
    }
  }
  return out;
}

void grant_places(std::span<const TransferItem> items, std::span<const ItemRun> runs, std::vector<WriteGrant>* places,
                  std::vector<GrantRepeat>* repeats) {
  // Appends items [first, first + count)'s places; where they start.
  auto literal = [&](uint64_t first, uint64_t count) {
    const size_t at = places->size();
    for (uint64_t i = first; i < first + count && i < items.size(); ++i) {
      places->push_back({items[i].local, items[i].local_offset, items[i].bytes});
    }
    return at;
  };
  if (runs.empty()) {
    literal(0, items.size());
    return;
  }
  std::map<std::pair<uint64_t, uint64_t>, std::pair<size_t, size_t>> granted_at;  // literal run -> (at, count)
  for (const ItemRun& r : runs) {
    auto was = granted_at.find({r.first, r.count});
    if (r.moved && was != granted_at.end()) {
      if (was->second.second > 0) repeats->push_back({was->second.first, was->second.second, r.local, r.local_shift});
      continue;
    }
    const size_t from = literal(r.first, r.count);
    if (!r.moved) {
      granted_at.emplace(std::make_pair(r.first, r.count), std::make_pair(from, places->size() - from));
      continue;
    }
    // A moved run that repeats no earlier run (the engine refuses such a
    // batch): granted as the places it names.
    for (size_t i = from; i < places->size(); ++i) {
      (*places)[i].region = r.local;
      (*places)[i].offset += r.local_shift;
    }
  }
}

void settle(Load& load, std::span<const TransferStatus> statuses, const std::vector<std::string>& layers,
            std::chrono::milliseconds timeout, Clock::time_point now) {
  if (load.last_byte == Clock::time_point{}) load.last_byte = load.started;
  load.result.transfer_time = std::chrono::duration_cast<std::chrono::microseconds>(load.last_byte - load.started);
  load.result.completion_lag = std::chrono::duration_cast<std::chrono::microseconds>(now - load.last_byte);
  if (load.last_submit != Clock::time_point{}) {
    load.result.submit_time = std::chrono::duration_cast<std::chrono::microseconds>(load.last_submit - load.called);
  }
  load.result.submit_cpu_time = std::chrono::duration_cast<std::chrono::microseconds>(load.submit_cpu);
  load.result.aborted = load.aborted;
  const LoadStage* last = nullptr;
  for (const LoadStage& st : load.stages) {
    if (!st.landed || st.submitted_at == Clock::time_point{}) continue;
    if (last == nullptr || st.landed_at > last->landed_at) last = &st;
  }
  if (last != nullptr) {
    load.result.last_stage_time =
        std::chrono::duration_cast<std::chrono::microseconds>(last->landed_at - last->submitted_at);
  }
  uint64_t first_bad = load.stages.empty() ? load.result.first_bad_token : load.stages.back().end_token;
  const size_t n = load.stages.size();
  for (uint32_t k = 0; k < n; ++k) {
    const LoadStage& st = load.stages[k];
    if (st.landed) continue;
    first_bad = std::min(first_bad, st.resume_token);
    if (!load.result.error.ok()) continue;
    if (load.result.first_bad_layer.empty() && st.first_layer < layers.size()) {
      load.result.first_bad_layer = layers[st.first_layer];
    }
    std::string what = "request " + q(load.request) + ": ";
    std::string where;
    if (load.stream) {
      where = layers[st.first_layer] +
              (st.end_layer - st.first_layer > 1 ? ".." + layers[st.end_layer - 1] : std::string());
    }
    if (n > 1) {
      where += std::string(where.empty() ? "" : ", ") + "tokens " + std::to_string(st.first_token) + ".." +
               std::to_string(st.end_token) + ", " + (load.stream ? "stage " : "chunk ") + std::to_string(k + 1) +
               " of " + std::to_string(n);
    }
    if (!st.submitted) {
      if (!load.start_error.ok() || load.aborted) continue;  // said below
      load.result.error = Status::timeout(what + (where.empty() ? "" : "(" + where + ") ") +
                                          (load.push ? "not written by every prefill rank it reads from within "
                                                     : "not announced by every prefill rank it reads from within ") +
                                          std::to_string(timeout.count()) + " ms");
      continue;
    }
    for (size_t i = 0; i < load.transfers.size(); ++i) {
      const LoadTransfer& t = load.transfers[i];
      const TransferStatus& ts = statuses[i];
      if (ts.state == TransferState::kDone || std::find(t.stages.begin(), t.stages.end(), k) == t.stages.end()) {
        continue;
      }
      Status e = ts.error.ok() ? Status::internal("transfer ended as " + std::string(transfer_state_name(ts.state)))
                               : ts.error;
      load.result.error = e.with_context(what + "reading from " + load.instance + " rank " + std::to_string(t.source) +
                                         " (" + (where.empty() ? "" : where + ": ") + std::to_string(ts.bytes_done) +
                                         " of " + std::to_string(ts.bytes_total) + " bytes)");
      break;
    }
  }
  if (load.result.error.ok() && !load.start_error.ok()) load.result.error = load.start_error;
  if (load.aborted && load.result.error.ok()) {
    load.result.error = Status::cancelled("request " + q(load.request) + " was aborted");
  }
  // Every byte landed, but a source could not vouch that they were the
  // request's when they were read: none of them counts.
  const bool unconfirmed = load.result.error.ok() && !load.confirm_error.ok();
  if (unconfirmed) {
    load.result.error = load.confirm_error;
    if (!load.stages.empty() && load.stages.front().first_layer < layers.size()) {
      load.result.first_bad_layer = layers[load.stages.front().first_layer];
    }
  }
  if ((load.aborted || unconfirmed) && !load.stages.empty()) first_bad = load.stages.front().resume_token;
  load.result.first_bad_token = load.result.error.ok() ? 0 : first_bad;
  if (load.result.error.ok()) load.result.first_bad_layer.clear();
}

}  // namespace kvbridge::connector
