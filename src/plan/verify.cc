// verify(): executes a plan against simulated memory and checks every byte.
//
// Written without the planner's helpers: its own rules for which positions
// move (plan/moving.h, shared with content.cc, not with the planner), its
// own remote-rank lookup (any rank holding the global head is a
// valid source: the verifier checks the bytes, not the planner's choice), and
// cell addresses from cell_offset() one cell at a time.
#include <algorithm>
#include <array>
#include <cstring>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

#include "common/text.h"
#include "kvbridge/verify.h"
#include "plan/moving.h"

namespace kvbridge {
namespace {

using plan_internal::mix;
using plan_internal::Moving;
using plan_internal::moving_positions;

constexpr uint64_t kPage = 4096;
using plan_internal::kFinalState;

// The pattern of a cell: a function of its semantic coordinate only.
struct Coordinate {
  uint64_t group, layer, component, position, head;
  uint64_t seed() const { return mix(mix(mix(mix(mix(group) ^ layer) ^ component) ^ position) ^ head); }
};

uint8_t pattern_byte(uint64_t seed, uint64_t k) { return static_cast<uint8_t>(mix(seed + k / 8) >> (8 * (k % 8))); }

// The whole pattern of a cell of `n` bytes into `out`, a word at a time (the
// same bytes as pattern_byte).
void pattern(uint64_t seed, uint64_t n, std::vector<uint8_t>& out) {
  out.resize(n);
  uint64_t k = 0;
  for (; k + 8 <= n; k += 8) {
    const uint64_t w = mix(seed + k / 8);
    for (int b = 0; b < 8; ++b) out[k + b] = static_cast<uint8_t>(w >> (8 * b));
  }
  for (; k < n; ++k) out[k] = pattern_byte(seed, k);
}

// Memory that exists only where it is touched; untouched bytes read as a
// function of (space, tensor, offset), which no cell pattern matches by design
// of the seeds (different mixing input).
class SparseMemory {
 public:
  explicit SparseMemory(uint64_t space) : space_(space) {}

  void write(uint16_t tensor, uint64_t off, const uint8_t* data, uint64_t n) {
    while (n > 0) {
      uint8_t* page = page_of(tensor, off);
      const uint64_t in = off % kPage, take = std::min(n, kPage - in);
      std::memcpy(page + in, data, take);
      off += take;
      data += take;
      n -= take;
    }
  }
  void read(uint16_t tensor, uint64_t off, uint8_t* data, uint64_t n) {
    while (n > 0) {
      uint8_t* page = page_of(tensor, off);
      const uint64_t in = off % kPage, take = std::min(n, kPage - in);
      std::memcpy(data, page + in, take);
      off += take;
      data += take;
      n -= take;
    }
  }
  // Fills a fresh page with a function of (space, tensor, address), a word
  // at a time. Cell patterns mix a different input, so they never line up.
  void untouched(uint16_t tensor, uint64_t base, uint8_t* page) const {
    const uint64_t key = mix(~(space_ * 0x10001 + tensor));
    for (uint64_t i = 0; i < kPage; i += 8) {
      const uint64_t w = mix(key ^ ((base + i) >> 3));
      std::memcpy(page + i, &w, 8);
    }
  }

 private:
  uint8_t* page_of(uint16_t tensor, uint64_t off) {
    const uint64_t key = (uint64_t{tensor} << 44) | (off / kPage);
    auto& slot = pages_[key];
    if (!slot) {
      slot = std::make_unique<std::array<uint8_t, kPage>>();
      untouched(tensor, off / kPage * kPage, slot->data());
    }
    return slot->data();
  }
  uint64_t space_;
  std::unordered_map<uint64_t, std::unique_ptr<std::array<uint8_t, kPage>>> pages_;
};

struct Interval {
  uint16_t tensor;
  uint64_t begin, end;
  bool operator<(const Interval& o) const { return tensor != o.tensor ? tensor < o.tensor : begin < o.begin; }
};

std::vector<Interval> merged(std::vector<Interval> v) {
  std::sort(v.begin(), v.end());
  std::vector<Interval> out;
  for (const Interval& i : v) {
    if (!out.empty() && out.back().tensor == i.tensor && out.back().end >= i.begin) {
      out.back().end = std::max(out.back().end, i.end);
    } else {
      out.push_back(i);
    }
  }
  return out;
}

uint16_t tensor_index(const Layout& l, const std::string& name) {
  return static_cast<uint16_t>(l.find_tensor(name) - l.tensors.data());
}

// Fills, in remote rank `r`'s memory, every cell that holds a moving position
// of the request (every head the rank holds) with its pattern. Everything else
// keeps its untouched value, so a plan reading a wrong position, head, block
// or an earlier state reads bytes that match no expected pattern.
void fill_remote(const Layout& local, const Layout& r, const Request& request, SparseMemory& mem) {
  std::vector<uint8_t> buf;
  for (size_t gi = 0; gi < local.groups.size(); ++gi) {
    const Group& lg = local.groups[gi];
    const Group* g = r.find_group(lg.name);
    auto it = request.blocks.find(lg.name);
    if (g == nullptr || it == request.blocks.end() || !lg.transfer) continue;
    const std::vector<int64_t>& ids = it->second.remote;
    const uint64_t ppb = g->positions_per_block();
    const Moving m = moving_positions(*g, request, request.skip_tokens);
    for (uint64_t p = m.first; p < m.last; ++p) {
      // A context-sharded rank holds its shard's positions, numbered densely.
      if (!g->context.holds(p)) continue;
      const uint64_t at = g->context.local_of(p);
      uint64_t entry = at / ppb, in_block = at % ppb, semantic = p;
      if (g->kind == GroupKind::kState) {
        entry = ids.size() - 1;
        in_block = 0;
        semantic = kFinalState;
      }
      if (entry >= ids.size() || ids[entry] < 0) continue;
      const uint64_t block = static_cast<uint64_t>(ids[entry]);
      for (size_t l = 0; l < g->layers.size(); ++l) {
        for (size_t c = 0; c < g->layers[l].components.size(); ++c) {
          const Component& comp = g->layers[l].components[c];
          if (comp.empty()) continue;
          const uint16_t t = tensor_index(r, comp.tensor);
          for (uint64_t h = 0; h < comp.local_heads(); ++h) {
            const uint64_t global = comp.heads ? comp.heads->first + h : 0;
            pattern(Coordinate{gi, l, c, semantic, global}.seed(), comp.cell_bytes, buf);
            mem.write(t, *cell_offset(comp, {block, h, in_block}), buf.data(), buf.size());
          }
        }
      }
    }
  }
}

}  // namespace

Result<VerifyReport> verify(const Plan& plan, const Layout& local, std::span<const Layout> remotes,
                            const Request& request, bool check_minimal) {
  KVB_RETURN_IF_ERROR(validate(local).with_context("local layout"));
  for (const Layout& r : remotes) {
    KVB_RETURN_IF_ERROR(validate(r).with_context("remote rank " + std::to_string(r.rank())));
    KVB_RETURN_IF_ERROR(check_compatible(local, r).with_context("remote rank " + std::to_string(r.rank())));
  }
  VerifyReport report;
  SparseMemory local_mem(0);
  std::vector<SparseMemory> remote_mem;
  std::vector<bool> used(remotes.size(), false);
  for (const Descriptor& d : plan.descriptors) {
    if (d.source < used.size()) used[d.source] = true;
  }
  remote_mem.reserve(remotes.size());
  for (size_t r = 0; r < remotes.size(); ++r) {
    remote_mem.emplace_back(r + 1);
    if (used[r]) fill_remote(local, remotes[r], request, remote_mem.back());
  }

  // Execute, checking bounds and collecting written ranges.
  std::vector<Interval> written;
  std::vector<uint8_t> buf;
  for (size_t i = 0; i < plan.descriptors.size(); ++i) {
    const Descriptor& d = plan.descriptors[i];
    const std::string which = "descriptor " + std::to_string(i);
    if (d.bytes == 0) return Status::internal(which + " has zero length");
    if (d.source >= remotes.size()) return Status::internal(which + " names source " + std::to_string(d.source));
    const Layout& r = remotes[d.source];
    if (d.local_tensor >= local.tensors.size() || d.remote_tensor >= r.tensors.size()) {
      return Status::internal(which + " names a tensor that does not exist");
    }
    const Tensor& lt = local.tensors[d.local_tensor];
    const Tensor& rt = r.tensors[d.remote_tensor];
    if (d.local_offset > lt.bytes || d.bytes > lt.bytes - d.local_offset) {
      return Status::internal(which + " local range [" + std::to_string(d.local_offset) + ", +" +
                              std::to_string(d.bytes) + ") is outside tensor " + q(lt.name) + " (" +
                              std::to_string(lt.bytes) + " bytes)");
    }
    if (d.remote_offset > rt.bytes || d.bytes > rt.bytes - d.remote_offset) {
      return Status::internal(which + " remote range [" + std::to_string(d.remote_offset) + ", +" +
                              std::to_string(d.bytes) + ") is outside remote rank " + std::to_string(r.rank()) +
                              " tensor " + q(rt.name) + " (" + std::to_string(rt.bytes) + " bytes)");
    }
    buf.resize(d.bytes);
    remote_mem[d.source].read(d.remote_tensor, d.remote_offset, buf.data(), d.bytes);
    local_mem.write(d.local_tensor, d.local_offset, buf.data(), d.bytes);
    written.push_back({d.local_tensor, d.local_offset, d.local_offset + d.bytes});
    report.bytes_written += d.bytes;
  }
  {
    std::vector<Interval> w = written;
    std::sort(w.begin(), w.end());
    for (size_t i = 1; i < w.size(); ++i) {
      if (w[i].tensor == w[i - 1].tensor && w[i].begin < w[i - 1].end) {
        return Status::internal("local tensor " + q(local.tensors[w[i].tensor].name) + " bytes from " +
                                std::to_string(w[i].begin) + " are written twice");
      }
    }
  }

  // Check every cell the request moves, by the verifier's own rules.
  std::vector<Interval> expected;
  std::vector<uint8_t> want_cell, got_cell;
  for (size_t gi = 0; gi < local.groups.size(); ++gi) {
    const Group& g = local.groups[gi];
    if (!g.transfer) continue;
    auto it = request.blocks.find(g.name);
    if (it == request.blocks.end()) return Status::invalid_argument("request lacks group " + q(g.name));
    const std::vector<int64_t>& ids = it->second.local;
    const uint64_t ppb = g.positions_per_block();
    const Moving mv = moving_positions(g, request, request.skip_tokens);
    const uint64_t first = mv.first, last = mv.last;
    for (uint64_t p = first; p < last; ++p) {
      if (!g.context.holds(p)) continue;
      const uint64_t at = g.context.local_of(p);
      uint64_t entry = at / ppb, in_block = at % ppb, semantic = p;
      if (g.kind == GroupKind::kState) {
        entry = ids.size() - 1;
        in_block = 0;
        semantic = kFinalState;
      }
      if (entry >= ids.size() || ids[entry] < 0) {
        return Status::invalid_argument("group " + q(g.name) + " local list has no block for position " +
                                        std::to_string(p));
      }
      const uint64_t block = static_cast<uint64_t>(ids[entry]);
      for (size_t l = 0; l < g.layers.size(); ++l) {
        for (size_t c = 0; c < g.layers[l].components.size(); ++c) {
          const Component& comp = g.layers[l].components[c];
          if (comp.empty()) continue;
          const uint16_t t = tensor_index(local, comp.tensor);
          for (uint64_t h = 0; h < comp.local_heads(); ++h) {
            const uint64_t global = comp.heads ? comp.heads->first + h : 0;
            Result<uint64_t> off = cell_offset(comp, {block, h, in_block});
            if (!off) return off.error();
            pattern(Coordinate{gi, l, c, semantic, global}.seed(), comp.cell_bytes, want_cell);
            got_cell.resize(comp.cell_bytes);
            local_mem.read(t, *off, got_cell.data(), comp.cell_bytes);
            for (uint64_t k = 0; k < comp.cell_bytes && got_cell != want_cell; ++k) {
              const uint8_t got = got_cell[k], want = want_cell[k];
              if (got != want) {
                char hex[64];
                std::snprintf(hex, sizeof(hex), "holds 0x%02x, expected 0x%02x", got, want);
                return Status::internal("local tensor " + q(comp.tensor) + " offset " + std::to_string(*off + k) +
                                        " (group " + q(g.name) + " layer " + q(g.layers[l].name) + " component " +
                                        q(comp.name) + " position " +
                                        (semantic == kFinalState ? std::string("final-state") : std::to_string(p)) +
                                        " head " + std::to_string(global) + " byte " + std::to_string(k) + ") " + hex);
              }
            }
            expected.push_back({t, *off, *off + comp.cell_bytes});
            report.cells_checked += 1;
            report.bytes_checked += comp.cell_bytes;
          }
        }
      }
    }
  }

  // The plan writes exactly the expected bytes: nothing else changed.
  std::vector<Interval> want = merged(std::move(expected)), got = merged(std::move(written));
  for (size_t i = 0; i < std::max(want.size(), got.size()); ++i) {
    if (i >= want.size() || i >= got.size() || want[i].tensor != got[i].tensor || want[i].begin != got[i].begin ||
        want[i].end != got[i].end) {
      const Interval& bad = i < got.size() ? got[i] : want[i];
      return Status::internal("the plan's writes differ from the request's cells near local tensor " +
                              q(local.tensors[bad.tensor].name) + " bytes [" + std::to_string(bad.begin) + ", " +
                              std::to_string(bad.end) + ")" +
                              (i < got.size() ? " (written by the plan)" : " (expected, not written)"));
    }
  }

  if (check_minimal) {
    std::vector<Descriptor> ds = plan.descriptors;
    std::sort(ds.begin(), ds.end(), [](const Descriptor& a, const Descriptor& b) {
      return a.local_tensor != b.local_tensor ? a.local_tensor < b.local_tensor : a.local_offset < b.local_offset;
    });
    for (size_t i = 1; i < ds.size(); ++i) {
      const Descriptor& a = ds[i - 1];
      const Descriptor& b = ds[i];
      if (a.local_tensor == b.local_tensor && a.local_offset + a.bytes == b.local_offset && a.source == b.source &&
          a.remote_tensor == b.remote_tensor && a.remote_offset + a.bytes == b.remote_offset) {
        return Status::internal("the plan is not minimal: descriptors at local tensor " +
                                q(local.tensors[a.local_tensor].name) + " offsets " + std::to_string(a.local_offset) +
                                " and " + std::to_string(b.local_offset) + " can be merged");
      }
    }
  }
  return report;
}

}  // namespace kvbridge
