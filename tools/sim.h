// tools/sim.h: `kvbridge sim`, the costs of P/D disaggregation at scale.
//
// A model of N prefill and M decode instances (TP sizes of their own) of one
// preset, fed by a request stream (Poisson arrivals, log-normal prompt
// lengths, a share of requests reusing a prefix of an earlier one). What is
// real and what is modelled:
//  - which prefill ranks a decode rank reads: the planner's source_ranks()
//    and readers_per_source() on the preset's layouts (real);
//  - the bytes a handshake carries: the layout JSON (to_json()) and the
//    engine metadata (Engine::metadata() of a real engine over the chosen
//    transport, with each tensor registered) measured, framed as
//    docs/formats/handshake.md and framing.md say (computed from the spec);
//  - planning CPU: plan() timed on sampled requests (measured);
//  - etcd operations: a model of the registration scheme (counted from
//    formulas, never measured against etcd);
//  - prefix store: the real chained block hashes (store_key.h) of the
//    requests' tokens, placed on Redis Cluster masters by key slot
//    (sim_slot.h), each master an LRU of a fixed capacity (simulated).
// Connections are counted as a decode rank keeps them: one per prefill rank
// it has ever read (lazily, kept), and, as the connector does today, one per
// rank of every prefill instance it has loaded from (the worker fetches every
// rank's metadata to plan, and connects each engine).
//
// Thread-safety: run_sim() is reentrant (it starts engines only to measure
// their metadata, and stops them before returning).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "kvbridge/status.h"

namespace kvbridge::cli {

struct SimOptions {
  std::string preset = "llama3-70b";
  uint32_t prefill_tp = 8;
  uint32_t decode_tp = 4;
  // The sweep: total ranks per point, split between prefill and decode by
  // prefill_share (in ranks). Ignored when both instance counts are set.
  std::vector<uint32_t> ranks = {16, 32, 64, 128, 256, 512, 1000};
  uint32_t prefill_instances = 0;
  uint32_t decode_instances = 0;
  double prefill_share = 0.5;
  // Pinned routing: each decode instance takes its requests from this many
  // fixed prefill instances, at least as many as cover every prefill
  // instance (the other routing, "any", pairs any with any).
  uint32_t pinned = 1;
  uint64_t requests = 4000;       // per point, routed over the instances
  double rate = 100;              // requests per second, the whole fleet
  uint64_t prompt_tokens = 2048;  // mean prompt length
  double reuse = 0.3;             // share of requests that reuse an earlier prefix
  uint64_t seed = 1;
  uint32_t plan_samples = 200;    // planned and timed per point
  std::string transport = "tcp";  // the engines' transport, for the metadata size
  std::vector<uint32_t> store_nodes = {1, 3, 6, 12};
  double store_node_gib = 64;  // memory of one Redis master for objects
  // The registration model (etcd).
  double lease_ttl_s = 10;
  double churn_per_hour = 1;  // joins (and as many leaves) per instance per hour
  uint32_t routers = 1;       // watchers besides the decode instances
};

// Checks the options that need no layout: kInvalidArgument naming the option.
Status check_sim_options(const SimOptions& options);

// The etcd operations per second of the registration model (docs/scale.md):
// each instance holds one key under its own lease (grant + put when it
// joins, a keep-alive every ttl / 3, a revoke when it leaves: one delete);
// `watchers` hold one watch on the prefix (each put or delete is one event to
// each watcher) and list the prefix once when they (re)start. Churn: each
// instance leaves and rejoins `churn_per_hour` times an hour.
struct EtcdRates {
  double writes = 0;      // lease grants, puts and revokes per second
  double keepalives = 0;  // lease keep-alive requests per second
  double events = 0;      // watch events delivered per second (all watchers)
  double lists = 0;       // range reads of the prefix per second
  double list_keys = 0;   // keys returned by those reads per second
};
EtcdRates etcd_rates(uint32_t instances, uint32_t watchers, double lease_ttl_s, double churn_per_hour);

// One point of the sweep.
struct SimPoint {
  uint32_t prefill_instances = 0, decode_instances = 0;
  uint32_t ranks = 0;  // prefill_instances * prefill_tp + decode_instances * decode_tp
  // Prefill instances each decode instance reads under pinned routing:
  // --pinned, raised to ceil(prefill / decode instances) so that every
  // prefill instance is read.
  uint32_t pinned_group = 0;
  // Per decode rank: prefill ranks of one instance it reads (planner), mean.
  double sources = 0;
  // Handshakes (= connections kept) per decode rank, any and pinned routing.
  double hs_any_mean = 0, hs_any_max = 0, hs_pinned_mean = 0, hs_pinned_max = 0;
  double hs_any_bound = 0, hs_pinned_bound = 0;  // sources x instances that can be read
  // As the connector does today: every rank of each prefill instance read.
  double hs_today_any_mean = 0, hs_today_pinned_mean = 0;
  // Inbound connections per prefill rank.
  double in_any_mean = 0, in_any_max = 0, in_pinned_mean = 0, in_pinned_max = 0;
  double in_any_bound = 0;  // decode instances x the most readers a prefill rank has in one
  double in_today_any_max = 0;
  // Bytes received per rank by handshakes (decode: the Metadata frames and
  // control Accepts; prefill: the Open frames), mean.
  double meta_any_bytes = 0, meta_pinned_bytes = 0, meta_today_any_bytes = 0;
  double meta_prefill_any_bytes = 0;
  uint64_t total_connections_any = 0, total_connections_pinned = 0;
  // plan() per request on one decode rank, microseconds.
  double plan_p50_us = 0, plan_p99_us = 0, plan_descriptors_mean = 0;
  EtcdRates etcd;
};

// The first bounds a fleet meets (docs/formats/framing.md, "The listener's
// bounds"): a prefill rank's tcp server keeps at most 256 streams, and a
// reading decode rank opens up to EngineOptions::tcp_streams (4) of them; an
// engine's control channel takes at most 1024 inbound connections.
inline constexpr uint32_t kTcpServerStreams = 256;
inline constexpr uint32_t kControlInbound = 1024;

// One Redis Cluster size.
struct SimStoreRow {
  uint32_t nodes = 0;
  uint64_t capacity_objects = 0;  // per master
  double ops_per_s_max = 0, ops_per_s_mean = 0;
  uint64_t keys_max = 0, keys_min = 0;  // distinct keys placed per master
  double hit_rate = 0;                  // prompt tokens served from the store / prompt tokens
  uint64_t evictions = 0;
};

struct SimReport {
  SimOptions options;
  uint64_t hash_block_tokens = 0;
  uint64_t object_bytes = 0;       // one object (all stored groups of one hash block), estimated
  uint64_t max_prompt_tokens = 0;  // lengths are cut here (what the layouts' blocks hold)
  double mean_prompt_tokens = 0;
  double duration_s = 0;                  // the arrivals' span
  double reuse_upper_bound = 0;           // shared tokens / prompt tokens (an unbounded store's hit rate)
  std::vector<uint32_t> sources_of_rank;  // per decode rank, prefill ranks of one instance read
  std::vector<uint32_t> readers_of_rank;  // per prefill rank, decode ranks of one instance reading it
  uint64_t layout_json_bytes = 0;         // prefill rank 0's, as sent
  uint64_t engine_metadata_bytes = 0;     // prefill rank 0's
  uint64_t metadata_frame_bytes = 0;      // prefill rank 0's Metadata frame, header included
  uint64_t identity_text_bytes = 0;       // sent only in a mismatch Refuse
  std::vector<SimPoint> points;
  std::vector<SimStoreRow> store;
};

// Runs the model. Errors: kInvalidArgument naming the option (check_sim_options,
// a TP size the preset cannot take, an instance count that gives no rank),
// kNotFound for an unknown preset, a planner's or engine's error otherwise.
Result<SimReport> run_sim(const SimOptions& options);

// Output forms.
std::string sim_table(const SimReport& report);
std::string sim_json(const SimReport& report);
std::string sim_svg(const SimReport& report);

}  // namespace kvbridge::cli
