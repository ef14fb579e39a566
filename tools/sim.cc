// The model behind `kvbridge sim` (sim.h): routing, connections, handshake
// bytes, planning time and the etcd registration model. The workload and the
// prefix store are in sim_store.cc, the output forms in sim_report.cc.

#include "sim.h"

#include <sys/mman.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <memory>
#include <numeric>
#include <random>

#include "kvbridge/engine.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "kvbridge/presets.h"
#include "kvbridge/store_key.h"
#include "sim_slot.h"
#include "sim_store.h"

namespace kvbridge::cli {
namespace {

// Frame sizes of docs/formats/framing.md, handshake.md and control.md,
// without a shared secret (a secret adds a Challenge, a Proof and a 16-byte
// tag per frame).
constexpr uint64_t kFrameHeaderBytes = 16;
// Side channel Open: flags u8, nonce 32, body string (the 8-byte hash).
constexpr uint64_t kSideOpenBytes = kFrameHeaderBytes + 1 + 32 + 4 + 8;
// Control Open: flags, nonce, body string (name string, instance, pid, target).
constexpr uint64_t kDecodeEngineNameBytes = 16;  // e.g. "decode-117-r3" padded: an estimate
constexpr uint64_t kControlOpenBytes = kFrameHeaderBytes + 1 + 32 + 4 + (4 + kDecodeEngineNameBytes + 8 + 8 + 8);
// Control Accept: the server's instance.
constexpr uint64_t kControlAcceptBytes = kFrameHeaderBytes + 8;

Result<std::vector<Layout>> instance_layouts(const SimOptions& o, uint32_t tp, const char* option) {
  std::vector<Layout> out;
  for (uint32_t r = 0; r < tp; ++r) {
    PresetOptions p;
    p.name = o.preset;
    p.tp_size = tp;
    p.tp_rank = r;
    Result<Layout> l = make_preset(p);
    if (!l) {
      if (l.error().code() == Code::kNotFound) return Status::not_found("--preset: " + l.error().message());
      return Status::invalid_argument(std::string(option) + " " + std::to_string(tp) + ": preset '" + o.preset +
                                      "' cannot take it: " + l.error().message());
    }
    out.push_back(std::move(*l));
  }
  return out;
}

// The longest prompt whose blocks fit every instance's block pool, when each
// token-indexed transfer group takes its own ids (overlaid groups share the
// pool) and a state group one id.
uint64_t max_prompt_tokens(const Layout& a, const Layout& b) {
  uint64_t best = UINT64_MAX;
  for (const Layout* l : {&a, &b}) {
    uint64_t token_groups = 0, min_blocks = UINT64_MAX, min_block_tokens = UINT64_MAX;
    for (const Group& g : l->groups) {
      if (!g.transfer) continue;
      min_blocks = std::min(min_blocks, g.num_blocks);
      if (g.kind == GroupKind::kAttention || g.kind == GroupKind::kSlidingWindow) {
        ++token_groups;
        min_block_tokens = std::min(min_block_tokens, g.block_tokens);
      }
    }
    if (token_groups == 0) continue;
    // Keep a few ids for the state and scratch groups.
    const uint64_t ids = min_blocks > 8 ? min_blocks - 8 : 1;
    best = std::min(best, ids / token_groups * min_block_tokens);
  }
  return best == UINT64_MAX ? 1 << 20 : best;
}

// A request of `tokens` tokens between `local` and `remote` with ids drawn
// at random (distinct on each side across groups, as an allocator hands out
// scattered blocks).
Request make_request(const Layout& local, const Layout& remote, uint64_t tokens, std::mt19937_64& rng) {
  Request r;
  r.num_tokens = tokens;
  auto draw = [&](const Layout& l) {
    uint64_t pool = UINT64_MAX;
    for (const Group& g : l.groups) pool = std::min(pool, g.num_blocks);
    std::vector<int64_t> ids(pool);
    std::iota(ids.begin(), ids.end(), 0);
    std::shuffle(ids.begin(), ids.end(), rng);
    return ids;
  };
  const std::vector<int64_t> local_ids = draw(local), remote_ids = draw(remote);
  size_t li = 0, ri = 0;
  for (const Group& g : local.groups) {
    if (!g.transfer) continue;
    const Group* rg = remote.find_group(g.name);
    GroupBlocks b;
    auto list = [&](const Group& group, const std::vector<int64_t>& ids, size_t& next, std::vector<int64_t>& out) {
      if (group.kind == GroupKind::kScratch) {
        out.push_back(ids[next++]);
        return;
      }
      const uint64_t entries = group.entries_for_tokens(tokens);
      for (uint64_t e = 0; e < entries; ++e) {
        // A state group moves its last entry only: the others stay -1.
        out.push_back(group.kind == GroupKind::kState && e + 1 < entries ? -1 : ids[next++]);
      }
    };
    list(g, local_ids, li, b.local);
    if (rg != nullptr) list(*rg, remote_ids, ri, b.remote);
    r.blocks[g.name] = std::move(b);
  }
  return r;
}

// Bytes of prefill rank `rank`'s Metadata frame for instance id "prefill-0",
// with the real layout JSON and the real engine metadata.
struct Measured {
  uint64_t frame_bytes = 0, json_bytes = 0, engine_bytes = 0;
};

Result<Measured> measure_metadata(const Layout& layout, const std::string& transport) {
  Measured m;
  m.json_bytes = to_json(layout, -1).size();
  EngineOptions eo;
  eo.name = "prefill-0-r" + std::to_string(layout.rank());
  eo.transports = {transport};
  eo.threads = 1;
  KVB_ASSIGN_OR_RETURN(std::unique_ptr<Engine> engine, Engine::create(eo));
  // Each tensor in an allocation of its own, as an engine allocates them:
  // reserved address space only (MAP_NORESERVE; never touched), since the
  // metadata lists addresses and sizes, never bytes.
  std::vector<std::pair<void*, uint64_t>> maps;
  Status status;
  for (const Tensor& t : layout.tensors) {
    void* p = mmap(nullptr, t.bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED) {
      status = Status::resource_exhausted("mmap of tensor '" + t.name + "' (" + std::to_string(t.bytes) + " bytes)");
      break;
    }
    maps.emplace_back(p, t.bytes);
    Result<RegionId> id = engine->register_memory(p, t.bytes, "host", RemoteAccess::kRead);
    if (!id) {
      status = id.error();
      break;
    }
  }
  if (status.ok()) m.engine_bytes = engine->metadata().size();
  engine.reset();
  for (auto [p, n] : maps) munmap(p, n);
  if (!status.ok()) return status.with_context("measuring the engine metadata");
  const std::string instance_id = "prefill-0";
  uint64_t tensors = 0;
  for (const Tensor& t : layout.tensors) tensors += 4 + t.name.size() + 4 + 8 + 8;
  m.frame_bytes = kFrameHeaderBytes + 8 + 8 + 4 + 4 + 4 + (4 + instance_id.size()) + (4 + m.json_bytes) +
                  (4 + m.engine_bytes) + 4 + tensors;
  return m;
}

double percentile(std::vector<double> v, double q) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  // The nearest rank: the smallest value with at least q of the values at or below it.
  auto i = static_cast<size_t>(std::ceil(q * double(v.size())));
  return v[std::min(v.size(), std::max<size_t>(i, 1)) - 1];
}

size_t digits(uint64_t v) { return std::to_string(v).size(); }

// The connections of one routing: which prefill instances each decode
// instance has read from, after every request. Pinned routing: decode instance d reads prefill instances (d * k + j)
// mod n, j < k, for k = `group` (pinned_group()), which covers every prefill instance.
std::vector<std::vector<uint32_t>> route(const SimOptions& o, uint32_t n, uint32_t m, bool pinned, uint32_t group,
                                         uint64_t salt) {
  std::mt19937_64 rng(sim_seed(o.seed, salt));
  std::vector<std::vector<bool>> seen(m, std::vector<bool>(n, false));
  std::uniform_int_distribution<uint32_t> pick_d(0, m - 1), pick_p(0, n - 1), pick_k(0, group - 1);
  for (uint64_t i = 0; i < o.requests; ++i) {
    const uint32_t d = pick_d(rng);
    const uint32_t p = pinned ? static_cast<uint32_t>((uint64_t{d} * group + pick_k(rng)) % n) : pick_p(rng);
    seen[d][p] = true;
  }
  std::vector<std::vector<uint32_t>> out(m);
  for (uint32_t d = 0; d < m; ++d) {
    for (uint32_t p = 0; p < n; ++p) {
      if (seen[d][p]) out[d].push_back(p);
    }
  }
  return out;
}

}  // namespace

Status check_sim_options(const SimOptions& o) {
  auto bad = [](const std::string& what) { return Status::invalid_argument(what); };
  if (o.ranks.empty()) return bad("--ranks: give at least one total rank count");
  for (uint32_t r : o.ranks) {
    if (r == 0) return bad("--ranks: 0 is not a rank count (each total must be at least 2: one prefill, one decode)");
    if (r > 65536) return bad("--ranks: " + std::to_string(r) + " ranks is more than the 65536 modelled");
  }
  if (o.prefill_tp == 0) return bad("--prefill-tp: must be at least 1");
  if (o.decode_tp == 0) return bad("--decode-tp: must be at least 1");
  if ((o.prefill_instances == 0) != (o.decode_instances == 0)) {
    return bad("--prefill-instances and --decode-instances: give both or neither");
  }
  if (uint64_t{o.prefill_instances} * o.prefill_tp + uint64_t{o.decode_instances} * o.decode_tp > 65536) {
    return bad("--prefill-instances/--decode-instances: more than the 65536 ranks modelled");
  }
  if (!(o.prefill_share > 0 && o.prefill_share < 1)) return bad("--prefill-share: must be between 0 and 1");
  if (o.pinned == 0) return bad("--pinned: must be at least 1");
  if (o.requests == 0 || o.requests > 1000000) return bad("--requests: must be 1 to 1000000");
  if (!(o.rate > 0) || !std::isfinite(o.rate)) return bad("--rate: must be a positive number of requests per second");
  if (o.prompt_tokens == 0 || o.prompt_tokens > (1u << 20)) return bad("--prompt-tokens: must be 1 to 1048576");
  if (!(o.reuse >= 0 && o.reuse <= 1)) return bad("--reuse: must be a share between 0 and 1");
  if (o.plan_samples == 0 || o.plan_samples > 100000) return bad("--plan-samples: must be 1 to 100000");
  if (o.transport != "tcp" && o.transport != "ucx") return bad("--transport: must be tcp or ucx");
  if (o.store_nodes.empty()) return bad("--store-nodes: give at least one cluster size");
  for (uint32_t n : o.store_nodes) {
    if (n == 0 || n > kClusterSlots) return bad("--store-nodes: " + std::to_string(n) + " is not 1 to 16384 masters");
  }
  if (!(o.store_node_gib > 0) || !std::isfinite(o.store_node_gib)) return bad("--store-node-gib: must be positive");
  if (!(o.lease_ttl_s > 0) || !std::isfinite(o.lease_ttl_s)) return bad("--lease-ttl: must be positive seconds");
  if (!(o.churn_per_hour >= 0) || !std::isfinite(o.churn_per_hour)) return bad("--churn: must be 0 or more");
  return Status();
}

EtcdRates etcd_rates(uint32_t instances, uint32_t watchers, double lease_ttl_s, double churn_per_hour) {
  EtcdRates r;
  const double joins = instances * churn_per_hour / 3600.0;  // and as many leaves
  // A join is a lease grant and a put; a leave a revoke, which deletes the key.
  r.writes = joins * 2 + joins;
  r.keepalives = instances / (lease_ttl_s / 3);
  // Each put and each delete is one event to every watcher.
  r.events = 2 * joins * watchers;
  // A watcher lists the prefix when it (re)starts: the decode instances'
  // own restarts (the routers', assumed rarer, are left out).
  const double watcher_restarts = std::min<double>(watchers, instances) * churn_per_hour / 3600.0;
  r.lists = watcher_restarts;
  r.list_keys = watcher_restarts * instances;
  return r;
}

Result<SimReport> run_sim(const SimOptions& o) {
  KVB_RETURN_IF_ERROR(check_sim_options(o));
  SimReport rep;
  rep.options = o;
  KVB_ASSIGN_OR_RETURN(std::vector<Layout> prefill, instance_layouts(o, o.prefill_tp, "--prefill-tp"));
  KVB_ASSIGN_OR_RETURN(std::vector<Layout> decode, instance_layouts(o, o.decode_tp, "--decode-tp"));

  // Who reads whom inside one pair of instances: the planner's answer.
  for (const Layout& d : decode) {
    KVB_ASSIGN_OR_RETURN(std::vector<uint32_t> s, source_ranks(d, prefill));
    rep.sources_of_rank.push_back(static_cast<uint32_t>(s.size()));
  }
  std::vector<std::vector<uint32_t>> source_sets;
  for (const Layout& d : decode) source_sets.push_back(*source_ranks(d, prefill));
  KVB_ASSIGN_OR_RETURN(std::vector<SourceReaders> readers, readers_per_source(decode, prefill));
  rep.readers_of_rank.assign(o.prefill_tp, 0);
  for (const SourceReaders& s : readers) rep.readers_of_rank[s.rank] = static_cast<uint32_t>(s.readers.size());

  // What a handshake carries, per prefill rank (instance "prefill-0").
  std::vector<uint64_t> frame_bytes;
  for (const Layout& p : prefill) {
    KVB_ASSIGN_OR_RETURN(Measured m, measure_metadata(p, o.transport));
    frame_bytes.push_back(m.frame_bytes);
    if (p.rank() == 0) {
      rep.layout_json_bytes = m.json_bytes;
      rep.engine_metadata_bytes = m.engine_bytes;
      rep.metadata_frame_bytes = m.frame_bytes;
    }
  }
  rep.identity_text_bytes = identity_text(prefill[0]).size();

  // The workload: the same requests at every point.
  rep.hash_block_tokens = store_hash_block_tokens(prefill[0], decode[0]);
  rep.max_prompt_tokens = std::min(max_prompt_tokens(prefill[0], decode[0]), o.prompt_tokens * 8);
  rep.max_prompt_tokens = std::max(rep.max_prompt_tokens, rep.hash_block_tokens);
  const SimWorkload w = make_workload(o, prefill[0], rep.hash_block_tokens, rep.max_prompt_tokens);
  uint64_t total_tokens = 0, shared_tokens = 0;
  for (size_t i = 0; i < w.tokens.size(); ++i) {
    total_tokens += w.tokens[i];
    shared_tokens += w.shared_blocks[i] * rep.hash_block_tokens;
  }
  rep.mean_prompt_tokens = double(total_tokens) / double(w.tokens.size());
  rep.duration_s = w.arrival_s.back();
  rep.reuse_upper_bound = double(shared_tokens) / double(total_tokens);
  {
    uint64_t block_bytes = 0;
    const std::vector<uint64_t> sizes = store_object_bytes(prefill[0], rep.hash_block_tokens);
    for (size_t g = 0; g < prefill[0].groups.size(); ++g) {
      if (stored_group(prefill[0].groups[g])) block_bytes += sizes[g];
    }
    rep.object_bytes = block_bytes;
  }

  // The points of the sweep.
  std::vector<std::pair<uint32_t, uint32_t>> shapes;
  if (o.prefill_instances > 0) {
    shapes.emplace_back(o.prefill_instances, o.decode_instances);
  } else {
    for (uint32_t total : o.ranks) {
      const auto prefill_ranks = static_cast<uint32_t>(std::lround(total * o.prefill_share));
      const uint32_t n = prefill_ranks / o.prefill_tp;
      const uint32_t m = n == 0 ? 0 : (total - n * o.prefill_tp) / o.decode_tp;
      if (n == 0 || m == 0) {
        return Status::invalid_argument(
            "--ranks: " + std::to_string(total) + " ranks cannot hold one prefill instance of TP " +
            std::to_string(o.prefill_tp) + " and one decode instance of TP " + std::to_string(o.decode_tp) +
            " (with --prefill-share " + std::to_string(o.prefill_share).substr(0, 4) + ")");
      }
      shapes.emplace_back(n, m);
    }
  }
  double sources_mean = 0;
  for (uint32_t s : rep.sources_of_rank) sources_mean += s;
  sources_mean /= o.decode_tp;
  uint64_t point_index = 0;
  for (auto [n, m] : shapes) {
    ++point_index;
    SimPoint pt;
    pt.prefill_instances = n;
    pt.decode_instances = m;
    pt.ranks = n * o.prefill_tp + m * o.decode_tp;
    pt.sources = sources_mean;
    pt.hs_any_bound = sources_mean * n;
    // Pinned: --pinned prefill instances per decode instance, or more when
    // there are more prefill instances than that covers (each must be read).
    pt.pinned_group = std::min(n, std::max(o.pinned, (n + m - 1) / m));
    pt.hs_pinned_bound = sources_mean * pt.pinned_group;
    pt.in_any_bound = double(m) * *std::max_element(rep.readers_of_rank.begin(), rep.readers_of_rank.end());
    for (bool pinned : {false, true}) {
      const std::vector<std::vector<uint32_t>> seen =
          route(o, n, m, pinned, pt.pinned_group, 100 + point_index * 2 + pinned);
      double hs_sum = 0, hs_max = 0, today_sum = 0, meta_sum = 0, today_meta_sum = 0;
      std::vector<double> inbound(uint64_t{n} * o.prefill_tp, 0), today_in(uint64_t{n} * o.prefill_tp, 0);
      uint64_t total = 0;
      for (uint32_t d = 0; d < m; ++d) {
        for (uint32_t r = 0; r < o.decode_tp; ++r) {
          const double hs = double(seen[d].size()) * rep.sources_of_rank[r];
          hs_sum += hs;
          hs_max = std::max(hs_max, hs);
          total += static_cast<uint64_t>(hs);
          today_sum += double(seen[d].size()) * o.prefill_tp;
          for (uint32_t p : seen[d]) {
            // The instance id "prefill-<p>" is longer than "prefill-0" by its extra digits.
            for (uint32_t q : source_sets[r]) meta_sum += frame_bytes[q] + digits(p) - 1 + kControlAcceptBytes;
            for (uint32_t q = 0; q < o.prefill_tp; ++q) {
              today_meta_sum += frame_bytes[q] + digits(p) - 1 + kControlAcceptBytes;
            }
          }
        }
        for (uint32_t p : seen[d]) {
          for (uint32_t q = 0; q < o.prefill_tp; ++q) {
            inbound[uint64_t{p} * o.prefill_tp + q] += rep.readers_of_rank[q];
            today_in[uint64_t{p} * o.prefill_tp + q] += o.decode_tp;
          }
        }
      }
      const double decode_ranks = double(m) * o.decode_tp;
      const double in_mean = std::accumulate(inbound.begin(), inbound.end(), 0.0) / double(inbound.size());
      const double in_max = *std::max_element(inbound.begin(), inbound.end());
      if (!pinned) {
        pt.hs_any_mean = hs_sum / decode_ranks;
        pt.hs_any_max = hs_max;
        pt.hs_today_any_mean = today_sum / decode_ranks;
        pt.in_any_mean = in_mean;
        pt.in_any_max = in_max;
        pt.in_today_any_max = *std::max_element(today_in.begin(), today_in.end());
        pt.meta_any_bytes = meta_sum / decode_ranks;
        pt.meta_today_any_bytes = today_meta_sum / decode_ranks;
        pt.meta_prefill_any_bytes = in_mean * (kSideOpenBytes + kControlOpenBytes);
        pt.total_connections_any = total;
      } else {
        pt.hs_pinned_mean = hs_sum / decode_ranks;
        pt.hs_pinned_max = hs_max;
        pt.hs_today_pinned_mean = today_sum / decode_ranks;
        pt.in_pinned_mean = in_mean;
        pt.in_pinned_max = in_max;
        pt.meta_pinned_bytes = meta_sum / decode_ranks;
        pt.total_connections_pinned = total;
      }
    }

    // Planning: plan() on sampled requests, timed, into decode rank i % TP:
    // the cost of a load of a shape not seen before (its template's
    // create() plans as plan() does); loads of a known shape cost less.
    std::mt19937_64 rng(sim_seed(o.seed, 7 + point_index));
    std::vector<double> us;
    double descriptors = 0;
    const uint64_t samples = std::min<uint64_t>(o.plan_samples, w.tokens.size());
    // A few plans first, so that the timed ones find the caches and the
    // allocator warm, as a serving rank's would be.
    for (uint64_t s = 0; s < std::min<uint64_t>(samples, 8); ++s) {
      const Layout& local = decode[s % o.decode_tp];
      (void)plan(local, prefill, make_request(local, prefill[0], w.tokens[s], rng));
    }
    for (uint64_t s = 0; s < samples; ++s) {
      const size_t i = static_cast<size_t>(s * w.tokens.size() / samples);
      const Layout& local = decode[s % o.decode_tp];
      const Request req = make_request(local, prefill[0], w.tokens[i], rng);
      const auto t0 = std::chrono::steady_clock::now();
      Result<Plan> p = plan(local, prefill, req);
      const auto t1 = std::chrono::steady_clock::now();
      if (!p) return p.error().with_context("planning a sampled request of " + std::to_string(w.tokens[i]) + " tokens");
      us.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
      descriptors += double(p->descriptors.size());
    }
    pt.plan_p50_us = percentile(us, 0.5);
    pt.plan_p99_us = percentile(us, 0.99);
    pt.plan_descriptors_mean = descriptors / double(samples);
    pt.etcd = etcd_rates(n + m, m + o.routers, o.lease_ttl_s, o.churn_per_hour);
    rep.points.push_back(pt);
  }

  rep.store = simulate_store(o, w, prefill[0], rep.hash_block_tokens, rep.duration_s);
  return rep;
}

}  // namespace kvbridge::cli
