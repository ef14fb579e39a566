// attack_peer: one prefill rank in its own process, for the attack suite:
// an engine and a ConnectorWorker over a llama3-8b layout (8 blocks) whose
// blocks 4..6 hold request 1's KV (content.h, seed 11), so a test can stop
// it (SIGSTOP) or kill it while real decode ranks load from it.
//
//   attack_peer --transport T [--secret-file F] [--instance NAME]
//
// Prints "ready SIDE_CHANNEL" once serving, then serves until killed (or
// until stdin closes).
//
//   attack_peer --control-flood HOST:PORT --target HEX --count N [--uid U]
//
// The other role: a hostile local user. Runs as user U (from root), opens N
// control connections to HOST:PORT under claimed identities, 16 each (the
// most one identity may hold), aimed at engine instance HEX, prints
// "flooded K" (K: the connections the listener kept), and holds them until
// stdin closes.
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

#include "attack_util.h"

#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "kvbridge/presets.h"
#include "net/address.h"
#include "net/socket.h"

using namespace kvbridge;

namespace {

int control_flood(const std::string& address, uint64_t target, int count, long uid) {
  if (uid >= 0 && ::setuid(static_cast<uid_t>(uid)) != 0) {
    std::fprintf(stderr, "attack_peer: setuid(%ld) failed\n", uid);
    return 6;
  }
  Result<net::HostPort> at = net::parse_host_port(address, "control address");
  if (!at.ok()) return 7;
  std::vector<net::Fd> held;
  int kept = 0;
  for (int i = 0; i < count; ++i) {
    const auto limits = net::IoLimits{std::chrono::steady_clock::now() + std::chrono::seconds(5)};
    Result<net::Fd> fd = net::dial(*at, limits, "flood");
    if (!fd.ok()) continue;
    Result<net::Opened> o = net::open_client(fd->get(), attack::control_config(""),
                                             attack::control_body("mallory-" + std::to_string(i / 16), target),
                                             attack::control_limit, limits, "flood");
    if (o.ok()) ++kept;
    held.push_back(std::move(*fd));
  }
  std::printf("flooded %d\n", kept);
  std::fflush(stdout);
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::string transport = "tcp", secret_file, instance = "prefill", flood, target;
  int count = 0;
  long uid = -1;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--transport") transport = argv[i + 1];
    if (flag == "--secret-file") secret_file = argv[i + 1];
    if (flag == "--instance") instance = argv[i + 1];
    if (flag == "--control-flood") flood = argv[i + 1];
    if (flag == "--target") target = argv[i + 1];
    if (flag == "--count") count = std::atoi(argv[i + 1]);
    if (flag == "--uid") uid = std::atol(argv[i + 1]);
  }
  if (!flood.empty()) return control_flood(flood, std::stoull(target, nullptr, 16), count, uid);
  std::string secret;
  if (!secret_file.empty()) {
    FILE* f = std::fopen(secret_file.c_str(), "r");
    char buf[256] = {};
    if (f == nullptr || std::fgets(buf, sizeof buf, f) == nullptr) return 2;
    std::fclose(f);
    secret = buf;
  }
  Layout layout = *make_preset({.name = "llama3-8b", .num_blocks = 8});
  std::vector<std::vector<uint8_t>> mem;
  std::vector<std::span<uint8_t>> spans;
  for (const Tensor& t : layout.tensors) mem.emplace_back(t.bytes);
  for (auto& m : mem) spans.emplace_back(m);
  Request q;
  q.num_tokens = 40;
  q.blocks["full"] = {{1, 2, 3}, {4, 5, 6}};
  if (!fill_request(layout, q, RequestSide::kRemote, 0, 11, spans).ok()) return 3;
  EngineOptions e;
  e.name = "prefill/r0";
  e.transports = {transport};
  e.secret = secret;
  Result<std::unique_ptr<Engine>> engine = Engine::create(e);
  if (!engine.ok()) {
    std::fprintf(stderr, "attack_peer: %s\n", engine.error().to_string().c_str());
    return 4;
  }
  WorkerOptions w;
  w.instance_id = instance;
  w.secret = secret;
  Result<std::unique_ptr<ConnectorWorker>> worker = ConnectorWorker::create(**engine, layout, spans, w);
  if (!worker.ok()) {
    std::fprintf(stderr, "attack_peer: %s\n", worker.error().to_string().c_str());
    return 5;
  }
  std::printf("ready %s\n", (*worker)->side_channel_address().c_str());
  std::fflush(stdout);
  char c;
  while (::read(0, &c, 1) > 0) {
  }
  return 0;
}
