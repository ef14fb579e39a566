// testing/fake_side_channel.h: a side channel that misbehaves on purpose,
// for tests and `kvbridge demo --inject version|malformed|truncated`.
//
// It stands in front of a real rank's side channel (its address is what the
// rank advertises instead) and answers every client in one of three wrong
// ways: as a server of another handshake version (a Refuse of version + 1),
// with random bytes instead of a frame, or with the real rank's Metadata frame
// cut in half (it fetches the real one itself, with the same secret). It
// serves one connection at a time on its own thread; each is bounded by
// `timeout`.
//
// Not part of the library: linked by tests and the CLI only.
// Thread-safety: address() from any thread. Ownership: stops its thread and
// closes its socket when destroyed.
#pragma once

#include <atomic>
#include <chrono>
#include <memory>
#include <string>
#include <thread>

#include "connector/side_channel.h"
#include "net/fd.h"

namespace kvbridge::testing {

class FakeSideChannel {
 public:
  enum class Mode { kOtherVersion, kGarbage, kTruncate };
  struct Options {
    Mode mode = Mode::kGarbage;
    std::string host = "127.0.0.1";
    std::string secret;        // as the real rank's
    std::string real_address;  // kTruncate: the real side channel
    std::string identity;      // kTruncate: the real rank's identity_text() and hash
    uint64_t hash = 0;
    std::chrono::milliseconds timeout{5000};
  };
  static Result<std::unique_ptr<FakeSideChannel>> start(Options options);
  ~FakeSideChannel();
  std::string address() const { return address_; }

 private:
  explicit FakeSideChannel(Options options) : options_(std::move(options)) {}
  void loop();
  void serve(int fd);

  Options options_;
  net::Fd listen_fd_;
  std::string address_;
  std::atomic<bool> stop_{false};
  std::thread thread_;
};

}  // namespace kvbridge::testing
