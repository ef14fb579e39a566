// tools/demo_ranks.h: the rank processes of `kvbridge demo` as the driver
// holds them: forked before any thread exists, each with its channel;
// polled for their messages; told where their peers are once every rank
// is ready; killed and reaped when the demo ends.
#pragma once

#include <sys/types.h>

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "demo.h"

namespace kvbridge::cli::demo {

struct Proc {
  pid_t pid = -1;
  Channel ch;
  std::string instance, engine, side_channel;
  std::vector<std::string> listeners;
  uint32_t rank = 0, decode_instance = 0;
  bool prefill = false, alive = true, ready = false, killed = false;
  std::optional<nlohmann::json> final;
};

class Ranks {
 public:
  Ranks() = default;
  Ranks(const Ranks&) = delete;
  Ranks& operator=(const Ranks&) = delete;
  // Kills (SIGKILL) the ranks still alive and reaps every one.
  ~Ranks();

  // Forks the prefill instance's ranks, then each decode instance's, each
  // child running rank_main() with its config (`num_blocks`,
  // `state_blocks`: the pools' sizes). Call before any thread exists in
  // this process.
  Status spawn(const DemoArgs& args, uint64_t num_blocks, uint64_t state_blocks);
  // Waits up to `wait` for messages, and hands each alive rank's to
  // `message`; a rank whose channel ended or failed goes to `lost` after
  // its messages.
  void poll(std::chrono::milliseconds wait, const std::function<void(Proc&, nlohmann::json&)>& message,
            const std::function<void(Proc&)>& lost);
  // Once every rank is ready: tells the ranks where their peers are
  // (decode ranks, and push-mode prefill ranks, the prefill instance;
  // prefill ranks every decode instance; with --etcd, prefill rank 0
  // registers the instance and decode ranks discover it).
  Status connect(const DemoArgs& args);

  // The alive ranks of the prefill instance, or of decode instance `inst`.
  std::vector<Proc*> of(bool prefill, uint32_t inst) const;
  const std::vector<std::unique_ptr<Proc>>& all() const { return procs_; }

 private:
  std::vector<std::unique_ptr<Proc>> procs_;
};

}  // namespace kvbridge::cli::demo
