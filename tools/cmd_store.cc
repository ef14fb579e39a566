// `kvbridge store put|get|stat|bench`: the prefix store on synthetic requests.
//
// put and get build every rank of an instance of a preset in this process,
// with deterministic content (content.h), so get checks byte for byte what it
// read, whatever TP size and block size wrote it. Several processes share
// objects through --redis; `put --rank R` runs one rank of an instance, as an
// engine with one process per rank does, and the parts meet in Redis. --disk
// adds the disk tier (its files outlive the process: a later get reads them).
// bench measures each tier against memcpy, sequential file I/O and
// redis-benchmark in the same run (docs/store.md, "Bench").
#include <nlohmann/json.hpp>

#include <chrono>
#include <cstring>
#include <iostream>
#include <random>

#include "cli.h"
#include "kvbridge/content.h"
#include "kvbridge/presets.h"
#include "kvbridge/store.h"
#include "net/address.h"
#include "store_bench.h"

namespace kvbridge::cli {

Result<RedisOptions> parse_redis(const std::string& spec, const std::string& option) {
  RedisOptions r;
  // "host", "host:port", "[v6]" or "[v6]:port", as every address kvbridge reads.
  KVB_ASSIGN_OR_RETURN(net::HostPort hp, net::parse_host(spec, option, r.port));
  if (hp.port == 0) return Status::invalid_argument(option + " '" + spec + "': port 0 cannot be dialled");
  r.host = hp.host;
  r.port = hp.port;
  r.cluster = option == "--redis-cluster";
  return r;
}

namespace {

using json = nlohmann::ordered_json;

// A miss is not an error; a shared tier that could not be reached is: the
// figures above then say nothing of what it holds.
int shared_tier_status(const StoreArgs& a, const StoreStats& s) {
  const std::string& at = a.redis.empty() ? a.redis_cluster : a.redis;
  if (at.empty() || (s.redis_errors == 0 && s.redis_skipped == 0)) return 0;
  return fail(Status::unavailable("store: the shared tier at " + at + " could not be reached (" +
                                  std::to_string(s.redis_errors) + " failed and " + std::to_string(s.redis_skipped) +
                                  " skipped operations" +
                                  (s.redis_last_error.empty() ? std::string() : ", the last: " + s.redis_last_error) +
                                  "); what it holds was neither read nor written"));
}

// The tiers the options name: memory, --disk, --redis.
Result<StoreOptions> store_options(const StoreArgs& a) {
  StoreOptions o;
  o.hash_block_tokens = a.hash_block_tokens;
  o.memory_bytes = a.memory_mib << 20;
  if (!a.disk.empty()) {
    DiskOptions d;
    d.directory = a.disk;
    d.capacity_bytes = a.disk_mib << 20;
    o.disk = d;
  }
  if (!a.redis.empty() && !a.redis_cluster.empty()) {
    return Status::invalid_argument("--redis and --redis-cluster: give one shared tier");
  }
  if (!a.redis.empty()) {
    KVB_ASSIGN_OR_RETURN(o.redis, parse_redis(a.redis, "--redis"));
  }
  if (!a.redis_cluster.empty()) {
    KVB_ASSIGN_OR_RETURN(o.redis, parse_redis(a.redis_cluster, "--redis-cluster"));
  }
  if (a.redis_timeout_ms != 0) {
    if (!o.redis) return Status::invalid_argument("--redis-timeout-ms needs --redis or --redis-cluster");
    o.redis->command_timeout = std::chrono::milliseconds(a.redis_timeout_ms);
  }
  return o;
}

int run_put_get(const StoreArgs& a, bool is_put) {
  Result<StoreOptions> opts = store_options(a);
  if (!opts.ok()) return fail(opts.error());
  StoreOptions& o = *opts;
  // One rank of an instance in this process: the other ranks are other
  // processes, so the parts meet in Redis.
  if (a.rank >= 0) {
    if (!o.redis) {
      return fail(Status::invalid_argument("store put --rank needs --redis or --redis-cluster (the parts meet there)"));
    }
    o.assembly = Assembly::kShared;
  }
  Result<std::shared_ptr<Store>> store = Store::create(o);
  if (!store.ok()) return fail(store.error());
  Result<SyntheticInstance> inst = SyntheticInstance::create(*store, a, a.num_tokens);
  if (!inst.ok()) return fail(inst.error());
  const std::vector<uint32_t> tokens = synthetic_tokens(a.token_seed, a.num_tokens);
  json out;
  out["preset"] = a.preset;
  out["tp"] = a.tp;
  if (a.rank >= 0) out["rank"] = a.rank;
  out["block_tokens"] = inst->ranks[0]->layout.groups[0].block_tokens;
  out["hash_block_tokens"] = a.hash_block_tokens;
  out["num_tokens"] = a.num_tokens;
  if (is_put) {
    if (Status s = inst->fill(a.num_tokens, a.content_seed); !s.ok()) return fail(s);
    Result<PutResult> p = inst->put(tokens, a.num_tokens);
    if (!p.ok()) return fail(p.error());
    out["parts_written"] = p->parts_written;
    out["objects_present"] = p->objects_present;
    out["objects_published"] = p->objects_published;
    out["objects_rejected"] = p->objects_rejected;
    out["bytes_copied"] = p->bytes_copied;
  } else {
    Result<GetCheck> g = inst->get_and_check(tokens, a.num_tokens, a.content_seed);
    if (!g.ok()) return fail(g.error());
    out["hit_tokens"] = g->hit_tokens;
    out["bytes_copied"] = g->bytes_copied;
    out["memory_objects"] = g->memory_objects;
    out["disk_objects"] = g->disk_objects;
    out["redis_objects"] = g->redis_objects;
    out["cells_checked"] = g->cells;
    out["bad_cells"] = g->bad_cells;
    if (g->bad_cells) out["first_error"] = g->first_error;
  }
  const StoreStats s = (*store)->stats();
  if (s.disk_configured) {
    out["disk_writes"] = s.disk_writes;
    out["disk_objects_held"] = s.disk_objects;
    out["disk_bad_objects"] = s.disk_bad_objects;
  }
  out["redis_writes"] = s.redis_writes;
  out["redis_parts"] = s.redis_parts;
  out["redis_errors"] = s.redis_errors;
  if (!s.redis_last_error.empty()) out["redis_last_error"] = s.redis_last_error;
  std::cout << out.dump(a.json ? -1 : 2) << "\n";
  if (!is_put && out["bad_cells"].get<uint64_t>() != 0) return kExitError;
  return shared_tier_status(a, s);
}

int run_stat(const StoreArgs& a) {
  Result<StoreOptions> o = store_options(a);
  if (!o.ok()) return fail(o.error());
  Result<std::shared_ptr<Store>> store = Store::create(*o);
  if (!store.ok()) return fail(store.error());
  json out;
  Result<SyntheticInstance> inst = SyntheticInstance::create(*store, a, 0);
  if (!inst.ok()) return fail(inst.error());
  const std::vector<uint32_t> tokens = synthetic_tokens(a.token_seed, a.num_tokens);
  Result<LookupResult> l = inst->stores[0].lookup(tokens);
  if (!l.ok()) return fail(l.error());
  out["preset"] = a.preset;
  out["num_tokens"] = a.num_tokens;
  out["hit_tokens"] = l->hit_tokens;
  out["resume_align_tokens"] = inst->stores[0].resume_align_tokens();
  out["memory_objects"] = l->memory_objects;
  out["disk_objects"] = l->disk_objects;
  out["redis_objects"] = l->redis_objects;
  if (o->redis) {
    Result<Store::RedisInfo> info = (*store)->redis_info();
    if (!info.ok()) return fail(info.error());
    out["redis_keys"] = info->keys;
    out["redis_used_memory_bytes"] = info->used_memory_bytes;
  }
  const StoreStats s = (*store)->stats();
  out["redis_errors"] = s.redis_errors;
  if (!s.redis_last_error.empty()) out["redis_last_error"] = s.redis_last_error;
  std::cout << out.dump(a.json ? -1 : 2) << "\n";
  return shared_tier_status(a, s);
}

void add_common(CLI::App* app, StoreArgs* a) {
  app->add_option("--preset", a->preset, "Preset (kvbridge presets)");
  app->add_option("--tp", a->tp, "TP size of the instance (every rank runs here, unless put --rank)");
  app->add_option("--block-tokens", a->block_tokens, "Tokens per block (0: the preset's)");
  app->add_option("--order", a->order, "Physical order: LBHNC, LBNHC or BLHNC");
  app->add_option("--hash-block-tokens", a->hash_block_tokens, "Tokens per hash block (object)");
  app->add_option("--tokens", a->num_tokens, "Tokens of the synthetic prompt");
  app->add_option("--token-seed", a->token_seed, "Seed of the synthetic token ids");
  app->add_option("--content-seed", a->content_seed, "Seed of the KV content pattern");
  app->add_option("--redis", a->redis, "Shared tier HOST:PORT (default: memory only)");
  app->add_option("--redis-cluster", a->redis_cluster,
                  "Shared tier on a Redis Cluster: HOST:PORT of any node. Bench: the cluster to measure "
                  "(default: clusters of 1 and 3 masters of its own)");
  app->add_option("--redis-timeout-ms", a->redis_timeout_ms,
                  "Milliseconds a Redis command may go without progress (0: " +
                      std::to_string(RedisOptions{}.command_timeout.count()) +
                      "). Raise it for objects of tens of MB assembled from parts: the part that completes one "
                      "has Redis checksum it");
  app->add_option("--memory-mib", a->memory_mib, "Memory tier capacity in MiB");
  app->add_option("--disk", a->disk,
                  "Disk tier directory (kept between runs; one process at a time). Bench: where its files go "
                  "(default: a temporary directory)");
  app->add_option("--disk-mib", a->disk_mib, "Disk tier capacity in MiB");
  app->add_flag("--json", a->json, "One-line JSON");
}

}  // namespace

Command add_store_command(CLI::App& root) {
  auto args = std::make_shared<StoreArgs>();
  CLI::App* app = root.add_subcommand("store", "The prefix store: put, get, stat, bench on synthetic requests");
  app->require_subcommand(1);
  CLI::App* put = app->add_subcommand("put", "Fill every rank of an instance (or one: --rank) and put its prefix");
  CLI::App* get = app->add_subcommand("get", "Get a prefix into every rank of an instance and check it byte for byte");
  CLI::App* stat = app->add_subcommand("stat", "Look up a prefix; with --redis, the shared tier's size");
  CLI::App* bench = app->add_subcommand("bench", "Throughput of each tier against memcpy and redis-benchmark");
  for (CLI::App* c : {put, get, stat, bench}) add_common(c, args.get());
  put->add_option("--rank", args->rank,
                  "Put only the part of this rank of the TP instance (the other ranks run as other processes; "
                  "the parts meet in --redis)");
  bench->add_option("--bench-mib", args->bench_mib, "MiB moved per measured put or get");
  bench->add_option("--repeat", args->repeat, "Measurements per row (the best is kept)");
  bench->add_option("--lookup-tokens", args->lookup_tokens, "Prefix length for the lookup row");
  return {app, [=]() -> int {
            if (put->parsed()) return run_put_get(*args, true);
            if (get->parsed()) return run_put_get(*args, false);
            if (stat->parsed()) return run_stat(*args);
            return run_store_bench(*args);
          }};
}

}  // namespace kvbridge::cli
