// tools/demo_driver.h: the driver side of `kvbridge demo` (demo.h): the
// records it keeps while the demo runs, which demo_report.cc turns into the
// table and the JSON object.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>

#include "demo.h"
#include "kvbridge/connector.h"

namespace kvbridge::cli::demo {

// One request as the driver saw it end.
struct RequestRecord {
  uint64_t n = 0;  // the driver's number for it (seeds its content)
  RequestId id;    // "req-<n>"
  uint32_t decode_instance = 0;
  uint64_t tokens = 0, skip = 0;
  uint64_t recompute_from = 0;  // recomputed: the token the engine recomputed from
  std::string outcome;          // finished, failed, recompute(d), aborted, lease_expired
  std::string error;            // the first error, when not finished
  uint64_t bytes = 0;           // summed over decode ranks
  uint64_t descriptors = 0;     // summed over decode ranks
  uint64_t naive = 0;
  uint64_t transfer_us = 0;        // slowest decode rank
  uint64_t start_ns = 0;           // slowest decode rank's start_load call
  uint64_t completion_lag_us = 0;  // slowest decode rank: its last byte landing to its result
  uint64_t raw_us = 0;             // slowest decode rank, raw process_vm_readv
  bool flooded = false;            // ran while --flood held its connections
  uint64_t verify_bad = 0;         // cells that did not check
  std::string verify_error;
  bool streamed = false;     // loaded layer by layer while the prefill computed
  double ttft_ms = 0;        // admitted at prefill -> every decode rank has all its KV
  double exposed_ms = 0;     // the prefill's last layer done -> every decode rank has all its KV
  double last_stage_ms = 0;  // the slowest rank's last stage's reads (pull; streamed: about one layer's)
};

struct Summary {
  const DemoArgs* args = nullptr;
  std::vector<RequestRecord> requests;
  std::vector<RequestRecord> baselines;  // --stream: each request again, not streamed
  uint64_t leaked_blocks = 0, double_frees = 0, stray_bytes = 0;
  std::string first_stray;
  uint64_t handshakes = 0, handshakes_rejected = 0, notifications_failed = 0, plans_verified = 0;
  uint64_t content_checked = 0, content_check_failures = 0;  // the engines' content check (verify_content)
  // tcp's bulk data frames (all, their bytes, those under 1 MiB) and the
  // chunks staged through pinned host memory, over every rank.
  uint64_t wire_frames = 0, wire_bytes = 0, wire_small_frames = 0, staged_chunks = 0;
  std::string last_rejection, last_notification_error;
  std::map<std::string, uint64_t> releases;  // by ReleaseReason name
  std::vector<std::string> rank_errors;      // fatal errors and abnormal exits
  double seconds = 0;
  uint64_t num_blocks = 0;
  uint64_t state_blocks = 0;  // slots of the state pool (0: none)
  // Every rank's listening sockets ("engine host:port"), and how many are
  // not on the host its side was told to use.
  std::vector<std::string> listeners;
  uint64_t listeners_elsewhere = 0;
  // --flood: connections the floods opened, and the busiest listener thread
  // of a prefill rank (percent of one core) while they were held.
  uint64_t flood_connections = 0;
  uint32_t flood_listeners = 0;
  double listener_cpu_max_pct = 0;
  std::string listener_cpu_max_thread;
  uint64_t pauses = 0;  // --inject pause: times a prefill rank was stopped
  // --etcd: decode ranks that found the prefill instance there, and the
  // longest time one took (from its "discover" command to the instance known
  // to its worker).
  uint32_t discovered = 0;
  double discovery_ms_max = 0;
  // --compute-us-per-layer: layers the prefill ranks computed, and those
  // whose KV write alone took longer than the layer's time.
  uint64_t prefill_layers = 0, prefill_layers_over_budget = 0;
};

// Prints the table (or with --json one object) to stdout.
void print_report(const Summary& s);
// A bar of `done` of `total` requests on stderr, where stderr is a terminal.
void print_progress(uint32_t done, uint32_t total);
// Adds what rank `engine` reported as it finished (its "final" message:
// stray bytes, handshakes, wire and content counters) to `s`.
void add_final(Summary& s, const std::string& engine, const nlohmann::json& final);
// Whether the run is clean for its --inject (the exit code).
bool clean(const Summary& s);

}  // namespace kvbridge::cli::demo
