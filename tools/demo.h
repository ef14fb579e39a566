// tools/demo.h: `kvbridge demo`, the P/D demo with real processes.
//
// The driver (this process) plays both instances' schedulers and the router
// in front of them: it forks one process per rank (a prefill instance of
// --prefill-tp ranks and --decode-instances decode instances of --decode-tp
// ranks), allocates block ids from per-instance block pools, and sends each
// rank commands over a socketpair as JSON lines. Prefill ranks fill their
// blocks with a deterministic function of the KV's semantic coordinates
// (content.h); decode ranks pull through ConnectorWorker (handshake, plan,
// engine reads), check every byte, and at the end scan their whole memory for
// any byte outside what the requests still hold (a write outside the plan or
// a late write after abort). Leases, heartbeats and done messages run as in
// production: decode workers tell prefill workers, which tell the driver.
//
// Thread-safety: the driver is single-threaded; each rank process runs its
// command loop on one thread plus the connector's and engine's threads.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "kvbridge/connector.h"
#include "kvbridge/status.h"

namespace kvbridge::cli::demo {

struct SideArgs {
  uint32_t tp = 1;
  uint32_t pp = 1;  // pipeline stages: tp * pp ranks, stage by stage
  uint32_t ranks() const { return tp * pp; }
  uint64_t block_tokens = 0;         // 0: the preset's
  uint64_t kernel_block_tokens = 0;  // 0: the preset's
  std::string order = "LBHNC";
  std::string netns;               // run the ranks in this network namespace
  std::string host = "127.0.0.1";  // address the ranks listen on
  uint32_t dcp = 1;                // context shards over groups of dcp TP ranks (presets.h)
  uint64_t dcp_interleave = 1;     // tokens per chunk dealt to a shard
};

// What --inject can do; each is one of the fault cases.
enum class Inject : uint8_t {
  kNone,
  kKillPrefill,
  kKillDecode,
  kDropNotification,
  kStall,
  kVersion,
  kHash,
  kWrongSecret,
  kMissingSecret,
  kMalformed,
  kTruncated,
  kAbort,
  kLease,
  kPause,
  kCorrupt,  // a decode rank flips one byte of a loaded request's KV: the check must find it
};
Result<Inject> parse_inject(std::string_view name);
std::string_view inject_name(Inject inject);
std::string inject_names();  // for --help

struct DemoArgs {
  std::string preset = "qwen3-next";
  // Block sizes 0 take the preset's; with the default preset and no block
  // option given, the CLI picks 64 (prefill) and 128 (decode) tokens.
  SideArgs prefill{2, 1, 0, 0, "BLHNC", "", "127.0.0.1"};
  SideArgs decode{4, 1, 0, 0, "LBHNC", "", "127.0.0.1"};
  uint32_t decode_instances = 1;
  uint32_t requests = 12;
  uint64_t num_blocks = 0;  // 0: enough for the requests
  uint64_t max_tokens = 0;  // 0: the preset's choice
  uint64_t min_tokens = 1;  // shortest request
  uint64_t seed = 1;
  std::string transport = "cma";
  // "host", or "cuda": every rank's KV in device memory (rank r on GPU
  // r mod the device count; ranks share GPUs when there are fewer), moved
  // over cuda_ipc, filled and checked through the device.
  std::string memory = "host";
  std::string policy = "fail";
  std::string secret;
  Inject inject = Inject::kNone;
  std::chrono::milliseconds lease{30000};
  std::chrono::milliseconds inject_after{40};  // kill-prefill, kill-decode, abort: after the load starts
  std::chrono::milliseconds transfer_timeout{20000};
  bool verify_plans = false;    // each decode rank checks every plan with verify() first
  bool verify_content = false;  // every byte moved is hashed at its source and where it landed
  bool pin_cores = false;       // each rank process on its own core (round-robin over the allowed ones)
  uint64_t chunk_tokens = WorkerOptions{}.load_chunk_tokens;  // WorkerOptions::load_chunk_tokens
  // Layer-wise streaming: "off", "layer" (every request streams) or "auto"
  // (requests of at least stream_min_tokens stream). With it on and no
  // fault injected, each request runs again after itself, the same size,
  // not streamed: the same run's baseline for the TTFT figures.
  std::string stream = "off";
  // Who moves the bytes: "pull" (decode ranks read) or "push" (prefill
  // ranks write into the decode ranks' blocks).
  std::string mode = "pull";
  uint32_t layers_per_stage = WorkerOptions{}.stream_layers_per_stage;
  uint64_t stream_min_tokens = 0;  // auto: 0 takes kAutoStreamTokens
  // Prefill ranks spend this long computing each layer (a busy loop of
  // multiply-adds, not a sleep) before writing and saving it.
  uint64_t compute_us_per_layer = 0;
  // --memory cuda, streamed: each layer's device write is queued behind a
  // kernel that takes this long, and announced at once (as an engine
  // announces a layer its kernels still write): a reader that did not wait
  // for the layer's event would read it before it lands.
  uint64_t producer_delay_us = 0;
  // Idle connections to each listener of each prefill rank while the first
  // half of the requests runs (the second half is the same run's baseline).
  uint32_t flood = 0;
  // etcd's client URL: prefill rank 0 registers the prefill instance there
  // (its ranks' side channels, under a lease) and each decode rank finds it
  // through a Watcher instead of being given the addresses (pull mode).
  std::string etcd;
  bool json = false;
  bool progress = true;
};

// --stream auto streams requests of at least this many tokens: below it an
// engine whose prefill is bound by its CPU thread pays the per-layer
// announcements on top of its compute and gains little from the overlap
// (measured with the demo's own reruns while its announcements were on the
// critical path: docs/connector.md, "When streaming pays").
inline constexpr uint64_t kAutoStreamTokens = 512;

// Runs the demo; returns the exit code (0: every request ended cleanly as the
// injected fault predicts, nothing leaked, nothing stray).
int run(const DemoArgs& args);

// ---------------------------------------------------------------------------
// Between driver and ranks.

// A socket carrying JSON objects, one per line.
class Channel {
 public:
  explicit Channel(int fd = -1) : fd_(fd) {}
  ~Channel();
  Channel(Channel&& o) noexcept : fd_(o.fd_), in_(std::move(o.in_)) { o.fd_ = -1; }
  Channel& operator=(Channel&& o) noexcept {
    if (this != &o) {
      close();
      fd_ = o.fd_;
      in_ = std::move(o.in_);
      o.fd_ = -1;
    }
    return *this;
  }
  int fd() const { return fd_; }
  Status send(const nlohmann::json& message);
  // Reads what is available; appends whole messages. kIoError at end of
  // stream (the other side exited), kInvalidArgument for a bad line.
  Status receive(std::vector<nlohmann::json>& out);
  void close();

 private:
  int fd_;
  std::string in_;
};

// What a rank process is told at fork.
struct RankConfig {
  std::string instance;  // "prefill" or "decode-N"
  bool prefill = false;
  uint32_t rank = 0;
  uint64_t num_blocks = 0;
  uint64_t state_blocks = 0;  // PresetOptions::state_blocks
  SideArgs side;
  const DemoArgs* args = nullptr;
};

// The body of a rank process: never returns.
[[noreturn]] void rank_main(const RankConfig& config, int fd);

}  // namespace kvbridge::cli::demo
