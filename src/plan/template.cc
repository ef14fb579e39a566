// Instantiating plan templates: see kvbridge/plan.h and plan/template.h.
//
// The common path checks the request in one pass without building strings
// (fits(), template_fits.cc), then replays the loops with the request's
// ids. Only a request that fails the check pays for plan() itself, which is
// what makes its errors plan()'s, word for word.
#include <algorithm>
#include <bit>
#include <string>

#include "common/text.h"
#include "plan/emit.h"
#include "plan/template.h"

namespace kvbridge {
namespace plan_internal {
namespace {

// One moving entry of a move in emission order: its local id, the id of its
// first remote entry, and its class. The remote ids it reads
// (TemplateMove::remote_reads of them) are gathered beside, in that order.
struct EntryIds {
  uint64_t local_id;
  uint64_t remote_id;
  uint32_t program;
};

// Where one loop's descriptors went: [begin, end) of the plan, when the loop
// started with no earlier descriptor of its tensor (`fresh`).
struct LoopSpan {
  size_t begin = 0, end = 0;
  bool fresh = false;
  bool unordered = false;
  std::vector<uint64_t> counts;  // descriptors per source, once a copy needed them
};

// Buffers of one instantiation.
struct Scratch {
  std::vector<LoopSpan> spans;
  std::vector<uint64_t> bits_or_order;
  std::vector<uint64_t> by_id;
  std::vector<EntryIds> entries;
  std::vector<int64_t> remote_ids;
  uint64_t repeated_end = 0;  // compact: one past the last descriptor a moved run repeats
};

// last[t] of a local tensor whose last descriptor is in a moved run.
constexpr int64_t kInMovedRun = -2;

// Emits one loop for `entries` (in emission order; `rids` holds `reads`
// remote ids per entry), merging as plan()'s Emitter does. A loop writes one
// local tensor, so the tensor's last descriptor is held in locals while
// pieces merge into it, and written once, when the next one starts: a new
// one is pushed whole, one from an earlier loop updated in place. With none,
// its end is one no piece meets (ro0 + 0 is past every tensor) and nothing
// starts before. kOnePiece, kOneSource, kRigid: TemplateLoop's flags.
//
// Why it is written so: a plan that merges little (shuffled ids) is a loop
// that writes a descriptor per piece, and measured with perf it was bound by
// the loop's bookkeeping, not by the stores: vector::push_back kept out of
// line at -O2, and values spilled to the stack whose stores and reloads
// chained the iterations. Hence flatten, few locals, and template flags for
// what would otherwise be tested in the loop.
template <bool kOnePiece, bool kOneSource, bool kRigid>
[[gnu::flatten]] bool emit_loop(const TemplateLoop& loop, std::span<const EntryIds> entries, const int64_t* rids,
                                uint32_t reads, std::vector<int64_t>& last, Plan& out, EmitOrder& order) {
  std::vector<Descriptor>& ds = out.descriptors;
  SourceTotals* totals = out.sources.data();
  const uint16_t lt = loop.local_tensor;
  const TemplatePiece* pieces = loop.pieces.data();
  const uint32_t* program = loop.program.data();
  // Few live values, so that the loop keeps them in registers: the held
  // descriptor's offsets, bytes and (source, remote tensor) as one word, and
  // where it is: kNone, kNew (not in `ds` yet) or its index in `ds`.
  constexpr int64_t kNone = -2, kNew = -1;
  auto route_of = [](uint16_t source, uint16_t remote_tensor) { return uint32_t{source} << 16 | remote_tensor; };
  uint64_t lo0 = 0, ro0 = UINT64_MAX, bytes = 0;
  uint32_t route = 0;
  int64_t held = last[lt] >= 0 ? last[lt] : kNone;
  bool unordered = false;
  if (held >= 0) {
    const Descriptor& d = ds[static_cast<size_t>(held)];
    lo0 = d.local_offset;
    ro0 = d.remote_offset;
    bytes = d.bytes;
    route = route_of(d.source, d.remote_tensor);
  }
  uint64_t started = 0;  // descriptors started, counted here when kOneSource
  const size_t before = ds.size();
  for (const EntryIds& e : entries) {
    uint32_t x = kOnePiece ? e.program : program[e.program];
    const uint32_t x_end = kOnePiece ? x + 1 : program[e.program + 1];
    for (; x < x_end; ++x) {
      const TemplatePiece& p = pieces[x];
      const uint64_t rid = kOnePiece ? e.remote_id : static_cast<uint64_t>(rids[p.remote_entry]);
      const uint64_t lo = p.local_offset + e.local_id * p.local_stride;
      const uint64_t ro = p.remote_offset + rid * p.remote_stride;
      const uint32_t r = route_of(p.source, p.remote_tensor);
      if (lo == lo0 + bytes && ro == ro0 + bytes && r == route) {
        bytes += p.bytes;
      } else {
        unordered |= lo < lo0 + bytes;
        if (held >= 0) {
          ds[static_cast<size_t>(held)].bytes = bytes;
        } else if (held == kNew) {
          ds.push_back({static_cast<uint16_t>(route >> 16), lt, static_cast<uint16_t>(route), 0, lo0, ro0, bytes});
        }
        held = kNew;
        lo0 = lo;
        ro0 = ro;
        bytes = p.bytes;
        route = r;
        if (kOneSource) {
          ++started;
        } else {
          ++totals[p.source].descriptors;
        }
      }
      if (kRigid && x + 1 < x_end) {
        // The entry's other pieces move with this one and are in order, none
        // contiguous with the next on both sides: each is a new descriptor.
        if (held >= 0) {
          ds[static_cast<size_t>(held)].bytes = bytes;
        } else {
          ds.push_back({static_cast<uint16_t>(route >> 16), lt, static_cast<uint16_t>(route), 0, lo0, ro0, bytes});
        }
        const uint64_t dl = e.local_id * p.local_stride, dr = rid * p.remote_stride;
        for (++x; x + 1 < x_end; ++x) {
          const TemplatePiece& q = pieces[x];
          ds.push_back({q.source, lt, q.remote_tensor, 0, q.local_offset + dl, q.remote_offset + dr, q.bytes});
          if (!kOneSource) ++totals[q.source].descriptors;
        }
        const TemplatePiece& z = pieces[x];
        held = kNew;
        lo0 = z.local_offset + dl;
        ro0 = z.remote_offset + dr;
        bytes = z.bytes;
        route = route_of(z.source, z.remote_tensor);
        if (kOneSource) {
          started += x_end - program[e.program] - 1;
        } else {
          ++totals[z.source].descriptors;
        }
        break;
      }
    }
    if (!kOnePiece) rids += reads;
  }
  if (held >= 0) {
    ds[static_cast<size_t>(held)].bytes = bytes;
  } else if (held == kNew) {
    last[lt] = static_cast<int64_t>(ds.size());
    ds.push_back({static_cast<uint16_t>(route >> 16), lt, static_cast<uint16_t>(route), 0, lo0, ro0, bytes});
  }
  if (kOneSource && started > 0) totals[pieces[0].source].descriptors += started;
  if (ds.size() > before) order.new_descriptor(lt);
  order.unordered = order.unordered || unordered;
  return unordered;
}

// Counts the descriptors of `copies` copies of loop `original` (emitted
// fresh at `span`) in the plan's per-source totals.
void count_copy(const TemplateLoop& original, LoopSpan& span, Plan& out, uint64_t copies = 1) {
  if (original.one_source) {
    out.sources[original.pieces.front().source].descriptors += copies * (span.end - span.begin);
    return;
  }
  // The original's count per source, once; then each copy adds it.
  if (span.counts.empty()) {
    span.counts.assign(out.sources.size(), 0);
    for (size_t k = span.begin; k < span.end; ++k) ++span.counts[out.descriptors[k].source];
  }
  for (size_t src = 0; src < span.counts.size(); ++src) out.sources[src].descriptors += copies * span.counts[src];
}

// Emits loop `copy` as the descriptors of the loop it copies (`original`,
// emitted fresh at `span`) moved by its shifts.
void copy_loop(const TemplateLoop& copy, const TemplateLoop& original, LoopSpan& span, std::vector<int64_t>& last,
               Plan& out, EmitOrder& order) {
  std::vector<Descriptor>& ds = out.descriptors;
  const uint16_t lt = copy.local_tensor, rt = copy.remote_tensor;
  const uint64_t dl = copy.local_shift, dr = copy.remote_shift;
  // Sized first, then written through pointers: a loop the compiler keeps in
  // registers (push_back's bookkeeping per element was most of its time).
  const size_t n = span.end - span.begin, at = ds.size();
  ds.resize(at + n);
  const Descriptor* from = ds.data() + span.begin;
  Descriptor* to = ds.data() + at;
  for (size_t k = 0; k < n; ++k) {
    to[k] = {from[k].source, lt, rt, 0, from[k].local_offset + dl, from[k].remote_offset + dr, from[k].bytes};
  }
  count_copy(original, span, out);
  if (span.end > span.begin) {
    last[lt] = static_cast<int64_t>(ds.size() - 1);
    order.new_descriptor(lt);
  }
  order.unordered = order.unordered || span.unordered;
}

// order[x] = the index in `ids` of its x-th smallest id, for distinct ids
// below `num_blocks`: a least-significant-digit radix sort of the indices
// by their ids, through `tmp`, in as few passes as 8-bit digits take (two
// up to 65,536 blocks), each digit as narrow as that allows (7 bits up to
// 16,384 blocks). Chunked loads sort a few hundred ids a stage, where
// std::sort's comparisons were a tenth of a load's host time and a pass's
// buckets (cleared and summed whatever the number of ids) half the sort's.
// Every digit is counted in one read of the ids; the first pass scatters
// the indices straight from them, and the passes alternate between the two
// buffers so that the last writes `order`.
void radix_order(std::span<const int64_t> ids, uint64_t num_blocks, std::vector<uint64_t>& tmp,
                 std::vector<uint64_t>& order) {
  constexpr unsigned kMaxBits = 8, kMaxPasses = 8;
  const size_t n = ids.size();
  tmp.resize(n);
  const unsigned id_bits = num_blocks <= 1 ? 1 : static_cast<unsigned>(std::bit_width(num_blocks - 1));
  const unsigned passes = (id_bits + kMaxBits - 1) / kMaxBits;
  const unsigned bits = (id_bits + passes - 1) / passes;
  const size_t buckets = size_t{1} << bits;
  const uint64_t mask = buckets - 1;
  uint32_t count[kMaxPasses][size_t{1} << kMaxBits];
  for (unsigned pass = 0; pass < passes; ++pass) std::fill_n(count[pass], buckets, 0u);
  const uint64_t* id = reinterpret_cast<const uint64_t*>(ids.data());  // ids are below num_blocks: not negative
  if (passes == 2) {
    // Most caches (up to 65,536 blocks): the general loop below made the
    // whole sort about 40% dearer.
    for (size_t k = 0; k < n; ++k) {
      ++count[0][id[k] & mask];
      ++count[1][(id[k] >> bits) & mask];
    }
  } else {
    for (size_t k = 0; k < n; ++k) {
      for (unsigned pass = 0, shift = 0; pass < passes; ++pass, shift += bits) ++count[pass][(id[k] >> shift) & mask];
    }
  }
  for (unsigned pass = 0; pass < passes; ++pass) {
    uint32_t sum = 0;
    for (size_t b = 0; b < buckets; ++b) {
      const uint32_t here = count[pass][b];
      count[pass][b] = sum;
      sum += here;
    }
  }
  // Pass p writes buffer (passes - 1 - p) % 2: the last, `order`.
  uint64_t* const buffer[2] = {order.data(), tmp.data()};
  for (unsigned pass = 0, shift = 0; pass < passes; ++pass, shift += bits) {
    uint32_t* c = count[pass];
    uint64_t* to = buffer[(passes - 1 - pass) % 2];
    if (pass == 0) {
      for (size_t k = 0; k < n; ++k) to[c[id[k] & mask]++] = k;
      continue;
    }
    const uint64_t* from = buffer[(passes - pass) % 2];
    for (size_t x = 0; x < n; ++x) {
      const uint64_t k = from[x];
      to[c[(id[k] >> shift) & mask]++] = k;
    }
  }
}

// True when no descriptor of any local tensor of `table` was emitted yet,
// and no two of its shifts name one: then each is marked as held by a
// moved run (kInMovedRun). False, changing nothing, when not.
bool claim_fresh(const std::vector<TensorShift>& table, std::vector<int64_t>& last) {
  for (size_t k = 0; k < table.size(); ++k) {
    int64_t& held = last[table[k].local_tensor];
    if (held != -1) {
      for (size_t u = 0; u < k; ++u) last[table[u].local_tensor] = -1;
      return false;
    }
    held = kInMovedRun;
  }
  return true;
}

// Emits the loops of one move with the request's ids: entries in ascending
// local block id (ids of moving entries are distinct), with the remote ids
// each reads gathered in that order.
//
// With `runs` (a compact plan: Plan::descriptors holds its literal ones),
// a copied loop is a moved run of its original's descriptors instead of
// their copies, and each loop emitted is a literal run. False when the
// plan cannot be held so: a later loop would merge into a descriptor a
// moved run repeats (the run would repeat the merged one) or into a moved
// run's last (which is not in the list).
bool emit_move(const TemplateMove& tm, std::span<const int64_t> local_ids, std::span<const int64_t> remote_ids,
               uint64_t num_blocks, Scratch& scratch, std::vector<int64_t>& last, Plan& out, EmitOrder& order_out,
               std::vector<DescriptorRun>* runs) {
  const std::span<const int64_t> lids = local_ids.subspan(tm.first_entry, tm.entry_class.size());
  std::vector<uint64_t>& order = scratch.bits_or_order;
  order.resize(lids.size());
  bool ascending = true;
  for (size_t k = 0; k < lids.size(); ++k) {
    order[k] = k;
    ascending = ascending && (k == 0 || lids[k] > lids[k - 1]);
  }
  if (!ascending && num_blocks <= 4 * lids.size() + 4096) {
    // Few blocks per moving entry: place each entry at its id, then read
    // the ids in order.
    std::vector<uint64_t>& at = scratch.by_id;
    at.assign(num_blocks, UINT64_MAX);
    for (size_t k = 0; k < lids.size(); ++k) at[static_cast<uint64_t>(lids[k])] = k;
    size_t x = 0;
    for (uint64_t k : at) {
      if (k != UINT64_MAX) order[x++] = k;
    }
  } else if (!ascending && lids.size() < 64) {
    // Too few for a radix sort's buckets to pay.
    for (size_t k = 0; k < lids.size(); ++k) order[k] = static_cast<uint64_t>(lids[k]) << 32 | k;
    std::sort(order.begin(), order.end());
    for (uint64_t& k : order) k &= UINT32_MAX;
  } else if (!ascending) {
    radix_order(lids, num_blocks, scratch.by_id, order);
  }
  const uint32_t reads = tm.remote_reads;
  scratch.entries.resize(order.size());
  scratch.remote_ids.assign(order.size() * reads, 0);
  for (size_t x = 0; x < order.size(); ++x) {
    const uint64_t k = order[x];
    const uint64_t first = tm.remote_first[k];
    scratch.entries[x] = {static_cast<uint64_t>(lids[k]), static_cast<uint64_t>(remote_ids[first]), tm.entry_class[k]};
    const uint64_t n = std::min<uint64_t>(reads, remote_ids.size() - first);
    if (n == 1) {
      scratch.remote_ids[x * reads] = remote_ids[first];
    } else {
      std::copy_n(remote_ids.begin() + static_cast<std::ptrdiff_t>(first), n, scratch.remote_ids.begin() + x * reads);
    }
  }
  const int64_t* rids = scratch.remote_ids.data();
  std::vector<LoopSpan>& spans = scratch.spans;
  spans.assign(tm.loops.size(), LoopSpan{});
  for (size_t i = 0; i < tm.loops.size(); ++i) {
    const TemplateLoop& loop = tm.loops[i];
    if (runs != nullptr && loop.copies_end > i + 1 && spans[static_cast<size_t>(loop.copy_of)].fresh &&
        spans[static_cast<size_t>(loop.copy_of)].end > spans[static_cast<size_t>(loop.copy_of)].begin &&
        claim_fresh(*loop.copies, last)) {
      // Copies of one loop one after another, each starting fresh: what
      // they would be one by one below (a moved run each), as one table
      // run.
      LoopSpan& original = spans[static_cast<size_t>(loop.copy_of)];
      const TemplateLoop& from = tm.loops[static_cast<size_t>(loop.copy_of)];
      const std::vector<TensorShift>& table = *loop.copies;
      DescriptorRun run{original.begin,
                        original.end - original.begin,
                        true,
                        loop.local_tensor,
                        loop.remote_tensor,
                        loop.local_shift,
                        loop.remote_shift};
      run.table = loop.copies;
      runs->push_back(std::move(run));
      count_copy(from, original, out, table.size());
      scratch.repeated_end = std::max<uint64_t>(scratch.repeated_end, original.end);
      order_out.new_descriptor(table.front().local_tensor);
      if (!loop.copies_ascending) order_out.by_tensor = false;
      order_out.new_descriptor(table.back().local_tensor);
      order_out.unordered = order_out.unordered || original.unordered;
      for (size_t k = i; k < loop.copies_end; ++k) {
        spans[k].unordered = original.unordered;
        spans[k].begin = spans[k].end = out.descriptors.size();
      }
      i = loop.copies_end - 1;
      continue;
    }
    LoopSpan& span = spans[i];
    int64_t& held = last[loop.local_tensor];
    if (runs != nullptr && (held == kInMovedRun || (held >= 0 && static_cast<uint64_t>(held) < scratch.repeated_end))) {
      return false;
    }
    span.fresh = held < 0;
    span.begin = out.descriptors.size();
    if (loop.copy_of >= 0 && span.fresh && spans[static_cast<size_t>(loop.copy_of)].fresh) {
      LoopSpan& original = spans[static_cast<size_t>(loop.copy_of)];
      const TemplateLoop& from = tm.loops[static_cast<size_t>(loop.copy_of)];
      if (runs == nullptr) {
        copy_loop(loop, from, original, last, out, order_out);
      } else if (original.end > original.begin) {
        runs->push_back({original.begin, original.end - original.begin, true, loop.local_tensor, loop.remote_tensor,
                         loop.local_shift, loop.remote_shift});
        count_copy(from, original, out);
        scratch.repeated_end = std::max<uint64_t>(scratch.repeated_end, original.end);
        held = kInMovedRun;
        order_out.new_descriptor(loop.local_tensor);
        order_out.unordered = order_out.unordered || original.unordered;
      }
      span.unordered = original.unordered;
      span.end = span.begin;
      continue;
    } else if (loop.one_piece && loop.one_source) {
      span.unordered = emit_loop<true, true, false>(loop, scratch.entries, rids, reads, last, out, order_out);
    } else if (loop.one_piece) {
      span.unordered = emit_loop<true, false, false>(loop, scratch.entries, rids, reads, last, out, order_out);
    } else if (loop.rigid && loop.one_source) {
      span.unordered = emit_loop<false, true, true>(loop, scratch.entries, rids, reads, last, out, order_out);
    } else if (loop.rigid) {
      span.unordered = emit_loop<false, false, true>(loop, scratch.entries, rids, reads, last, out, order_out);
    } else if (loop.one_source) {
      span.unordered = emit_loop<false, true, false>(loop, scratch.entries, rids, reads, last, out, order_out);
    } else {
      span.unordered = emit_loop<false, false, false>(loop, scratch.entries, rids, reads, last, out, order_out);
    }
    span.end = out.descriptors.size();
    if (runs != nullptr && span.end > span.begin) runs->push_back({span.begin, span.end - span.begin});
  }
  return true;
}

// The plan of a uniform template for a request that fits() its shape
// (`lists`: fits()' spans). False when bytes would be written twice.
// With `runs`, the plan is held compact (emit_move()): false also when it
// cannot be (a descriptor a later loop merges into is repeated, or
// plan() would reorder the descriptors), and the caller instantiates it
// whole.
bool emit_fitted(const PlanTemplate::Impl& t, std::span<const std::span<const int64_t>> lists, Scratch& scratch,
                 Plan& out, std::vector<DescriptorRun>* runs = nullptr) {
  out.descriptors.clear();
  if (runs == nullptr) out.descriptors.reserve(t.max_pieces);
  out.sources = t.totals;
  std::vector<int64_t> last(t.local().tensors.size(), -1);
  EmitOrder order;
  scratch.repeated_end = 0;
  if (runs != nullptr) runs->clear();
  for (const TemplateMove& tm : t.moves) {
    const TemplateGroup& g = t.groups[tm.group];
    if (!emit_move(tm, lists[2 * tm.group].subspan(g.local_entry0), lists[2 * tm.group + 1].subspan(g.remote_entry0),
                   g.local_blocks, scratch, last, out, order, runs)) {
      return false;
    }
  }
  if (runs != nullptr && (order.unordered || !order.by_tensor)) return false;
  return finish_plan(t.local(), order, out).ok();
}

Status instantiate(const PlanTemplate::Impl& t, const Request& r, Plan& out) {
  std::vector<std::span<const int64_t>> lists;
  Scratch scratch;
  if (!fits(t, r, lists, scratch.bits_or_order)) return request_error(t, r);
  if (!t.uniform) {
    KVB_ASSIGN_OR_RETURN(out, plan(t.local(), t.remotes(), r));
    return Status();
  }
  // Bytes written twice (overlaid groups given one id) fail as in plan(),
  // whose message names the first overlap of its own descriptors: ask it.
  if (!emit_fitted(t, lists, scratch, out)) return request_error(t, r);
  return Status();
}

}  // namespace

bool instantiate_all(std::span<const PlanTemplate> templates, const Request& r, std::span<Plan> out) {
  if (templates.empty()) return true;
  std::vector<std::span<const int64_t>> lists;
  Scratch scratch;
  if (!fits(TemplateAccess::impl(templates[0]), r, lists, scratch.bits_or_order)) return false;
  for (size_t i = 0; i < templates.size(); ++i) {
    const PlanTemplate::Impl& t = TemplateAccess::impl(templates[i]);
    if (!t.uniform || !emit_fitted(t, lists, scratch, out[i])) return false;
  }
  return true;
}

bool instantiate_all_compact(std::span<const PlanTemplate> templates, const Request& r, std::span<CompactPlan> out) {
  if (templates.empty()) return true;
  std::vector<std::span<const int64_t>> lists;
  Scratch scratch;
  if (!fits(TemplateAccess::impl(templates[0]), r, lists, scratch.bits_or_order)) return false;
  Plan p;
  std::vector<DescriptorRun> runs;
  for (size_t i = 0; i < templates.size(); ++i) {
    const PlanTemplate::Impl& t = TemplateAccess::impl(templates[i]);
    if (!t.uniform) return false;
    if (emit_fitted(t, lists, scratch, p, &runs)) {
      CompactPlan& c = out[i];
      c.descriptors = 0;
      for (const DescriptorRun& run : runs) c.descriptors += run.descriptors();
      // Copied out at their size; the buffers keep theirs for the next
      // stage (growing them afresh per stage was a tenth of the work).
      c.literal.assign(p.descriptors.begin(), p.descriptors.end());
      c.runs.assign(runs.begin(), runs.end());
      c.sources = p.sources;
      c.bytes = p.bytes;
      continue;
    }
    if (!emit_fitted(t, lists, scratch, p)) return false;
    out[i] = compact(std::move(p));
    p = Plan();
  }
  return true;
}

PlanTemplate TemplateAccess::not_uniform(const PlanTemplate& t, std::string reason) {
  auto copy = std::make_shared<PlanTemplate::Impl>(*t.impl_);
  copy->uniform = false;
  copy->fallback_reason = std::move(reason);
  copy->moves.clear();
  return PlanTemplate(std::move(copy));
}

}  // namespace plan_internal

Plan expand(const CompactPlan& c) {
  Plan p;
  p.sources = c.sources;
  p.bytes = c.bytes;
  p.descriptors.resize(c.descriptors);
  Descriptor* to = p.descriptors.data();
  auto moved = [&](const Descriptor* from, uint64_t count, const TensorShift& m) {
    for (uint64_t k = 0; k < count; ++k) {
      *to++ = {from[k].source,
               m.local_tensor,
               m.remote_tensor,
               0,
               from[k].local_offset + m.local_shift,
               from[k].remote_offset + m.remote_shift,
               from[k].bytes};
    }
  };
  for (const DescriptorRun& run : c.runs) {
    const Descriptor* from = c.literal.data() + run.first;
    if (!run.moved) {
      to = std::copy_n(from, run.count, to);
    } else if (run.table != nullptr) {
      for (const TensorShift& m : *run.table) moved(from, run.count, m);
    } else {
      moved(from, run.count, {run.local_tensor, run.remote_tensor, run.local_shift, run.remote_shift});
    }
  }
  return p;
}

CompactPlan compact(Plan plan) {
  CompactPlan c;
  c.descriptors = plan.descriptors.size();
  if (c.descriptors > 0) c.runs.push_back({0, c.descriptors});
  c.literal = std::move(plan.descriptors);
  c.sources = std::move(plan.sources);
  c.bytes = plan.bytes;
  return c;
}

CompactStage compact(PlanStage stage) {
  return {stage.first_layer, stage.end_layer,    stage.first_token,
          stage.end_token,   stage.resume_token, compact(std::move(stage.plan))};
}

RequestShape shape_of(const Request& request) {
  RequestShape s;
  s.num_tokens = request.num_tokens;
  s.skip_tokens = request.skip_tokens;
  for (const auto& [name, blocks] : request.blocks) {
    GroupShape& g = s.groups[name];
    for (int64_t id : blocks.local) g.local.push_back(id != -1);
    for (int64_t id : blocks.remote) g.remote.push_back(id != -1);
  }
  return s;
}

Result<PlanTemplate> PlanTemplate::create(const Layout& local, std::span<const Layout> remotes,
                                          const RequestShape& shape) {
  return plan_internal::build_template(local, remotes, shape);
}

const RequestShape& PlanTemplate::shape() const { return impl_->shape; }
bool PlanTemplate::uniform() const { return impl_->uniform; }
const std::string& PlanTemplate::fallback_reason() const { return impl_->fallback_reason; }
uint64_t PlanTemplate::pieces() const { return impl_->pieces; }

Result<Plan> PlanTemplate::instantiate(const Request& request) const {
  Plan p;
  KVB_RETURN_IF_ERROR(plan_internal::instantiate(*impl_, request, p));
  if (p.descriptors.capacity() > p.descriptors.size() + p.descriptors.size() / 8) p.descriptors.shrink_to_fit();
  return p;
}

Status PlanTemplate::instantiate(const Request& request, Plan* out) const {
  return plan_internal::instantiate(*impl_, request, *out);
}

}  // namespace kvbridge
