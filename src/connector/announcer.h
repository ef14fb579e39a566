// connector/announcer.h: the prefill side of layer-wise streaming. For each
// streamed request, the layers the rank has saved and the decode instance
// whose ranks read it; every saved layer is announced to every rank of that
// instance as "kvb/1 ready <request> <layer>" (connector.h), without waiting,
// and the acknowledgements are counted for wait_for_save().
//
// Thread-safety: every method from any thread; stream_to() dials (through
// Remotes) without holding the lock the others take.
#pragma once

#include <chrono>
#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include "connector/remotes.h"
#include "kvbridge/connector.h"

namespace kvbridge::connector {

// Notifications that failed, for WorkerStats (shared with callbacks that may
// outlive their sender).
struct SendFailures {
  std::mutex mu;
  uint64_t failed = 0;
  std::string last_error;
  void add(const Status& s);
};

class Announcer {
 public:
  // `layers` is layer_order() of this rank's layout; `timeout` bounds each
  // announcement. The engine and `remotes` must outlive this.
  Announcer(Engine& engine, Remotes& remotes, std::vector<std::string> layers, std::chrono::milliseconds timeout,
            std::shared_ptr<SendFailures> failures);

  // As ConnectorWorker's.
  Status stream_to(RequestId request, const std::string& instance);
  Status save_layer(RequestId request, std::string_view layer);
  Status wait_for_save(RequestId request, std::chrono::milliseconds timeout);

  // Forgets streams untouched since `before` (never waited for).
  void forget_older_than(std::chrono::steady_clock::time_point before);

 private:
  struct Acks {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t outstanding = 0;
    Status first_error;
  };
  struct Stream {
    std::string instance;  // empty until stream_to()
    std::vector<std::string> saved;
    size_t announced = 0;  // of `saved`, sent to the readers
    std::vector<PeerId> readers;
    std::shared_ptr<Acks> acks = std::make_shared<Acks>();
    std::chrono::steady_clock::time_point touched;
  };
  using Messages = std::vector<std::pair<PeerId, std::string>>;
  // Requires mu_: the messages announcing the layers of `s` not sent yet.
  Messages take_announcements(RequestId request, Stream& s);
  void send(const Messages& messages, const std::shared_ptr<Acks>& acks);

  Engine& engine_;
  Remotes& remotes_;
  const std::vector<std::string> layers_;
  const std::chrono::milliseconds timeout_;
  const std::shared_ptr<SendFailures> failures_;
  std::mutex mu_;
  std::map<RequestId, Stream> streams_;
};

}  // namespace kvbridge::connector
