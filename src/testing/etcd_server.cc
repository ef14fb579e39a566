// An etcd child on free loopback ports (see etcd_server.h).
#include "testing/etcd_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <unistd.h>

#include <cstdlib>
#include <filesystem>
#include <thread>

#include "testing/ports.h"

namespace kvbridge::testing {
namespace {

// GET /health answers {"health":"true"} once the member has a leader; a
// listening port alone is not enough (requests would wait for the election).
bool healthy(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  timeval tv{0, 500 * 1000};
  ::setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
  ::setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string answer;
  if (::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0) {
    const std::string get = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
    if (::send(fd, get.data(), get.size(), MSG_NOSIGNAL) == ssize_t(get.size())) {
      char buf[1024];
      for (ssize_t n; (n = ::recv(fd, buf, sizeof(buf), 0)) > 0;) answer.append(buf, size_t(n));
    }
  }
  ::close(fd);
  return answer.find("\"health\":\"true\"") != std::string::npos;
}

}  // namespace

Result<std::unique_ptr<EtcdServer>> EtcdServer::start() {
  std::string dir = (std::filesystem::temp_directory_path() / "kvb-etcd-XXXXXX").string();
  if (!::mkdtemp(dir.data())) return Status::io_error("mkdtemp " + dir + " failed");
  std::unique_ptr<EtcdServer> s(new EtcdServer());
  s->data_dir_ = dir;
  Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    s->client_port_ = free_loopback_port();
    do s->peer_port_ = free_loopback_port();
    while (s->peer_port_ == s->client_port_);
    last = s->launch();
    if (last.ok()) return s;
    std::filesystem::remove_all(dir + "/data");  // a half-made member from a failed start
  }
  return last;
}

EtcdServer::~EtcdServer() {
  child_.reset();  // stops and reaps it
  std::error_code ignored;
  std::filesystem::remove_all(data_dir_, ignored);
}

std::string EtcdServer::endpoint() const { return "http://127.0.0.1:" + std::to_string(client_port_); }

void EtcdServer::signal(int signal) {
  if (child_) child_->signal(signal);
}

void EtcdServer::stop(std::chrono::milliseconds grace) {
  if (child_) child_->stop(grace);
  child_.reset();
}

Status EtcdServer::restart() {
  stop();
  // The ports were just closed; etcd's listeners set SO_REUSEADDR, but try a
  // few times in case the kernel still holds one.
  Status last;
  for (int attempt = 0; attempt < 3; ++attempt) {
    last = launch();
    if (last.ok()) return last;
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
  return last;
}

Status EtcdServer::launch() {
  const std::string client = "http://127.0.0.1:" + std::to_string(client_port_);
  const std::string peer = "http://127.0.0.1:" + std::to_string(peer_port_);
  KVB_ASSIGN_OR_RETURN(
      child_, ChildProcess::spawn({"etcd", "--name", "kvb", "--data-dir", data_dir_ + "/data", "--listen-client-urls",
                                   client, "--advertise-client-urls", client, "--listen-peer-urls", peer,
                                   "--initial-advertise-peer-urls", peer, "--initial-cluster", "kvb=" + peer,
                                   "--logger", "zap", "--log-level", "error"}));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
  while (std::chrono::steady_clock::now() < deadline) {
    if (healthy(client_port_)) return Status();
    if (child_->wait(std::chrono::milliseconds(0))) break;  // exited: a port was taken, or no binary
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  child_.reset();
  return Status::unavailable("could not start etcd on 127.0.0.1:" + std::to_string(client_port_) +
                             " (install Debian's etcd-server)");
}

}  // namespace kvbridge::testing
