// connector/resend.h: worker-to-worker messages that must arrive (a reader's
// done, a layer's announcement), sent as engine notifications and sent again
// when their acknowledgement does not come within one try's time, until a
// deadline. A receiver takes each such message once (it counts a reader once,
// takes a layer once), so a repeat is harmless and a lost one costs a try,
// not a stranded hold or a failed load.
//
// Tries that time out are queued for retry_due(), which the worker's pump
// calls after `wake`: callbacks run on engine threads, and sending from them
// could race the engine's teardown.
//
// Thread-safety: every method from any thread. The callbacks hold only
// shared state, so they may outlive this.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvbridge/engine.h"

namespace kvbridge::connector {

class Resender {
 public:
  using Clock = std::chrono::steady_clock;
  // What the message came to: OK with the receiver's answer, or the last
  // try's error (kTimeout once `give_up` passed). Runs once, on an engine
  // thread or the caller's; must not block.
  using Done = std::function<void(Status, std::string)>;

  // `attempt`: how long one try waits for its acknowledgement. `wake` asks
  // for a call of retry_due() soon (it must not block or call back into
  // this). The engine must outlive this.
  Resender(Engine& engine, std::chrono::milliseconds attempt, std::function<void()> wake);

  // Sends `message` to `peer`, and again after each try that timed out,
  // until `give_up`. `done` may be empty.
  void send(PeerId peer, std::string message, Clock::time_point give_up, Done done);
  // Sends again the messages whose try timed out.
  void retry_due();

 private:
  struct Item {
    PeerId peer = 0;
    std::string message;
    Clock::time_point give_up;
    Done done;
  };
  struct Due {
    std::mutex mu;
    std::vector<Item> items;
  };
  void try_once(Item item);

  Engine& engine_;
  const std::chrono::milliseconds attempt_;
  const std::function<void()> wake_;
  const std::shared_ptr<Due> due_ = std::make_shared<Due>();
};

}  // namespace kvbridge::connector
