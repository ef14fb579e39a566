// `kvbridge sim`: what P/D disaggregation costs per rank as the number of
// ranks grows (sim.h has the model; docs/scale.md the findings).

#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <memory>

#include "cli.h"
#include "sim.h"

namespace kvbridge::cli {
namespace {

struct SimArgs {
  SimOptions options;
  bool json = false;
  std::string svg;
};

int run_sim_command(const SimArgs& args) {
  Result<SimReport> report = run_sim(args.options);
  if (!report) return fail(report.error());
  if (!args.svg.empty()) {
    std::ofstream file(args.svg, std::ios::binary | std::ios::trunc);
    file << sim_svg(*report);
    file.close();
    if (!file) return fail(Status::io_error("--svg: cannot write '" + args.svg + "': " + std::strerror(errno)));
  }
  std::cout << (args.json ? sim_json(*report) : sim_table(*report)) << (args.json ? "\n" : "");
  return 0;
}

}  // namespace

Command add_sim_command(CLI::App& root) {
  auto args = std::make_shared<SimArgs>();
  SimOptions& o = args->options;
  CLI::App* app = root.add_subcommand(
      "sim",
      "Model the costs of P/D disaggregation per rank as ranks grow: connections and handshakes (from the planner's "
      "source ranks), handshake bytes (measured), planning CPU (measured), etcd operations (a model), prefix store "
      "operations per Redis Cluster master");
  app->add_option("--preset", o.preset, "The model (see `kvbridge presets`)")->capture_default_str();
  app->add_option("--prefill-tp", o.prefill_tp, "TP size of a prefill instance")->capture_default_str();
  app->add_option("--decode-tp", o.decode_tp, "TP size of a decode instance")->capture_default_str();
  app->add_option("--ranks", o.ranks, "Total ranks per point of the sweep, comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--prefill-share", o.prefill_share, "Share of a point's ranks in prefill instances")
      ->capture_default_str();
  app->add_option("--prefill-instances", o.prefill_instances,
                  "One point: this many prefill instances (with --decode-instances)");
  app->add_option("--decode-instances", o.decode_instances, "One point: this many decode instances");
  app->add_option("--pinned", o.pinned, "Prefill instances each decode instance reads from under pinned routing")
      ->capture_default_str();
  app->add_option("--requests", o.requests, "Requests per point")->capture_default_str();
  app->add_option("--rate", o.rate, "Arrivals per second (Poisson), the whole fleet")->capture_default_str();
  app->add_option("--prompt-tokens", o.prompt_tokens, "Mean prompt length (log-normal)")->capture_default_str();
  app->add_option("--reuse", o.reuse, "Share of requests that reuse a prefix of an earlier one")->capture_default_str();
  app->add_option("--seed", o.seed, "Seed of the workload and the routing")->capture_default_str();
  app->add_option("--plan-samples", o.plan_samples, "Requests planned and timed per point")->capture_default_str();
  app->add_option("--transport", o.transport, "The engines' transport, for the metadata size: tcp or ucx")
      ->capture_default_str();
  app->add_option("--store-nodes", o.store_nodes, "Redis Cluster sizes (masters), comma separated")
      ->delimiter(',')
      ->capture_default_str();
  app->add_option("--store-node-gib", o.store_node_gib, "Memory for objects per Redis master, GiB")
      ->capture_default_str();
  app->add_option("--lease-ttl", o.lease_ttl_s, "etcd model: the lease TTL of an instance's key, seconds")
      ->capture_default_str();
  app->add_option("--churn", o.churn_per_hour, "etcd model: times an hour each instance leaves and rejoins")
      ->capture_default_str();
  app->add_option("--routers", o.routers, "etcd model: watchers besides the decode instances")->capture_default_str();
  app->add_flag("--json", args->json, "Print kvbridge.sim/1 JSON instead of the table");
  app->add_option("--svg", args->svg, "Also write a plot of the sweep to this file");
  return {app, [args] { return run_sim_command(*args); }};
}

}  // namespace kvbridge::cli
