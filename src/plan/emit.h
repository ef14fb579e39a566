// The planner's emission of pieces, shared by plan() (plan.cc) and plan
// templates (template_build.cc, template.cc). Not a public header.
//
// Work is organised around "units": one component of one layer, or a run of
// components that both sides pack side by side in one cell (K|V, latent|
// rope), moved as one wider cell. For each unit, each run of heads served by
// one remote rank, each list entry and each segment of positions that crosses
// no kernel page on either side, both addresses are affine in (position,
// head, byte); emit_segment() coalesces what is contiguous on both sides and
// hands the rest to a sink as pieces.
//
// The sink decides where block ids come from. Every piece's address is
//   local:  L.offset + local id  * L.block_stride + (terms of the entry's positions and heads)
//   remote: R.offset + remote id * R.block_stride + (terms of the positions and heads)
// and emit_block() asks the sink for the first two terms (local_base(),
// remote_base()) and adds the rest. The Emitter below uses the request's ids
// and merges pieces into descriptors (plan()); a template's recorder uses id
// 0 and notes which entry and stride each piece depends on.
//
// Thread-safety: plain values and pure functions.
#pragma once

#include <algorithm>
#include <cstdint>
#include <span>
#include <vector>

#include "plan/internal.h"

namespace kvbridge::plan_internal {

// One side's geometry of a unit, with position axes coalesced: adjacent axes
// (outer o, inner i) with o.stride == i.size * i.stride become one, and
// size-1 axes are dropped.
struct Side {
  uint16_t tensor = 0;
  uint64_t offset = 0;
  uint64_t block_stride = 0;
  uint64_t head_stride = 0;
  uint64_t pos_sizes[kMaxPositionAxes] = {};
  uint64_t pos_strides[kMaxPositionAxes] = {};
  uint32_t pos_axes = 0;

  uint64_t inner_size() const { return pos_axes ? pos_sizes[pos_axes - 1] : 1; }
  uint64_t inner_stride() const { return pos_axes ? pos_strides[pos_axes - 1] : 0; }
  uint64_t outer_stride() const { return pos_axes ? pos_strides[0] : 0; }
  uint64_t pos_offset(uint64_t p) const {
    if (pos_axes == 1) return p * pos_strides[0];
    uint64_t off = 0;
    for (uint32_t i = pos_axes; i-- > 0;) {
      off += (p % pos_sizes[i]) * pos_strides[i];
      p /= pos_sizes[i];
    }
    return off;
  }
};

struct Unit {
  size_t layer = 0;
  uint64_t cell_bytes = 0;
  Side local;
  std::vector<Side> remote;  // per remote layout index (only sources are used)
  std::vector<HeadRun> runs;
  uint64_t remote_inner = 1;  // gcd of the sources' inner position axis sizes
  // A whole local block is one segment: one block and one inner run on both
  // sides, of the same size (the common case; emitted without divisions).
  bool block_is_segment = false;
};

// Builds the units of one group move (fused component runs per layer), in
// the order emission visits them: by local tensor, then local offset. With
// `layers` (one flag per layer of the local group), only the layers flagged
// (a stage's: the others are not looked at).
Result<std::vector<Unit>> make_units(const Layout& local, std::span<const Layout> remotes,
                                     std::span<const uint16_t> by_rank, const GroupMove& m,
                                     std::span<const uint8_t> layers = {});

// Units [begin, end) of one local tensor. A block-major row (units of one
// tensor closer together than a block) is walked block-outer: for each entry,
// every unit; otherwise unit-outer: for each unit, every entry.
struct UnitRun {
  size_t begin = 0, end = 0;
  bool block_outer = false;
};
std::vector<UnitRun> unit_runs(std::span<const Unit> units);

// The list entries of `m` with moving positions, [first_entry(m), end_entry(m)).
inline uint64_t first_entry(const GroupMove& m) { return m.begin / m.local_ppb; }
inline uint64_t end_entry(const GroupMove& m) { return m.end == 0 ? 0 : (m.end - 1) / m.local_ppb + 1; }

// What the emission order left to do at the end of a plan: `unordered` when
// a piece started before the end of its tensor's last descriptor (the order
// was not address order: sort and merge again); otherwise `by_tensor` when
// the descriptors came tensor by tensor (nothing to do).
struct EmitOrder {
  bool unordered = false;
  bool by_tensor = true;
  uint16_t last_tensor = 0;  // of the last new descriptor
  // Notes a new descriptor of local tensor `lt`.
  void new_descriptor(uint16_t lt) {
    by_tensor = by_tensor && lt >= last_tensor;
    last_tensor = lt;
  }
};

// Merges pieces into descriptors as they come: with the last descriptor of
// the same local tensor, when both sides continue it, and notes the order
// (EmitOrder).
class Emitter {
 public:
  Emitter(size_t local_tensors, std::vector<Descriptor>* out, std::vector<SourceTotals>* totals)
      : last_(local_tensors, -1), out_(out), totals_(totals) {}

  // plan(): the request's ids.
  uint64_t local_base(const GroupMove& m, uint64_t i, const Side& L) const {
    return L.offset + static_cast<uint64_t>(m.local_ids[i]) * L.block_stride;
  }
  uint64_t remote_base(const GroupMove& m, uint64_t j, const Side& R) const {
    return R.offset + static_cast<uint64_t>(m.remote_ids[j]) * R.block_stride;
  }

  void emit(uint16_t src, uint16_t lt, uint64_t lo, uint16_t rt, uint64_t ro, uint64_t n) {
    (*totals_)[src].bytes += n;
    int64_t& li = last_[lt];
    if (li >= 0) {
      Descriptor& d = (*out_)[static_cast<size_t>(li)];
      const uint64_t end = d.local_offset + d.bytes;
      if (lo == end && d.source == src && d.remote_tensor == rt && d.remote_offset + d.bytes == ro) {
        d.bytes += n;
        return;
      }
      if (lo < end) order_.unordered = true;
    }
    li = static_cast<int64_t>(out_->size());
    out_->push_back({src, lt, rt, 0, lo, ro, n});
    (*totals_)[src].descriptors += 1;
    order_.new_descriptor(lt);
  }

  const EmitOrder& order() const { return order_; }
  void reserve(uint64_t more) { out_->reserve(out_->size() + more); }

 private:
  std::vector<int64_t> last_;
  std::vector<Descriptor>* out_;
  std::vector<SourceTotals>* totals_;  // per source: bytes, descriptors emitted
  EmitOrder order_;
};

// Emits the pieces of one segment: positions [0, n) from local/remote start
// offsets, with per-position strides, for heads of one run.
template <typename Sink>
inline void emit_segment(Sink& e, const Unit& u, const HeadRun& run, uint64_t lo, uint64_t ro, uint64_t n) {
  const Side& L = u.local;
  const Side& R = u.remote[run.source];
  const uint64_t sl = L.inner_stride(), sr = R.inner_stride();
  const uint64_t hl = L.head_stride, hr = R.head_stride;
  const uint64_t nh = run.count;
  uint64_t len = u.cell_bytes;
  bool p_left = n > 1, h_left = nh > 1;
  for (int i = 0; i < 2; ++i) {
    if (p_left && sl == len && sr == len) {
      len *= n;
      p_left = false;
    } else if (h_left && hl == len && hr == len) {
      len *= nh;
      h_left = false;
    }
  }
  const uint16_t src = run.source, lt = L.tensor, rt = R.tensor;
  if (!p_left && !h_left) {
    e.emit(src, lt, lo, rt, ro, len);
  } else if (!h_left) {
    for (uint64_t k = 0; k < n; ++k) e.emit(src, lt, lo + k * sl, rt, ro + k * sr, len);
  } else if (!p_left) {
    for (uint64_t k = 0; k < nh; ++k) e.emit(src, lt, lo + k * hl, rt, ro + k * hr, len);
  } else if (hl > sl) {
    for (uint64_t h = 0; h < nh; ++h)
      for (uint64_t k = 0; k < n; ++k) e.emit(src, lt, lo + h * hl + k * sl, rt, ro + h * hr + k * sr, len);
  } else {
    for (uint64_t k = 0; k < n; ++k)
      for (uint64_t h = 0; h < nh; ++h) e.emit(src, lt, lo + h * hl + k * sl, rt, ro + h * hr + k * sr, len);
  }
}

// Emits every piece of unit `u` for local list entry `i` (positions of
// [m.begin, m.end) in it; remote position p + m.delta). The sink's
// remote_base() is called for a remote entry right before the pieces that
// read it.
template <typename Sink>
void emit_block(Sink& e, const GroupMove& m, const Unit& u, uint64_t i) {
  const uint64_t p_begin = std::max(m.begin, i * m.local_ppb);
  const uint64_t p_end = std::min(m.end, (i + 1) * m.local_ppb);
  const Side& L = u.local;
  const uint64_t lbase = e.local_base(m, i, L);
  if (u.block_is_segment && p_end - p_begin == m.local_ppb && m.delta == 0) {
    // Position i * ppb starts the block on both sides (list entry i).
    for (const HeadRun& run : u.runs) {
      const Side& R = u.remote[run.source];
      const uint64_t rbase = e.remote_base(m, i, R);
      emit_segment(e, u, run, lbase + run.local_head * L.head_stride, rbase + run.remote_head * R.head_stride,
                   m.local_ppb);
    }
    return;
  }
  const uint64_t kl = L.inner_size();
  const bool runs_outer = u.runs.size() > 1 && L.head_stride > L.outer_stride();
  auto segment = [&](const HeadRun& run, uint64_t p, uint64_t n) {
    const Side& R = u.remote[run.source];
    const uint64_t rp = p + m.delta;
    const uint64_t j = rp / m.remote_ppb;
    const uint64_t lo = lbase + L.pos_offset(p - i * m.local_ppb) + run.local_head * L.head_stride;
    const uint64_t ro = e.remote_base(m, j, R) + R.pos_offset(rp - j * m.remote_ppb) + run.remote_head * R.head_stride;
    emit_segment(e, u, run, lo, ro, n);
  };
  // Segments end at every local and remote kernel-page (inner axis) boundary;
  // block boundaries are among them.
  auto for_segments = [&](auto&& fn) {
    for (uint64_t p = p_begin; p < p_end;) {
      const uint64_t kr = u.remote_inner;
      const uint64_t rp = p + m.delta;
      uint64_t next = std::min({p_end, (p / kl + 1) * kl, (rp / kr + 1) * kr - m.delta});
      fn(p, next - p);
      p = next;
    }
  };
  if (runs_outer) {
    for (const HeadRun& run : u.runs) for_segments([&](uint64_t p, uint64_t n) { segment(run, p, n); });
  } else {
    for_segments([&](uint64_t p, uint64_t n) {
      for (const HeadRun& run : u.runs) segment(run, p, n);
    });
  }
}

// Ends a plan whose descriptors were emitted in `order`: when that was not
// address order, sorts by local address and merges every contiguous pair
// (failing when two descriptors write the same local byte) and recounts the
// descriptors per source; otherwise orders the descriptors by local tensor
// when they did not come tensor by tensor. Sets plan.bytes.
Status finish_plan(const Layout& local, const EmitOrder& order, Plan& plan);

}  // namespace kvbridge::plan_internal
