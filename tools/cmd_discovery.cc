// `kvbridge discovery list|watch|register`: instances in etcd
// (docs/discovery.md). Built for real when libcurl was found
// (KVB_HAVE_DISCOVERY); otherwise the subcommand says so.
#include <signal.h>

#include <chrono>
#include <cstdio>
#include <iostream>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "cli.h"

#if KVB_HAVE_DISCOVERY
#include "kvbridge/discovery.h"
#include "kvbridge/layout.h"
#include "kvbridge/layout_json.h"
#endif

namespace kvbridge::cli {
namespace {

struct DiscoveryArgs {
  std::string etcd = "http://127.0.0.1:2379";
  std::string prefix = "/kvbridge";
  uint32_t timeout_ms = 3000;
  double duration_s = 0;  // watch, register: 0 = until SIGINT or SIGTERM
  bool json = false;      // list, watch: one record's JSON per line
  // register
  std::string id, role = "prefill", identity, layout;
  std::vector<std::string> ranks, labels;
  uint32_t protocol = 2;
  uint32_t ttl_s = 10;
  std::string secret_file;
};

#if KVB_HAVE_DISCOVERY

Result<EtcdOptions> etcd_options(const DiscoveryArgs& a) {
  EtcdOptions o;
  KVB_ASSIGN_OR_RETURN(o.secret, read_secret(a.secret_file));
  o.endpoint = a.etcd;
  o.prefix = a.prefix;
  o.request_timeout = std::chrono::milliseconds(a.timeout_ms);
  o.connect_timeout = std::min(o.request_timeout, std::chrono::milliseconds(1000));
  return o;
}

std::string line(const InstanceRecord& r, bool json) {
  if (json) return *instance_record_to_json(r);
  std::string ranks;
  for (const std::string& a : r.ranks) ranks += (ranks.empty() ? "" : ",") + a;
  std::string s =
      r.id + " " + r.role + " identity=" + r.identity + " protocol=" + std::to_string(r.protocol) + " ranks=" + ranks;
  for (const auto& [k, v] : r.labels) s += " " + k + "=" + v;
  return s;
}

// SIGINT and SIGTERM are blocked before any thread starts (threads inherit
// the mask) and taken here, so that the destructors run: a registration
// revokes its lease on the way out.
void block_stop_signals(sigset_t* set) {
  sigemptyset(set);
  sigaddset(set, SIGINT);
  sigaddset(set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, set, nullptr);
}

void wait_stop(const sigset_t& set, double duration_s) {
  if (duration_s <= 0) {
    int sig = 0;
    sigwait(&set, &sig);
    return;
  }
  timespec t{static_cast<time_t>(duration_s), static_cast<long>((duration_s - static_cast<time_t>(duration_s)) * 1e9)};
  sigtimedwait(&set, nullptr, &t);
}

int run_list(const DiscoveryArgs& a) {
  Result<EtcdOptions> o = etcd_options(a);
  if (!o.ok()) return fail(o.error());
  Result<std::unique_ptr<Watcher>> w = Watcher::create(*o);
  if (!w.ok()) return fail(w.error());
  for (const auto& [id, r] : (*w)->instances()) std::cout << line(r, a.json) << "\n";
  if ((*w)->invalid_records() > 0) {
    std::cerr << "kvbridge: " << (*w)->invalid_records() << " invalid records under " << a.prefix
              << "/instances/ (the last: " << (*w)->last_invalid().to_string() << ")\n";
  }
  return 0;
}

int run_watch(const DiscoveryArgs& a) {
  sigset_t set;
  block_stop_signals(&set);
  Result<EtcdOptions> o = etcd_options(a);
  if (!o.ok()) return fail(o.error());
  Result<std::unique_ptr<Watcher>> w = Watcher::create(*o, [&a](InstanceEvent e, const InstanceRecord& r) {
    std::cout << instance_event_name(e) << " " << line(r, a.json) << std::endl;
  });
  if (!w.ok()) return fail(w.error());
  wait_stop(set, a.duration_s);
  return 0;
}

int run_register(const DiscoveryArgs& a) {
  InstanceRecord r;
  r.id = a.id;
  r.role = a.role;
  r.ranks = a.ranks;
  r.protocol = a.protocol;
  r.identity = a.identity;
  if (!a.layout.empty()) {
    Result<std::string> text = read_input(a.layout);
    if (!text.ok()) return fail(text.error());
    Result<Layout> layout = parse_layout(*text);
    if (!layout.ok()) return fail(layout.error().with_context(a.layout));
    r.identity = compatibility_hash_hex(*layout);
  }
  for (const std::string& l : a.labels) {
    const size_t eq = l.find('=');
    if (eq == std::string::npos) return fail(Status::invalid_argument("--label '" + l + "' is not key=value"));
    r.labels[l.substr(0, eq)] = l.substr(eq + 1);
  }
  Result<EtcdOptions> o = etcd_options(a);
  if (!o.ok()) return fail(o.error());
  sigset_t set;
  block_stop_signals(&set);
  Result<std::unique_ptr<Registration>> reg = Registration::create(*o, r, std::chrono::seconds(a.ttl_s));
  if (!reg.ok()) return fail(reg.error());
  std::cout << "registered " << (*reg)->key() << " lease " << (*reg)->lease() << " ttl " << a.ttl_s << "s" << std::endl;
  wait_stop(set, a.duration_s);
  return 0;  // the destructor revokes the lease
}

#endif  // KVB_HAVE_DISCOVERY

}  // namespace

Command add_discovery_command(CLI::App& root) {
  auto a = std::make_shared<DiscoveryArgs>();
  CLI::App* app = root.add_subcommand("discovery", "Instances registered in etcd: list, watch, register");
  app->require_subcommand(1);
  auto common = [a](CLI::App* s) {
    s->add_option("--etcd", a->etcd, "etcd's client URL")->capture_default_str();
    s->add_option("--prefix", a->prefix, "key prefix; instances live under <prefix>/instances/")->capture_default_str();
    s->add_option("--timeout-ms", a->timeout_ms, "bound on each call to etcd")->capture_default_str();
    s->add_option("--secret-file", a->secret_file,
                  "the deployment's shared secret (else $KVBRIDGE_SECRET): register signs its record, "
                  "list and watch show only records signed with it");
  };
  CLI::App* list = app->add_subcommand("list", "Print the registered instances, one per line");
  common(list);
  list->add_flag("--json", a->json, "print each record's JSON");
  CLI::App* watch = app->add_subcommand("watch", "Print the instances, then each change (added, removed, changed)");
  common(watch);
  watch->add_flag("--json", a->json, "print each record's JSON");
  watch->add_option("--duration", a->duration_s, "seconds to watch (default: until SIGINT or SIGTERM)");
  CLI::App* reg = app->add_subcommand("register", "Register an instance under a lease until SIGINT or SIGTERM");
  common(reg);
  reg->add_option("--id", a->id, "instance id")->required();
  reg->add_option("--role", a->role, "prefill or decode")->capture_default_str();
  reg->add_option("--rank", a->ranks, "a rank's side channel host:port, in rank order (repeat)")->required();
  auto* identity = reg->add_option("--identity", a->identity, "layout identity hash (16 hex digits)");
  reg->add_option("--layout", a->layout, "a layout file whose identity hash to publish")->excludes(identity);
  reg->add_option("--protocol", a->protocol, "handshake version")->capture_default_str();
  reg->add_option("--label", a->labels, "key=value (repeat)");
  reg->add_option("--ttl", a->ttl_s, "lease TTL in seconds")->capture_default_str();
  reg->add_option("--duration", a->duration_s, "seconds to stay registered (default: until SIGINT or SIGTERM)");
  return {app, [a, list, watch, reg]() -> int {
#if KVB_HAVE_DISCOVERY
            if (list->parsed()) return run_list(*a);
            if (watch->parsed()) return run_watch(*a);
            if (reg->parsed()) return run_register(*a);
            return kExitUsage;
#else
            (void)list, (void)watch, (void)reg;
            return fail(Status::unavailable(
                "this kvbridge was built without discovery (libcurl not found: install libcurl4-openssl-dev)"));
#endif
          }};
}

}  // namespace kvbridge::cli
