// The driver-rank channel of `kvbridge demo` (demo.h) and the names of the
// injectable faults.
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>

#include "demo.h"

namespace kvbridge::cli::demo {
namespace {

struct InjectName {
  Inject inject;
  const char* name;
};
constexpr InjectName kInjects[] = {
    {Inject::kNone, "none"},
    {Inject::kKillPrefill, "kill-prefill"},
    {Inject::kKillDecode, "kill-decode"},
    {Inject::kDropNotification, "drop-notification"},
    {Inject::kStall, "stall"},
    {Inject::kVersion, "version"},
    {Inject::kHash, "hash"},
    {Inject::kWrongSecret, "wrong-secret"},
    {Inject::kMissingSecret, "missing-secret"},
    {Inject::kMalformed, "malformed"},
    {Inject::kTruncated, "truncated"},
    {Inject::kAbort, "abort"},
    {Inject::kLease, "lease"},
    {Inject::kPause, "pause"},
    {Inject::kCorrupt, "corrupt"},
};

}  // namespace

Result<Inject> parse_inject(std::string_view name) {
  for (const InjectName& i : kInjects) {
    if (name == i.name) return i.inject;
  }
  return Status::invalid_argument("unknown fault '" + std::string(name) + "' (known: " + inject_names() + ")");
}

std::string_view inject_name(Inject inject) {
  for (const InjectName& i : kInjects) {
    if (i.inject == inject) return i.name;
  }
  return "unknown";
}

std::string inject_names() {
  std::string out;
  for (const InjectName& i : kInjects) out += (out.empty() ? "" : ", ") + std::string(i.name);
  return out;
}

Channel::~Channel() { close(); }

void Channel::close() {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
}

Status Channel::send(const nlohmann::json& message) {
  if (fd_ < 0) return Status::io_error("channel is closed");
  std::string line = message.dump();
  line += '\n';
  size_t done = 0;
  while (done < line.size()) {
    const ssize_t n = ::send(fd_, line.data() + done, line.size() - done, MSG_NOSIGNAL);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
      pollfd p{fd_, POLLOUT, 0};
      ::poll(&p, 1, 100);
      continue;
    }
    if (n <= 0) return Status::io_error(std::string("channel send: ") + std::strerror(errno));
    done += static_cast<size_t>(n);
  }
  return Status();
}

Status Channel::receive(std::vector<nlohmann::json>& out) {
  if (fd_ < 0) return Status::io_error("channel is closed");
  char buf[65536];
  for (;;) {
    const ssize_t n = ::recv(fd_, buf, sizeof buf, MSG_DONTWAIT);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) break;
    if (n <= 0) return Status::io_error(n == 0 ? "end of stream" : std::strerror(errno));
    in_.append(buf, static_cast<size_t>(n));
    if (static_cast<size_t>(n) < sizeof buf) break;
  }
  size_t start = 0;
  for (size_t nl; (nl = in_.find('\n', start)) != std::string::npos; start = nl + 1) {
    nlohmann::json j = nlohmann::json::parse(in_.begin() + static_cast<long>(start),
                                             in_.begin() + static_cast<long>(nl), nullptr, false);
    if (j.is_discarded() || !j.is_object()) return Status::invalid_argument("channel: a line is not a JSON object");
    out.push_back(std::move(j));
  }
  in_.erase(0, start);
  return Status();
}

}  // namespace kvbridge::cli::demo
