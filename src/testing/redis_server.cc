// A redis-server child on a free loopback port (see redis_server.h).
#include "testing/redis_server.h"

#include "testing/ports.h"

#include <unistd.h>

#include <string>
#include <thread>

namespace kvbridge::testing {

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
