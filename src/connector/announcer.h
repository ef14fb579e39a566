// connector/announcer.h: the prefill side of layer-wise streaming. For each
// streamed request, the layers the rank has saved (each with its producer's
// event when it is device memory) and the decode instance whose ranks read
// it; every saved layer is announced to every rank of that instance as
// "kvb/1 ready <request> <layer>" or "kvb/1 readyev <request> <event>
// <layer>" (connector/messages.h), without waiting, and the
// acknowledgements are counted for wait_for_save(). A rank that answers
// "unread" (it reads nothing from this one: which ranks read which follows
// from both instances' layouts, and this rank knows only its own) is not
// announced to again over that connection.
//
// Nothing here waits on the network: stream_to() of an instance not
// connected yet asks the worker's connect thread for it (the `connect`
// callback) and keeps the announcements until connected() says how that
// went. Announcements go through the worker's Resender: one not
// acknowledged within a try is sent again (a reader takes a layer once),
// until `timeout` after the first try, so one lost message does not fail a
// streamed load.
//
// Thread-safety: every method from any thread.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "connector/remotes.h"
#include "connector/resend.h"
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
  // `layers` is layer_order() of this rank's layout and `device` says which
  // of them are device memory (by ordinal); `timeout` bounds each
  // announcement; `connect` asks for a connect attempt to an instance (it
  // must not block or call back into this). `remotes` and `resender` must
  // outlive this.
  Announcer(Remotes& remotes, Resender& resender, std::vector<std::string> layers, std::vector<uint8_t> device,
            std::chrono::milliseconds timeout, std::shared_ptr<SendFailures> failures,
            std::function<void(const std::string&)> connect);

  // As ConnectorWorker's.
  Status stream_to(RequestId request, const std::string& instance);
  Status save_layer(RequestId request, std::string_view layer, const Readiness& ready);
  Status wait_for_save(RequestId request, std::chrono::milliseconds timeout);
  // A connect attempt to `instance` ended with `result`: the streams that
  // wait for it are announced to its ranks, or end with the error.
  void connected(const std::string& instance, const Status& result);

  // Forgets streams untouched since `before` (never waited for).
  void forget_older_than(std::chrono::steady_clock::time_point before);

  // Announcements sent, and those not sent to a rank that answered
  // "unread" before.
  uint64_t announcements_sent() const;
  uint64_t announcements_skipped() const;

 private:
  struct Acks {
    std::mutex mu;
    std::condition_variable cv;
    uint64_t outstanding = 0;  // announcements not acknowledged
    bool connecting = false;   // waiting for the instance's connect attempt
    Status first_error;
  };
  struct Stream {
    std::string instance;                                    // empty until stream_to()
    bool waiting = false;                                    // for the instance's connect attempt
    std::vector<std::pair<std::string, std::string>> saved;  // (layer, the producer's event handle)
    size_t announced = 0;                                    // of `saved`, sent to the readers
    std::vector<PeerId> readers;
    std::shared_ptr<Acks> acks = std::make_shared<Acks>();
    std::chrono::steady_clock::time_point touched;
  };
  using Messages = std::vector<std::pair<PeerId, std::string>>;
  // Requires mu_: the messages announcing the layers of `s` not sent yet.
  Messages take_announcements(RequestId request, Stream& s);
  void send(const Messages& messages, const std::shared_ptr<Acks>& acks);
  // The engine connections to every rank of a connected `instance`.
  Result<std::vector<PeerId>> readers_of(const std::string& instance);

  // The connections whose rank answered "unread" (shared with the
  // acknowledgements' callbacks, which may outlive this; at most
  // kUnreadKept, then forgotten all at once and learnt again).
  struct Unread {
    std::mutex mu;
    std::set<PeerId> peers;
  };
  static constexpr size_t kUnreadKept = 65536;

  Remotes& remotes_;
  Resender& resender_;
  const std::shared_ptr<Unread> unread_ = std::make_shared<Unread>();
  std::atomic<uint64_t> sent_{0}, skipped_{0};
  const std::vector<std::string> layers_;
  const std::vector<uint8_t> device_;
  const std::chrono::milliseconds timeout_;
  const std::shared_ptr<SendFailures> failures_;
  const std::function<void(const std::string&)> connect_;
  std::mutex mu_;
  std::map<RequestId, Stream> streams_;
};

}  // namespace kvbridge::connector
