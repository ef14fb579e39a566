// Peers for the conformance suite: in this process, or a peer_main child.
#include "conformance/harness.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <spawn.h>
#include <sys/wait.h>
#include <unistd.h>

#include <sstream>
#include <thread>

#include "conformance/pattern.h"
#include "conformance/peer_buffer.h"

extern char** environ;

namespace kvbridge::conformance {
namespace {

using Clock = std::chrono::steady_clock;

class InProcessPeer final : public Peer {
 public:
  static Result<std::unique_ptr<Peer>> create(const PeerOptions& o) {
    auto p = std::unique_ptr<InProcessPeer>(new InProcessPeer());
    p->name_ = o.name;
    p->options_ = o;
    KVB_ASSIGN_OR_RETURN(p->buffer_, PeerBuffer::create(o.bytes, o.memory));
    fill_pattern(p->buffer_.data(), o.bytes, o.seed, 0);
    EngineOptions eo;
    eo.name = o.name;
    eo.transports = {o.transport};
    KVB_ASSIGN_OR_RETURN(p->engine_, Engine::create(eo));
    KVB_ASSIGN_OR_RETURN(p->region_, p->engine_->register_memory(p->buffer_.data(), o.bytes, o.memory));
    return std::unique_ptr<Peer>(std::move(p));
  }
  const std::string& name() const override { return name_; }
  std::string metadata() override { return engine_ ? engine_->metadata() : std::string(); }
  RegionId region() const override { return region_; }
  ::testing::AssertionResult check(uint64_t offset, uint64_t len, uint32_t seed, uint64_t from) override {
    if (offset > buffer_.size() || len > buffer_.size() - offset)
      return ::testing::AssertionFailure() << "check past the buffer";
    int64_t bad = find_mismatch(buffer_.data() + offset, len, seed, from);
    if (bad < 0) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "peer '" << name_ << "' byte " << offset + bad << " differs from pattern "
                                         << seed << " byte " << from + bad;
  }
  Status fill(uint64_t offset, uint64_t len, uint32_t seed) override {
    fill_pattern(buffer_.data() + offset, len, seed, offset);
    return Status();
  }
  std::vector<Notification> take_notifications() override {
    return engine_ ? engine_->take_notifications() : std::vector<Notification>{};
  }
  Status reregister(uint32_t seed) override {
    KVB_RETURN_IF_ERROR(engine_->deregister_memory(region_));
    buffer_ = PeerBuffer();
    KVB_ASSIGN_OR_RETURN(buffer_, PeerBuffer::create(options_.bytes, options_.memory));
    fill_pattern(buffer_.data(), options_.bytes, seed, 0);
    KVB_ASSIGN_OR_RETURN(region_, engine_->register_memory(buffer_.data(), options_.bytes, options_.memory));
    return Status();
  }
  void kill() override { engine_.reset(); }

 private:
  InProcessPeer() = default;
  PeerOptions options_;
  std::string name_;
  PeerBuffer buffer_;  // declared before engine_: outlives it
  std::unique_ptr<Engine> engine_;
  RegionId region_ = 0;
};

class ChildPeer final : public Peer {
 public:
  static Result<std::unique_ptr<Peer>> create(const PeerOptions& o) {
    // A child that died makes writes to its stdin raise SIGPIPE; the test
    // should see an error from command(), not die.
    ::signal(SIGPIPE, SIG_IGN);
    auto p = std::unique_ptr<ChildPeer>(new ChildPeer());
    p->name_ = o.name;
    int to_child[2], from_child[2];
    if (::pipe2(to_child, O_CLOEXEC) != 0 || ::pipe2(from_child, O_CLOEXEC) != 0) {
      return Status::io_error("pipe2 failed");
    }
    posix_spawn_file_actions_t actions;
    posix_spawn_file_actions_init(&actions);
    posix_spawn_file_actions_adddup2(&actions, to_child[0], 0);
    posix_spawn_file_actions_adddup2(&actions, from_child[1], 1);
    std::vector<std::string> args = {KVB_PEER_MAIN,
                                     "--name",
                                     o.name,
                                     "--transport",
                                     o.transport,
                                     "--bytes",
                                     std::to_string(o.bytes),
                                     "--seed",
                                     std::to_string(o.seed),
                                     "--memory",
                                     o.memory};
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    int rc = ::posix_spawn(&p->pid_, KVB_PEER_MAIN, &actions, nullptr, argv.data(), environ);
    posix_spawn_file_actions_destroy(&actions);
    ::close(to_child[0]);
    ::close(from_child[1]);
    p->in_ = to_child[1];
    p->out_ = from_child[0];
    if (rc != 0) return Status::io_error(std::string("posix_spawn ") + KVB_PEER_MAIN + " failed");
    KVB_ASSIGN_OR_RETURN(std::string ready, p->read_line());
    std::istringstream s(ready);
    std::string word, hex;
    s >> word >> p->region_ >> hex;
    if (word != "ready") return Status::io_error("peer_main did not start: '" + ready + "'");
    p->metadata_ = from_hex(hex);
    return std::unique_ptr<Peer>(std::move(p));
  }
  ~ChildPeer() override {
    if (pid_ > 0) {
      (void)command("exit");
      ::close(in_);
      int status = 0;
      for (int i = 0; i < 500 && ::waitpid(pid_, &status, WNOHANG) == 0; ++i) {
        std::this_thread::sleep_for(std::chrono::milliseconds(10));
      }
      kill();
    }
    ::close(out_);
  }
  const std::string& name() const override { return name_; }
  std::string metadata() override {
    Result<std::string> line = command("metadata");
    return line.ok() && line->rfind("metadata ", 0) == 0 ? from_hex(line->substr(9)) : metadata_;
  }
  RegionId region() const override { return region_; }
  ::testing::AssertionResult check(uint64_t offset, uint64_t len, uint32_t seed, uint64_t from) override {
    Result<std::string> line = command("check " + std::to_string(offset) + " " + std::to_string(len) + " " +
                                       std::to_string(seed) + " " + std::to_string(from));
    if (!line.ok()) return ::testing::AssertionFailure() << line.error().to_string();
    if (*line == "ok") return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << "peer '" << name_ << "': " << *line;
  }
  Status fill(uint64_t offset, uint64_t len, uint32_t seed) override {
    KVB_ASSIGN_OR_RETURN(std::string line, command("fill " + std::to_string(offset) + " " + std::to_string(len) + " " +
                                                   std::to_string(seed)));
    return line == "ok" ? Status() : Status::internal("peer_main: " + line);
  }
  std::vector<Notification> take_notifications() override {
    std::vector<Notification> out;
    Result<std::string> head = command("notifications");
    size_t n = 0;
    if (!head.ok() || std::sscanf(head->c_str(), "notifications %zu", &n) != 1) return out;
    for (size_t i = 0; i < n; ++i) {
      Result<std::string> line = read_line();
      if (!line.ok()) break;
      std::istringstream s(*line);
      std::string peer, message;
      s >> peer >> message;
      out.push_back(Notification{from_hex(peer), from_hex(message)});
    }
    return out;
  }
  Status reregister(uint32_t seed) override {
    KVB_ASSIGN_OR_RETURN(std::string line, command("reregister " + std::to_string(seed)));
    std::istringstream s(line);
    std::string word;
    s >> word >> region_;
    if (word != "ready") return Status::internal("peer_main: " + line);
    return Status();
  }
  void kill() override {
    if (pid_ <= 0) return;
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    pid_ = -1;
  }

 private:
  ChildPeer() = default;
  Result<std::string> command(const std::string& line) {
    if (pid_ <= 0) return Status::unavailable("peer_main '" + name_ + "' was killed");
    std::string out = line + "\n";
    if (::write(in_, out.data(), out.size()) != static_cast<ssize_t>(out.size())) {
      return Status::io_error("peer_main '" + name_ + "': cannot write command '" + line + "'");
    }
    return read_line();
  }
  Result<std::string> read_line() {
    const Clock::time_point deadline = Clock::now() + std::chrono::seconds(60);
    while (true) {
      size_t nl = buffered_.find('\n');
      if (nl != std::string::npos) {
        std::string line = buffered_.substr(0, nl);
        buffered_.erase(0, nl + 1);
        return line;
      }
      const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
      pollfd p{out_, POLLIN, 0};
      if (left <= 0 || ::poll(&p, 1, static_cast<int>(left)) <= 0) {
        return Status::timeout("peer_main '" + name_ + "' did not answer within 60 s");
      }
      char chunk[65536];
      ssize_t n = ::read(out_, chunk, sizeof(chunk));
      if (n <= 0) return Status::io_error("peer_main '" + name_ + "' closed its stdout");
      buffered_.append(chunk, static_cast<size_t>(n));
    }
  }
  std::string name_;
  pid_t pid_ = -1;
  int in_ = -1, out_ = -1;
  std::string buffered_;
  std::string metadata_;
  RegionId region_ = 0;
};

}  // namespace

Result<std::unique_ptr<Peer>> make_in_process_peer(const PeerOptions& options) {
  return InProcessPeer::create(options);
}
Result<std::unique_ptr<Peer>> make_child_peer(const PeerOptions& options) { return ChildPeer::create(options); }

std::vector<Notification> await_notifications(Peer& peer, size_t count, std::chrono::milliseconds timeout) {
  std::vector<Notification> got;
  const Clock::time_point deadline = Clock::now() + timeout;
  while (got.size() < count && Clock::now() < deadline) {
    for (Notification& n : peer.take_notifications()) got.push_back(std::move(n));
    if (got.size() < count) std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return got;
}

}  // namespace kvbridge::conformance
