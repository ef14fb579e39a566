// A Redis Cluster on loopback (see redis_cluster.h).
#include "testing/redis_cluster.h"

#include <signal.h>
#include <stdlib.h>

#include <chrono>
#include <filesystem>
#include <sstream>
#include <thread>

#include "testing/ports.h"

namespace kvbridge::testing {
namespace {

using Clock = std::chrono::steady_clock;

std::string trim(std::string s) {
  while (!s.empty() && (s.back() == '\n' || s.back() == '\r' || s.back() == ' ')) s.pop_back();
  return s;
}

// A port whose cluster-bus port (port + 10000) is free too.
uint16_t free_cluster_port() {
  for (int attempt = 0; attempt < 100; ++attempt) {
    const uint16_t p = free_loopback_port();
    if (p < 55000 && !accepts_on_loopback(static_cast<uint16_t>(p + 10000))) return p;
  }
  return 0;
}

struct NodeLine {
  std::string id;
  uint16_t port = 0;
  bool master = false, failed = false;
  std::vector<std::pair<int, int>> slots;
};

std::vector<NodeLine> parse_nodes(const std::string& text) {
  std::vector<NodeLine> out;
  std::istringstream in(text);
  std::string line;
  while (std::getline(in, line)) {
    std::istringstream f(line);
    NodeLine n;
    std::string addr, flags, master, ping, pong, epoch, link;
    if (!(f >> n.id >> addr >> flags >> master >> ping >> pong >> epoch >> link)) continue;
    const size_t colon = addr.find(':'), at = addr.find('@');
    if (colon == std::string::npos) continue;
    n.port = static_cast<uint16_t>(std::atoi(addr.substr(colon + 1, at - colon - 1).c_str()));
    n.master = flags.find("master") != std::string::npos;
    n.failed = flags.find("fail") != std::string::npos && flags.find("fail?") == std::string::npos;
    std::string range;
    while (f >> range) {
      if (range.empty() || range[0] == '[') continue;  // a slot being migrated
      const size_t dash = range.find('-');
      const int a = std::atoi(range.c_str());
      const int b = dash == std::string::npos ? a : std::atoi(range.c_str() + dash + 1);
      n.slots.push_back({a, b});
    }
    out.push_back(std::move(n));
  }
  return out;
}

}  // namespace

RedisCluster::~RedisCluster() {
  for (auto& s : servers_) {
    if (s) s->stop(std::chrono::milliseconds(0));
  }
  std::error_code ec;
  if (!dir_.empty()) std::filesystem::remove_all(dir_, ec);
}

std::string RedisCluster::cli(uint16_t port, const std::string& args) const {
  SpawnOptions o;
  o.pipe_stdout = true;
  Result<std::unique_ptr<ChildProcess>> c =
      ChildProcess::shell("exec timeout 10 redis-cli -p " + std::to_string(port) + " " + args + " 2>&1", o);
  if (!c.ok()) return "";
  std::string out = (*c)->read_all(std::chrono::milliseconds(12000));
  (*c)->wait(std::chrono::milliseconds(2000));
  return trim(out);
}

Result<std::unique_ptr<RedisCluster>> RedisCluster::start(int masters, int replicas, int node_timeout_ms) {
  std::unique_ptr<RedisCluster> c(new RedisCluster());
  char tmpl[] = "/tmp/kvb-redis-cluster-XXXXXX";
  if (::mkdtemp(tmpl) == nullptr) return Status::io_error("redis cluster: mkdtemp failed");
  c->dir_ = tmpl;
  const int n = masters * (1 + replicas);
  // A free port is only free until someone else binds it: tests running
  // beside this one pick ports the same way, so a server that exits at start
  // (its port taken between the pick and its bind) is retried on another.
  constexpr int kAttempts = 5;
  for (int i = 0; i < n; ++i) {
    bool started = false;
    uint16_t port = 0;
    for (int attempt = 0; attempt < kAttempts && !started; ++attempt) {
      port = free_cluster_port();
      if (port == 0) return Status::unavailable("redis cluster: no free port pair");
      const std::string p = std::to_string(port);
      KVB_ASSIGN_OR_RETURN(auto child, ChildProcess::spawn({"redis-server",
                                                            "--port",
                                                            p,
                                                            "--bind",
                                                            "127.0.0.1",
                                                            "--cluster-enabled",
                                                            "yes",
                                                            "--cluster-config-file",
                                                            c->dir_ + "/nodes-" + p + ".conf",
                                                            "--cluster-node-timeout",
                                                            std::to_string(node_timeout_ms),
                                                            "--dir",
                                                            c->dir_,
                                                            "--save",
                                                            "",
                                                            "--appendonly",
                                                            "no",
                                                            "--daemonize",
                                                            "no",
                                                            "--loglevel",
                                                            "warning",
                                                            "--protected-mode",
                                                            "no"}));
      const auto deadline = Clock::now() + std::chrono::seconds(5);
      bool exited = false;
      while (!(exited = child->wait(std::chrono::milliseconds(0))) && !accepts_on_loopback(port)) {
        if (Clock::now() > deadline) {
          return Status::unavailable("redis cluster: redis-server on port " + p +
                                     " did not accept within 5 s (install Debian's redis-server)");
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      // Accepting on the port is only ours if our server is still running.
      if (!exited && !child->wait(std::chrono::milliseconds(0))) {
        c->servers_.push_back(std::move(child));
        c->ports_.push_back(port);
        started = true;
      }
    }
    if (!started) {
      return Status::unavailable("redis cluster: redis-server exited at start " + std::to_string(kAttempts) +
                                 " times (last port " + std::to_string(port) +
                                 "; install Debian's redis-server, or ports are exhausted)");
    }
  }
  if (masters < 3) {
    // redis-cli --cluster create wants 3 masters; a smaller cluster is made
    // by hand: slots split evenly, every node meets the first.
    if (replicas != 0) return Status::invalid_argument("redis cluster: replicas need at least 3 masters");
    for (int i = 0; i < masters; ++i) {
      const int first = 16384 * i / masters, last = 16384 * (i + 1) / masters - 1;
      const std::string r =
          c->cli(c->ports_[i], "cluster addslotsrange " + std::to_string(first) + " " + std::to_string(last));
      if (r != "OK") return Status::unavailable("redis cluster: CLUSTER ADDSLOTSRANGE said: " + r);
      if (i > 0) c->cli(c->ports_[i], "cluster meet 127.0.0.1 " + std::to_string(c->ports_[0]));
    }
  }
  if (masters >= 3) {
    std::string nodes;
    for (uint16_t p : c->ports_) nodes += " 127.0.0.1:" + std::to_string(p);
    SpawnOptions o;
    o.pipe_stdout = true;
    KVB_ASSIGN_OR_RETURN(
        auto create, ChildProcess::shell("exec timeout 30 redis-cli --cluster create" + nodes + " --cluster-replicas " +
                                             std::to_string(replicas) + " --cluster-yes 2>&1",
                                         o));
    const std::string said = create->read_all(std::chrono::milliseconds(35000));
    int status = 0;
    if (!create->wait(std::chrono::milliseconds(5000), &status) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
      return Status::unavailable("redis cluster: redis-cli --cluster create failed: " +
                                 said.substr(said.size() > 600 ? said.size() - 600 : 0));
    }
  }
  // Ready: every node says ok, sees every master, and every replica's link
  // to its master is up (so a failover finds the data there).
  const auto deadline = Clock::now() + std::chrono::seconds(20);
  for (;;) {
    bool ready = true;
    for (uint16_t p : c->ports_) {
      if (c->cli(p, "cluster info").find("cluster_state:ok") == std::string::npos) ready = false;
      const std::vector<NodeLine> seen = parse_nodes(c->cli(p, "cluster nodes"));
      int m = 0;
      for (const NodeLine& l : seen) m += l.master && !l.slots.empty();
      if (m != masters || static_cast<int>(seen.size()) != n) ready = false;
      const std::string repl = c->cli(p, "info replication");
      if (repl.find("role:slave") != std::string::npos && repl.find("master_link_status:up") == std::string::npos) {
        ready = false;
      }
      if (!ready) break;
    }
    if (ready) return c;
    if (Clock::now() > deadline) return Status::timeout("redis cluster: not ready within 20 s after forming");
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
}

std::vector<uint16_t> RedisCluster::master_ports() const {
  for (size_t i = 0; i < ports_.size(); ++i) {
    if (!servers_[i]) continue;
    std::vector<uint16_t> out;
    for (const NodeLine& l : parse_nodes(cli(ports_[i], "cluster nodes"))) {
      if (l.master && !l.failed && !l.slots.empty()) out.push_back(l.port);
    }
    if (!out.empty()) return out;
  }
  return {};
}

uint16_t RedisCluster::master_of(uint16_t slot) const {
  for (size_t i = 0; i < ports_.size(); ++i) {
    if (!servers_[i]) continue;
    for (const NodeLine& l : parse_nodes(cli(ports_[i], "cluster nodes"))) {
      if (!l.master || l.failed) continue;
      for (const auto& [a, b] : l.slots) {
        if (slot >= a && slot <= b) return l.port;
      }
    }
    return 0;
  }
  return 0;
}

bool RedisCluster::wait_replicated(int timeout_ms) const {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    bool same = true;
    for (size_t i = 0; i < ports_.size() && same; ++i) {
      if (!servers_[i]) continue;
      const std::string repl = cli(ports_[i], "info replication");
      const size_t at = repl.find("master_port:");
      if (repl.find("role:slave") == std::string::npos || at == std::string::npos) continue;
      const uint16_t master = static_cast<uint16_t>(std::atoi(repl.c_str() + at + 12));
      same = cli(ports_[i], "dbsize") == cli(master, "dbsize");
    }
    if (same) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(50));
  }
  return false;
}

void RedisCluster::kill(uint16_t port) {
  for (size_t i = 0; i < ports_.size(); ++i) {
    if (ports_[i] == port && servers_[i]) {
      servers_[i]->stop(std::chrono::milliseconds(0));
      servers_[i].reset();
    }
  }
}

bool RedisCluster::wait_failover(uint16_t slot, uint16_t not_port, int timeout_ms) const {
  const auto deadline = Clock::now() + std::chrono::milliseconds(timeout_ms);
  while (Clock::now() < deadline) {
    bool ok = true;
    for (size_t i = 0; i < ports_.size() && ok; ++i) {
      if (servers_[i] && cli(ports_[i], "cluster info").find("cluster_state:ok") == std::string::npos) ok = false;
    }
    const uint16_t m = master_of(slot);
    if (ok && m != 0 && m != not_port) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(100));
  }
  return false;
}

Status RedisCluster::migrate_slot(uint16_t slot, uint16_t to, const std::function<void(int)>& between) const {
  const uint16_t from = master_of(slot);
  if (from == 0) return Status::not_found("redis cluster: no master serves slot " + std::to_string(slot));
  if (from == to) return Status();
  const std::string s = std::to_string(slot);
  const std::string from_id = cli(from, "cluster myid"), to_id = cli(to, "cluster myid");
  if (cli(to, "cluster setslot " + s + " importing " + from_id) != "OK") {
    return Status::internal("redis cluster: SETSLOT IMPORTING on " + std::to_string(to) + " failed");
  }
  if (cli(from, "cluster setslot " + s + " migrating " + to_id) != "OK") {
    return Status::internal("redis cluster: SETSLOT MIGRATING on " + std::to_string(from) + " failed");
  }
  int moved = 0;
  for (;;) {
    std::istringstream keys(cli(from, "cluster getkeysinslot " + s + " 4"));
    std::string k, list;
    int count = 0;
    while (std::getline(keys, k)) {
      if (k.empty()) continue;
      list += " '" + k + "'";
      ++count;
    }
    if (count == 0) break;
    const std::string r = cli(from, "migrate 127.0.0.1 " + std::to_string(to) + " \"\" 0 5000 replace keys" + list);
    if (r != "OK") return Status::internal("redis cluster: MIGRATE of slot " + s + " said: " + r);
    moved += count;
    if (between) between(moved);
  }
  for (uint16_t m : master_ports()) {
    if (cli(m, "cluster setslot " + s + " node " + to_id) != "OK") {
      return Status::internal("redis cluster: SETSLOT NODE on " + std::to_string(m) + " failed");
    }
  }
  return Status();
}

}  // namespace kvbridge::testing
