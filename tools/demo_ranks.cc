// The demo's rank processes (demo_ranks.h).
#include "demo_ranks.h"

#include <poll.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>

#include "proc_info.h"

namespace kvbridge::cli::demo {

using nlohmann::json;

Ranks::~Ranks() {
  for (auto& p : procs_) {
    if (p->alive && p->pid > 0) ::kill(p->pid, SIGKILL);
    if (p->pid > 0) ::waitpid(p->pid, nullptr, 0);
  }
}

Status Ranks::spawn(const DemoArgs& args, uint64_t num_blocks, uint64_t state_blocks) {
  auto add = [&](bool prefill, uint32_t inst, uint32_t rank) -> Status {
    int sv[2];
    if (::socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) != 0) return Status::io_error("socketpair failed");
    auto p = std::make_unique<Proc>();
    p->prefill = prefill;
    p->rank = rank;
    p->decode_instance = inst;
    p->instance = prefill ? "prefill" : "decode-" + std::to_string(inst);
    std::fflush(nullptr);
    const pid_t pid = ::fork();
    if (pid < 0) return Status::io_error("fork failed");
    if (pid == 0) {
      if (args.pin_cores) pin_to_core(procs_.size());  // --pin-cores
      ::close(sv[0]);
      for (auto& other : procs_) other->ch.close();
      RankConfig c{p->instance, prefill, rank, num_blocks, state_blocks, prefill ? args.prefill : args.decode, &args};
      rank_main(c, sv[1]);
    }
    ::close(sv[1]);
    p->pid = pid;
    p->ch = Channel(sv[0]);
    procs_.push_back(std::move(p));
    return Status();
  };
  for (uint32_t r = 0; r < args.prefill.ranks(); ++r) KVB_RETURN_IF_ERROR(add(true, 0, r));
  for (uint32_t i = 0; i < args.decode_instances; ++i) {
    for (uint32_t r = 0; r < args.decode.ranks(); ++r) KVB_RETURN_IF_ERROR(add(false, i, r));
  }
  return Status();
}

void Ranks::poll(std::chrono::milliseconds wait, const std::function<void(Proc&, json&)>& message,
                 const std::function<void(Proc&)>& lost) {
  std::vector<pollfd> fds;
  for (auto& p : procs_) fds.push_back({p->ch.fd(), POLLIN, 0});
  ::poll(fds.data(), fds.size(), static_cast<int>(wait.count()));
  for (auto& p : procs_) {
    if (!p->alive) continue;
    std::vector<json> in;
    Status s = p->ch.receive(in);
    for (json& m : in) message(*p, m);
    if (!s.ok()) lost(*p);
  }
}

Status Ranks::connect(const DemoArgs& args) {
  std::vector<std::string> addrs;
  for (auto& p : procs_) {
    if (p->prefill) addrs.push_back(p->side_channel);
  }
  // Push mode: prefill ranks plan as the decode ranks do, over every
  // prefill rank, so they know their own instance too. With --etcd, prefill
  // rank 0 registers the instance there and decode ranks find it.
  const std::string prefix = "/kvbridge-demo-" + std::to_string(::getpid());
  for (auto& p : procs_) {
    if (!args.etcd.empty() && p->prefill && p->rank == 0) {
      KVB_RETURN_IF_ERROR(p->ch.send(
          {{"cmd", "register"}, {"etcd", args.etcd}, {"prefix", prefix}, {"instance", "prefill"}, {"ranks", addrs}}));
    }
  }
  for (auto& p : procs_) {
    if (!args.etcd.empty() && !p->prefill) {
      KVB_RETURN_IF_ERROR(
          p->ch.send({{"cmd", "discover"}, {"etcd", args.etcd}, {"prefix", prefix}, {"instance", "prefill"}}));
    } else if (!p->prefill || args.mode == "push") {
      KVB_RETURN_IF_ERROR(p->ch.send({{"cmd", "remote"}, {"instance", "prefill"}, {"ranks", addrs}}));
    }
  }
  // Streaming prefill ranks announce layers to the decode instances.
  for (uint32_t i = 0; i < args.decode_instances; ++i) {
    std::vector<std::string> decode;
    for (auto& p : procs_) {
      if (!p->prefill && p->decode_instance == i) decode.push_back(p->side_channel);
    }
    for (auto& p : procs_) {
      if (!p->prefill) continue;
      KVB_RETURN_IF_ERROR(
          p->ch.send({{"cmd", "remote"}, {"instance", "decode-" + std::to_string(i)}, {"ranks", decode}}));
    }
  }
  return Status();
}

std::vector<Proc*> Ranks::of(bool prefill, uint32_t inst) const {
  std::vector<Proc*> out;
  for (auto& p : procs_) {
    if (p->alive && p->prefill == prefill && (prefill || p->decode_instance == inst)) out.push_back(p.get());
  }
  return out;
}

}  // namespace kvbridge::cli::demo
