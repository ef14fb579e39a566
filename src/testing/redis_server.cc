// A redis-server child on a free loopback port (see redis_server.h).
#include "testing/redis_server.h"

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <string>
#include <thread>

namespace kvbridge::testing {

uint16_t free_loopback_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t len = sizeof(a);
  ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
  ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
  ::close(fd);
  return ntohs(a.sin_port);
}

bool accepts_on_loopback(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  sockaddr_in a{};
  a.sin_family = AF_INET;
  a.sin_port = htons(port);
  a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) == 0;
  ::close(fd);
  return ok;
}

Result<std::unique_ptr<RedisServer>> RedisServer::start() {
  for (int attempt = 0; attempt < 3; ++attempt) {
    std::unique_ptr<RedisServer> r(new RedisServer());
    r->port_ = free_loopback_port();
    KVB_ASSIGN_OR_RETURN(r->child_, ChildProcess::spawn({"redis-server", "--port", std::to_string(r->port_), "--bind",
                                                         "127.0.0.1", "--save", "", "--appendonly", "no", "--daemonize",
                                                         "no", "--loglevel", "warning"}));
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
    while (std::chrono::steady_clock::now() < deadline) {
      if (accepts_on_loopback(r->port_)) return r;
      if (r->child_->wait(std::chrono::milliseconds(0))) break;  // exited: the port was taken, or no binary
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
  }
  return Status::unavailable("could not start redis-server (install Debian's redis-server)");
}

}  // namespace kvbridge::testing
