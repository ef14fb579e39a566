// `kvbridge store bench`: each tier against its baseline, measured in the
// same run (docs/store.md, "Bench").
//
// Rows: memory put/get against memcpy of the same bytes in object-sized
// chunks; disk put against writing files of the same count and size
// (open, write(2), close: dd's loop), disk get against read(2)s of the same
// files in chunks of the tier's read size, both with the files in the page
// cache ("get") and evicted from it ("get-cold"); redis put/get against `redis-benchmark -t set,get -d <object bytes>
// -P <pipeline depth> -c 1` on the same server (one connection, like the
// tier); lookup of a long prefix against getting that prefix's bytes. Every
// row has tier, op, value_bytes, bytes, seconds, gbps, baseline,
// baseline_gbps and ratio (gbps / baseline_gbps: higher is better). Each
// figure is the best of --repeat runs.
#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <iostream>
#include <thread>

#include "cli.h"
#include "common/child_process.h"
#include "kvbridge/content.h"
#include "store_bench.h"
#include "testing/redis_cluster.h"
#include "testing/redis_server.h"

namespace kvbridge::cli {
namespace {

using json = nlohmann::ordered_json;
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// rps of SET and GET from redis-benchmark's --csv output.
// `cluster`: with --cluster (which wants 2 masters or more).
Result<std::pair<double, double>> redis_benchmark(const RedisOptions& r, uint64_t value_bytes, uint64_t count,
                                                  bool cluster) {
  // --cluster: the keys spread over the cluster's masters (one connection
  // to each), as the tier spreads its keys.
  const std::string cmd = "redis-benchmark -h " + r.host + " -p " + std::to_string(r.port) +
                          (cluster ? " --cluster" : "") + " -t set,get -d " + std::to_string(value_bytes) + " -P " +
                          std::to_string(r.pipeline_depth) + " -c 1 -n " + std::to_string(count) + " -q --csv";
  // A ChildProcess: it dies with the bench (a killed bench used to leave
  // redis-benchmark running at 100% of a core).
  KVB_ASSIGN_OR_RETURN(auto child, ChildProcess::shell("exec " + cmd, SpawnOptions{.pipe_stdout = true}));
  const std::string out = child->read_all(std::chrono::minutes(10));
  if (!child->wait(std::chrono::seconds(10))) child->stop();
  auto rps = [&](const std::string& test) -> double {
    const size_t at = out.find("\"" + test + "\",\"");
    return at == std::string::npos ? 0.0 : std::atof(out.c_str() + at + test.size() + 4);
  };
  const double set = rps("SET"), get = rps("GET");
  if (set <= 0 || get <= 0) return Status::unavailable("redis-benchmark printed no SET/GET figures: " + out);
  return std::make_pair(set, get);
}

// memcpy of `bytes` from the instance's rank memory into `dst` in chunks of
// `chunk` bytes: the baseline of a tier that moves the same bytes.
double memcpy_seconds(SyntheticInstance& inst, std::vector<uint8_t>& dst, uint64_t bytes, uint64_t chunk) {
  const auto t0 = Clock::now();
  uint64_t done = 0;
  for (auto& r : inst.ranks) {
    for (auto& t : r->spans) {
      for (uint64_t off = 0; off < t.size() && done < bytes; off += chunk) {
        const uint64_t n = std::min({chunk, t.size() - off, bytes - done});
        std::memcpy(dst.data() + done, t.data() + off, n);
        done += n;
      }
    }
  }
  while (done < bytes) {  // more bytes than the rank memory holds: go round
    const uint64_t n = std::min(chunk, bytes - done);
    std::memcpy(dst.data() + done, dst.data(), n);
    done += n;
  }
  return seconds_since(t0);
}

json row(const std::string& tier, const std::string& op, uint64_t value_bytes, uint64_t bytes, double s,
         const std::string& baseline, double baseline_gbps) {
  json j;
  j["tier"] = tier;
  j["op"] = op;
  j["value_bytes"] = value_bytes;
  j["bytes"] = bytes;
  j["seconds"] = s;
  j["gbps"] = s > 0 ? static_cast<double>(bytes) / s / 1e9 : 0.0;
  j["baseline"] = baseline;
  j["baseline_gbps"] = baseline_gbps;
  j["ratio"] = baseline_gbps > 0 ? j["gbps"].get<double>() / baseline_gbps : 0.0;
  return j;
}

// A one-group, one-layer layout with 16-byte cells: lookups cost the same for
// any object size (hashing the tokens, probing each object), so the lookup
// row fills a long prefix without allocating its real bytes.
Layout lookup_layout(uint64_t block_tokens, uint64_t num_blocks) {
  Layout l;
  l.model = "store-bench-lookup";
  l.dtype = "bf16";
  l.tensors.push_back({"kv", num_blocks * block_tokens * 16, "host"});
  Group g;
  g.name = "full";
  g.block_tokens = block_tokens;
  g.num_blocks = num_blocks;
  Component c;
  c.name = "k";
  c.tensor = "kv";
  c.cell_bytes = 16;
  c.axes = {{AxisKind::kBlock, num_blocks, block_tokens * 16}, {AxisKind::kPosition, block_tokens, 16}};
  g.layers.push_back({"layers.0", {c}});
  l.groups.push_back(g);
  return l;
}

// Best seconds of a lookup of `n` tokens from a store whose memory (or only
// Redis) holds them.
Result<double> lookup_seconds(const StoreArgs& a, std::optional<RedisOptions> redis, uint64_t n) {
  StoreOptions o;
  o.hash_block_tokens = a.hash_block_tokens;
  o.memory_bytes = uint64_t{1} << 30;
  o.redis = redis;
  o.extra_keys = {"bench-lookup"};
  KVB_ASSIGN_OR_RETURN(auto store, Store::create(o));
  const uint64_t H = a.hash_block_tokens;
  KVB_ASSIGN_OR_RETURN(std::unique_ptr<RankMem> mem, RankMem::create(lookup_layout(H, n / H + 1)));
  RankMem& m = *mem;
  KVB_ASSIGN_OR_RETURN(RankStore rs, RankStore::create(store, m.layout));
  Request r;
  r.num_tokens = n;
  for (uint64_t i = 0; i < n / H; ++i) r.blocks["full"].local.push_back(static_cast<int64_t>(i));
  r.blocks["full"].remote = r.blocks["full"].local;
  const std::vector<uint32_t> tokens = synthetic_tokens(a.token_seed + 77, n);
  KVB_ASSIGN_OR_RETURN(PutResult p, rs.put(tokens, r, m.memory()));
  (void)p;
  if (redis) store->clear_memory();  // Redis only: the lookup asks Redis
  double best = 1e30;
  for (uint32_t i = 0; i < std::max<uint32_t>(a.repeat, 3); ++i) {
    const auto t0 = Clock::now();
    KVB_ASSIGN_OR_RETURN(LookupResult l, rs.lookup(tokens));
    best = std::min(best, seconds_since(t0));
    if (l.hit_tokens != n / H * H) {
      return Status::internal("lookup bench: hit " + std::to_string(l.hit_tokens) + " of " + std::to_string(n));
    }
  }
  return best;
}

struct TierFigures {
  double put_gbps = 0, get_gbps = 0;
};

// Empties a Redis of the bench's own (FLUSHALL on 127.0.0.1:port).
void flush_own(uint16_t port) {
  Result<std::unique_ptr<ChildProcess>> c =
      ChildProcess::shell("exec redis-cli -p " + std::to_string(port) + " flushall", SpawnOptions{.pipe_stdout = true});
  if (!c.ok()) return;
  (void)(*c)->read_all(std::chrono::seconds(10));
  if (!(*c)->wait(std::chrono::seconds(10))) (*c)->stop();
}

// `empty`, when given, empties the shared tier before each put (untimed):
// the bench's own servers, so a put's SETs reuse the memory the last one
// freed, as redis-benchmark's SETs of one key do, instead of growing Redis
// by a set of objects per repetition.
Result<TierFigures> bench_tier(const StoreArgs& a, std::optional<RedisOptions> redis, uint64_t bench_bytes,
                               uint64_t* value_bytes, double* bytes_per_token, json& rows,
                               const std::function<void()>& empty = nullptr) {
  const std::string tier = redis ? (redis->cluster ? "cluster" : "redis") : "memory";
  // Bytes per token and per object, from one hash block.
  {
    StoreOptions o;
    o.hash_block_tokens = a.hash_block_tokens;
    KVB_ASSIGN_OR_RETURN(auto probe, Store::create(o));
    KVB_ASSIGN_OR_RETURN(SyntheticInstance inst, SyntheticInstance::create(probe, a, a.hash_block_tokens * 64));
    const uint64_t n = inst.stores[0].resume_align_tokens();
    KVB_RETURN_IF_ERROR(inst.fill(n, a.content_seed));
    KVB_ASSIGN_OR_RETURN(PutResult p, inst.put(synthetic_tokens(1, n), n));
    const StoreStats s = probe->stats();
    *value_bytes = s.memory_bytes / std::max<uint64_t>(1, s.memory_objects);
    *bytes_per_token = static_cast<double>(p.bytes_copied) / static_cast<double>(n);
  }
  const uint64_t align = [&] {
    StoreOptions o;
    o.hash_block_tokens = a.hash_block_tokens;
    auto s = Store::create(o);
    auto i = SyntheticInstance::create(*s, a, 0);
    return i.ok() ? i->stores[0].resume_align_tokens() : a.hash_block_tokens;
  }();
  uint64_t n = static_cast<uint64_t>(static_cast<double>(bench_bytes) / *bytes_per_token) / align * align;
  n = std::max(n, align);
  StoreOptions o;
  o.hash_block_tokens = a.hash_block_tokens;
  // Room for one set of objects and some, not two: puts of new prefixes
  // evict the last set and reuse its buffers (a full cache's steady state).
  o.memory_bytes = static_cast<uint64_t>(static_cast<double>(n) * *bytes_per_token * 1.5) + (*value_bytes) * 8;
  o.redis = redis;
  KVB_ASSIGN_OR_RETURN(auto store, Store::create(o));
  KVB_ASSIGN_OR_RETURN(SyntheticInstance writer, SyntheticInstance::create(store, a, n));
  KVB_RETURN_IF_ERROR(writer.fill(n, a.content_seed));
  double put_s = 1e30;
  uint64_t put_bytes = 0;
  std::vector<uint32_t> last;
  for (uint32_t rep = 0; rep <= a.repeat; ++rep) {
    last = synthetic_tokens(a.token_seed * 1000 + rep, n);
    if (empty) empty();
    const auto t0 = Clock::now();
    KVB_ASSIGN_OR_RETURN(PutResult p, writer.put(last, n));
    const double s = seconds_since(t0);
    if (p.objects_rejected) return Status::internal("bench: objects rejected");
    if (rep > 0 || a.repeat == 0) put_s = std::min(put_s, s);
    put_bytes = p.bytes_copied;
  }
  TierFigures f;
  // Get: a reader of the same geometry.
  double get_s = 1e30;
  uint64_t get_bytes = 0;
  // From Redis: one reader store whose memory tier is emptied before each
  // get (its buffers kept, as in a running cache), so every object comes
  // from Redis and is promoted.
  std::shared_ptr<Store> from = store;
  if (redis) {
    KVB_ASSIGN_OR_RETURN(from, Store::create(o));
  }
  KVB_ASSIGN_OR_RETURN(SyntheticInstance reader, SyntheticInstance::create(from, a, n));
  for (uint32_t rep = 0; rep <= a.repeat; ++rep) {
    SyntheticInstance* inst = &reader;
    if (redis) from->clear_memory(true);
    // Touch the destination as a running engine's cache would be.
    for (auto& r : inst->ranks) {
      for (auto& b : r->bytes) std::memset(b.data(), 1, b.size());
    }
    uint64_t bytes = 0, hit = n;
    const auto t0 = Clock::now();
    for (size_t r = 0; r < inst->ranks.size(); ++r) {
      KVB_ASSIGN_OR_RETURN(GetResult g, inst->stores[r].get(last, inst->request(r, n), inst->ranks[r]->memory()));
      bytes += g.bytes_copied;
      hit = std::min(hit, g.hit_tokens);
    }
    const double s = seconds_since(t0);
    if (hit != n) {
      std::string where = "the memory tier";
      if (redis) {
        const StoreStats st = from->stats();
        where = "Redis at " + redis->host + ":" + std::to_string(redis->port) +
                (st.redis_up ? ""
                             : " (down: " + std::to_string(st.redis_errors) +
                                   " failed operations, the last: " + st.redis_last_error + ")");
      }
      return Status::unavailable("bench: a get from " + where + " hit " + std::to_string(hit) + " of " +
                                 std::to_string(n) + " tokens");
    }
    if (rep == 0) {
      KVB_ASSIGN_OR_RETURN(GetCheck c, inst->check(hit, a.content_seed));
      if (c.bad_cells) return Status::internal("bench: the get read wrong bytes: " + c.first_error);
    }
    if (rep > 0 || a.repeat == 0) get_s = std::min(get_s, s);
    get_bytes = bytes;
  }
  f.put_gbps = static_cast<double>(put_bytes) / put_s / 1e9;
  f.get_gbps = static_cast<double>(get_bytes) / get_s / 1e9;
  if (!redis) {
    std::vector<uint8_t> dst(std::max(put_bytes, get_bytes));
    std::memset(dst.data(), 0, dst.size());
    double base_put = 1e30, base_get = 1e30;
    for (uint32_t rep = 0; rep < std::max<uint32_t>(a.repeat, 1); ++rep) {
      base_put = std::min(base_put, memcpy_seconds(writer, dst, put_bytes, *value_bytes));
      base_get = std::min(base_get, memcpy_seconds(writer, dst, get_bytes, *value_bytes));
    }
    rows.push_back(
        row(tier, "put", *value_bytes, put_bytes, put_s, "memcpy", static_cast<double>(put_bytes) / base_put / 1e9));
    rows.push_back(
        row(tier, "get", *value_bytes, get_bytes, get_s, "memcpy", static_cast<double>(get_bytes) / base_get / 1e9));
  } else {
    const uint64_t objects = std::max<uint64_t>(32, store->stats().published);
    const uint32_t nodes = store->stats().redis_nodes;
    KVB_ASSIGN_OR_RETURN(auto rps, redis_benchmark(*redis, *value_bytes, objects, redis->cluster && nodes > 1));
    const std::string how = redis->cluster && nodes > 1 ? "redis-benchmark --cluster " : "redis-benchmark ";
    rows.push_back(row(tier, "put", *value_bytes, put_bytes, put_s, how + "SET",
                       rps.first * static_cast<double>(*value_bytes) / 1e9));
    rows.push_back(row(tier, "get", *value_bytes, get_bytes, get_s, how + "GET",
                       rps.second * static_cast<double>(*value_bytes) / 1e9));
    if (redis->cluster) {
      rows[rows.size() - 2]["nodes"] = nodes;
      rows[rows.size() - 1]["nodes"] = nodes;
    }
  }
  return f;
}

// ---- the disk tier ----

namespace fs = std::filesystem;

// A directory removed with everything in it when the bench is done.
struct ScratchDir {
  std::string path;
  explicit ScratchDir(std::string p) : path(std::move(p)) {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
  ~ScratchDir() {
    std::error_code ec;
    fs::remove_all(path, ec);
  }
};

// The object files of a disk tier directory (everything but LOCK).
std::vector<std::string> object_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (e.is_regular_file() && e.path().filename() != "LOCK") out.push_back(e.path().string());
  }
  std::sort(out.begin(), out.end());
  return out;
}

// Writes the files to the device and drops them from the page cache.
void evict_from_cache(const std::vector<std::string>& files) {
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) continue;
    ::fdatasync(fd);
    ::posix_fadvise(fd, 0, 0, POSIX_FADV_DONTNEED);
    ::close(fd);
  }
}

// dd's read loop over every file: read(2) of `chunk` bytes into one buffer.
Result<std::pair<double, uint64_t>> read_files(const std::vector<std::string>& files, uint64_t chunk) {
  std::vector<uint8_t> buf(chunk);
  uint64_t total = 0;
  const auto t0 = Clock::now();
  for (const std::string& f : files) {
    const int fd = ::open(f.c_str(), O_RDONLY | O_CLOEXEC);
    if (fd < 0) return Status::io_error("bench: opening " + f + ": " + std::strerror(errno));
    ssize_t r;
    while ((r = ::read(fd, buf.data(), chunk)) > 0) total += static_cast<uint64_t>(r);
    ::close(fd);
  }
  return std::make_pair(seconds_since(t0), total);
}

// dd's write loop: `count` files of `bytes` each (open, write, close), kept
// (as the tier keeps its files) until the bench's directory goes.
Result<double> write_files(const std::string& dir, uint64_t count, uint64_t bytes) {
  std::vector<uint8_t> src(bytes, 0x5a);
  fs::create_directories(dir);
  const auto t0 = Clock::now();
  for (uint64_t i = 0; i < count; ++i) {
    const std::string f = dir + "/" + std::to_string(i);
    const int fd = ::open(f.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
    if (fd < 0) return Status::io_error("bench: creating " + f + ": " + std::strerror(errno));
    const bool ok = ::write(fd, src.data(), bytes) == static_cast<ssize_t>(bytes);
    ::close(fd);
    if (!ok) return Status::io_error("bench: writing " + f + ": " + std::strerror(errno));
  }
  return seconds_since(t0);
}

// Disk rows: puts of fresh prefixes through a store with a disk tier, then
// gets of one prefix by a later store on the same directory (a restart: its
// memory empty, cleared before each get), each against dd-style I/O of the
// same files.
Status bench_disk(const StoreArgs& a, uint64_t bench_bytes, uint64_t value_bytes, double bytes_per_token, json& rows) {
  const std::string root =
      a.disk.empty() ? (fs::temp_directory_path() / ("kvb-store-bench-" + std::to_string(::getpid()))).string()
                     : a.disk + "/kvb-store-bench-" + std::to_string(::getpid());
  ScratchDir scratch(root);
  fs::create_directories(root);
  const uint64_t align = [&] {
    StoreOptions o;
    o.hash_block_tokens = a.hash_block_tokens;
    auto s = Store::create(o);
    auto i = SyntheticInstance::create(*s, a, 0);
    return i.ok() ? i->stores[0].resume_align_tokens() : a.hash_block_tokens;
  }();
  const uint64_t n =
      std::max(align, static_cast<uint64_t>(static_cast<double>(bench_bytes) / bytes_per_token) / align * align);
  const uint64_t set_bytes = static_cast<uint64_t>(static_cast<double>(n) * bytes_per_token) + value_bytes * 8;
  StoreOptions o;
  o.hash_block_tokens = a.hash_block_tokens;
  o.memory_bytes = set_bytes + set_bytes / 2;
  DiskOptions d;
  d.capacity_bytes = set_bytes * (a.repeat + 3);
  // Put: fresh prefixes, each written through to disk.
  double put_s = 1e30, base_put = 1e30;
  uint64_t put_bytes = 0, objects = 0;
  {
    d.directory = root + "/put";
    o.disk = d;
    KVB_ASSIGN_OR_RETURN(auto store, Store::create(o));
    KVB_ASSIGN_OR_RETURN(SyntheticInstance writer, SyntheticInstance::create(store, a, n));
    KVB_RETURN_IF_ERROR(writer.fill(n, a.content_seed));
    // The baseline's writes alternate with the tier's (the device's state
    // drifts: writeback, discards), best of each.
    for (uint32_t rep = 0; rep <= a.repeat; ++rep) {
      const uint64_t before = store->stats().disk_writes;
      const auto t0 = Clock::now();
      KVB_ASSIGN_OR_RETURN(PutResult p, writer.put(synthetic_tokens(a.token_seed * 1000 + 500 + rep, n), n));
      const double s = seconds_since(t0);
      objects = store->stats().disk_writes - before;
      if (objects != p.objects_published) {
        return Status::internal("bench: " + std::to_string(p.objects_published) + " objects published but " +
                                std::to_string(objects) + " written to disk");
      }
      if (rep > 0 || a.repeat == 0) put_s = std::min(put_s, s);
      put_bytes = p.bytes_copied;
      KVB_ASSIGN_OR_RETURN(double b, write_files(root + "/dd" + std::to_string(rep), objects, value_bytes));
      if (rep > 0 || a.repeat == 0) base_put = std::min(base_put, b);
    }
  }
  rows.push_back(row("disk", "put", value_bytes, put_bytes, put_s, "write(2) of the files",
                     static_cast<double>(objects * value_bytes) / base_put / 1e9));
  // Get: one prefix, written by one store, read by the next.
  d.directory = root + "/get";
  o.disk = d;
  const std::vector<uint32_t> tokens = synthetic_tokens(a.token_seed * 1000 + 999, n);
  {
    KVB_ASSIGN_OR_RETURN(auto store, Store::create(o));
    KVB_ASSIGN_OR_RETURN(SyntheticInstance writer, SyntheticInstance::create(store, a, n));
    KVB_RETURN_IF_ERROR(writer.fill(n, a.content_seed));
    KVB_ASSIGN_OR_RETURN(PutResult p, writer.put(tokens, n));
    (void)p;
  }
  const std::vector<std::string> files = object_files(d.directory);
  KVB_ASSIGN_OR_RETURN(auto from, Store::create(o));
  KVB_ASSIGN_OR_RETURN(SyntheticInstance reader, SyntheticInstance::create(from, a, n));
  for (const bool cold : {false, true}) {
    double get_s = 1e30, base_s = 1e30;
    uint64_t get_bytes = 0, base_bytes = 0;
    for (uint32_t rep = 0; rep <= a.repeat; ++rep) {
      from->clear_memory(true);
      for (auto& r : reader.ranks) {
        for (auto& b : r->bytes) std::memset(b.data(), 1, b.size());
      }
      if (cold) evict_from_cache(files);
      uint64_t bytes = 0, hit = n, on_disk = 0;
      const auto t0 = Clock::now();
      for (size_t r = 0; r < reader.ranks.size(); ++r) {
        KVB_ASSIGN_OR_RETURN(GetResult g,
                             reader.stores[r].get(tokens, reader.request(r, n), reader.ranks[r]->memory()));
        bytes += g.bytes_copied;
        hit = std::min(hit, g.hit_tokens);
        on_disk += g.disk_objects;
      }
      const double s = seconds_since(t0);
      if (hit != n || on_disk == 0) {
        return Status::internal("bench: a get from the disk tier hit " + std::to_string(hit) + " of " +
                                std::to_string(n) + " tokens (" + std::to_string(on_disk) + " objects from disk)");
      }
      if (rep == 0) {
        KVB_ASSIGN_OR_RETURN(GetCheck c, reader.check(hit, a.content_seed));
        if (c.bad_cells) return Status::internal("bench: the get read wrong bytes: " + c.first_error);
      }
      if (rep > 0 || a.repeat == 0) get_s = std::min(get_s, s);
      get_bytes = bytes;
      if (cold) evict_from_cache(files);
      KVB_ASSIGN_OR_RETURN(auto base, read_files(files, d.io_bytes));
      if (rep > 0 || a.repeat == 0) base_s = std::min(base_s, base.first);
      base_bytes = base.second;
    }
    rows.push_back(row("disk", cold ? "get-cold" : "get", value_bytes, get_bytes, get_s,
                       cold ? "read(2) of the files, uncached" : "read(2) of the files, cached",
                       static_cast<double>(base_bytes) / base_s / 1e9));
  }
  return Status();
}

}  // namespace

int run_store_bench(const StoreArgs& a) {
  json rows = json::array();
  const uint64_t bench_bytes = a.bench_mib << 20;
  uint64_t value_bytes = 0;
  double bytes_per_token = 0;
  Result<TierFigures> mem = bench_tier(a, std::nullopt, bench_bytes, &value_bytes, &bytes_per_token, rows);
  if (!mem.ok()) return fail(mem.error());
  const uint64_t prefix_bytes = static_cast<uint64_t>(bytes_per_token * static_cast<double>(a.lookup_tokens));
  Result<double> lk = lookup_seconds(a, std::nullopt, a.lookup_tokens);
  if (!lk.ok()) return fail(lk.error());
  json lr = row("memory", "lookup", value_bytes, prefix_bytes, *lk, "memory get of the prefix", mem->get_gbps);
  lr["prefix_tokens"] = a.lookup_tokens;
  lr["time_fraction"] = *lk / (static_cast<double>(prefix_bytes) / (mem->get_gbps * 1e9));
  rows.push_back(lr);

  if (Status ds =
          bench_disk(a, std::min<uint64_t>(bench_bytes, uint64_t{128} << 20), value_bytes, bytes_per_token, rows);
      !ds.ok()) {
    return fail(ds);
  }

  std::unique_ptr<testing::RedisServer> child;
  std::optional<RedisOptions> redis;
  if (!a.redis.empty()) {
    Result<RedisOptions> r = parse_redis(a.redis, "--redis");
    if (!r.ok()) return fail(r.error());
    redis = *r;
  } else if (Result<std::unique_ptr<testing::RedisServer>> s = testing::RedisServer::start(); s.ok()) {
    child = std::move(*s);
    RedisOptions r;
    r.port = child->port();
    redis = r;
  } else {
    std::cerr << "kvbridge: store bench: " << s.error().to_string() << "; redis rows skipped\n";
  }
  if (redis) {
    // Redis holds every set put: keep it smaller than the memory rows.
    std::function<void()> empty;
    if (child) empty = [port = child->port()] { flush_own(port); };
    Result<TierFigures> rt = bench_tier(a, redis, std::min<uint64_t>(bench_bytes, uint64_t{128} << 20), &value_bytes,
                                        &bytes_per_token, rows, empty);
    if (!rt.ok()) return fail(rt.error());
    Result<double> rl = lookup_seconds(a, redis, a.lookup_tokens);
    if (!rl.ok()) return fail(rl.error());
    json r = row("redis", "lookup", value_bytes, prefix_bytes, *rl, "redis get of the prefix", rt->get_gbps);
    r["prefix_tokens"] = a.lookup_tokens;
    r["time_fraction"] = *rl / (static_cast<double>(prefix_bytes) / (rt->get_gbps * 1e9));
    rows.push_back(r);
  }
  // The cluster tier: a cluster of its own of 1 and of 3 masters (no
  // replicas: the bench measures the data path), unless --redis-cluster
  // names one.
  std::vector<std::optional<RedisOptions>> clusters;
  std::vector<std::unique_ptr<testing::RedisCluster>> own;
  if (!a.redis_cluster.empty()) {
    Result<RedisOptions> r = parse_redis(a.redis_cluster, "--redis-cluster");
    if (!r.ok()) return fail(r.error());
    clusters.push_back(*r);
  } else {
    for (const int masters : {1, 3}) {
      Result<std::unique_ptr<testing::RedisCluster>> c = testing::RedisCluster::start(masters, 0);
      if (!c.ok()) {
        std::cerr << "kvbridge: store bench: " << c.error().to_string() << "; cluster rows skipped\n";
        break;
      }
      RedisOptions r;
      r.port = (*c)->ports()[0];
      r.cluster = true;
      clusters.push_back(r);
      own.push_back(std::move(*c));
    }
  }
  for (size_t i = 0; i < clusters.size(); ++i) {
    std::function<void()> empty;
    if (i < own.size()) {
      empty = [c = own[i].get()] {
        for (uint16_t m : c->master_ports()) flush_own(m);
      };
    }
    Result<TierFigures> ct = bench_tier(a, clusters[i], std::min<uint64_t>(bench_bytes, uint64_t{64} << 20),
                                        &value_bytes, &bytes_per_token, rows, empty);
    if (!ct.ok()) return fail(ct.error());
  }
  for (json& r : rows) r["preset"] = a.preset;
  if (a.json) {
    std::cout << rows.dump() << "\n";
    return 0;
  }
  std::printf("%-7s %-8s %12s %10s %9s  %-31s %9s %7s\n", "tier", "op", "value_bytes", "bytes", "GB/s", "baseline",
              "GB/s", "ratio");
  for (const json& r : rows) {
    std::printf("%-7s %-8s %12llu %10llu %9.2f  %-31s %9.2f %7.3f\n", r["tier"].get<std::string>().c_str(),
                r["op"].get<std::string>().c_str(), static_cast<unsigned long long>(r["value_bytes"].get<uint64_t>()),
                static_cast<unsigned long long>(r["bytes"].get<uint64_t>()), r["gbps"].get<double>(),
                r["baseline"].get<std::string>().c_str(), r["baseline_gbps"].get<double>(), r["ratio"].get<double>());
  }
  return 0;
}

}  // namespace kvbridge::cli
