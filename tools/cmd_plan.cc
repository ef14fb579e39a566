// `kvbridge plan`: plans (and optionally verifies) one request from JSON files.
// `kvbridge readers`: which ranks of one instance read which ranks of another.

#include <iostream>
#include <memory>
#include <nlohmann/json.hpp>
#include <vector>

#include "cli.h"
#include "kvbridge/layout_json.h"
#include "kvbridge/plan.h"
#include "kvbridge/verify.h"

namespace kvbridge::cli {
namespace {

struct PlanArgs {
  std::string local;
  std::vector<std::string> remotes;
  std::string request;
  bool verify = false;
  bool items = false;
  bool compact = false;
};

Result<Layout> load_layout(const std::string& path) {
  KVB_ASSIGN_OR_RETURN(std::string text, read_input(path));
  Result<Layout> l = parse_layout(text);
  if (!l) return l.error().with_context(path);
  return l;
}

int run_plan(const PlanArgs& args) {
  Result<Layout> local = load_layout(args.local);
  if (!local) return fail(local.error());
  std::vector<Layout> remotes;
  for (const std::string& path : args.remotes) {
    Result<Layout> r = load_layout(path);
    if (!r) return fail(r.error());
    remotes.push_back(std::move(*r));
  }
  Result<std::string> text = read_input(args.request);
  if (!text) return fail(text.error());
  Result<Request> request = parse_request(*text);
  if (!request) return fail(request.error().with_context(args.request));
  // One request, planned once: a template would plan its shape just as once.
  Result<Plan> p = plan(*local, remotes, *request);
  if (!p) return fail(p.error());
  int verified = -1;
  if (args.verify) {
    Result<VerifyReport> v = verify(*p, *local, remotes, *request);
    verified = v.has_value() ? 1 : 0;
    if (!v) {
      std::cout << plan_to_json(*p, *local, remotes, args.items, verified, args.compact ? -1 : 2) << "\n";
      return fail(v.error());
    }
  }
  std::cout << plan_to_json(*p, *local, remotes, args.items, verified, args.compact ? -1 : 2) << "\n";
  return 0;
}

struct ReadersArgs {
  std::vector<std::string> locals, remotes;
  bool compact = false;
};

int run_readers(const ReadersArgs& args) {
  std::vector<Layout> locals, remotes;
  for (const auto& [paths, out] : {std::pair{&args.locals, &locals}, std::pair{&args.remotes, &remotes}}) {
    for (const std::string& path : *paths) {
      Result<Layout> l = load_layout(path);
      if (!l) return fail(l.error());
      out->push_back(std::move(*l));
    }
  }
  Result<std::vector<SourceReaders>> readers = readers_per_source(locals, remotes);
  if (!readers) return fail(readers.error());
  nlohmann::ordered_json j;
  j["format"] = "kvbridge.readers/1";
  nlohmann::ordered_json sources = nlohmann::ordered_json::array();
  for (const SourceReaders& s : *readers) {
    nlohmann::ordered_json o;
    o["rank"] = s.rank;
    o["readers"] = s.readers.size();
    o["reader_ranks"] = s.readers;
    sources.push_back(std::move(o));
  }
  j["sources"] = std::move(sources);
  nlohmann::ordered_json reads = nlohmann::ordered_json::array();
  for (const Layout& local : locals) {
    Result<std::vector<uint32_t>> from = source_ranks(local, remotes);
    if (!from) return fail(from.error());
    reads.push_back({{"rank", local.rank()}, {"source_ranks", *from}});
  }
  j["locals"] = std::move(reads);
  std::cout << j.dump(args.compact ? -1 : 2) << "\n";
  return 0;
}

}  // namespace

Command add_readers_command(CLI::App& root) {
  auto args = std::make_shared<ReadersArgs>();
  CLI::App* app = root.add_subcommand(
      "readers",
      "For a pair of instances: the remote ranks each local rank reads from (the fewest that hold what it needs), "
      "and how many local ranks read each remote rank (kvbridge.readers/1 JSON)");
  app->add_option("--local", args->locals, "Layouts of the reading instance's ranks (e.g. decode), in any order")
      ->required()
      ->expected(1, -1);
  app->add_option("--remote", args->remotes, "Layouts of the instance read from (e.g. prefill), in any order")
      ->required()
      ->expected(1, -1);
  app->add_flag("--compact", args->compact, "Print the JSON on one line");
  return {app, [args] { return run_readers(*args); }};
}

Command add_plan_command(CLI::App& root) {
  auto args = std::make_shared<PlanArgs>();
  CLI::App* app = root.add_subcommand(
      "plan", "Plan one request into a local rank from the ranks of a remote instance (kvbridge.plan/1 JSON)");
  app->add_option("--local", args->local, "The local rank's layout (kvbridge.layout/3), or - for stdin")->required();
  app->add_option("--remote", args->remotes, "Layouts of the remote instance's ranks, in any order")
      ->required()
      ->expected(1, -1);
  app->add_option("--request", args->request, "The request (kvbridge.request/1)")->required();
  app->add_flag("--verify", args->verify, "Check the plan byte by byte against both layouts");
  app->add_flag("--items", args->items, "Include the descriptor list");
  app->add_flag("--compact", args->compact, "Print the JSON on one line");
  return {app, [args] { return run_plan(*args); }};
}

}  // namespace kvbridge::cli
