// attack_peer: one prefill rank in its own process, for the attack suite:
// an engine and a ConnectorWorker over a llama3-8b layout (8 blocks) whose
// blocks 4..6 hold request 1's KV (content.h, seed 11), so a test can stop
// it (SIGSTOP) or kill it while real decode ranks load from it.
//
//   attack_peer --transport T [--secret-file F] [--instance NAME]
//
// Prints "ready SIDE_CHANNEL" once serving, then serves until killed (or
// until stdin closes).
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "kvbridge/connector.h"
#include "kvbridge/content.h"
#include "kvbridge/presets.h"

using namespace kvbridge;

int main(int argc, char** argv) {
  std::string transport = "tcp", secret_file, instance = "prefill";
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string flag = argv[i];
    if (flag == "--transport") transport = argv[i + 1];
    if (flag == "--secret-file") secret_file = argv[i + 1];
    if (flag == "--instance") instance = argv[i + 1];
  }
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
