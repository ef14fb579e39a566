// Bindings of kvbridge/store.h: the prefix store (Store) and a rank's view of
// it (RankStore), with the rank's tensors given as torch tensors, numpy
// arrays or raw allocations (memory.cc). Lookups, gets and puts release the
// GIL.
#include <pybind11/stl.h>

#include <memory>
#include <utility>

#include "bindings.h"
#include "kvbridge/store.h"
#include "net/address.h"

namespace kvbridge::python {
namespace {

// Token ids from a list of ints, a numpy array or a torch tensor.
std::vector<uint32_t> tokens_of(py::handle tokens) {
  py::object t = py::reinterpret_borrow<py::object>(tokens);
  if (py::hasattr(t, "tolist") && !py::isinstance<py::list>(t)) t = t.attr("tolist")();
  try {
    return t.cast<std::vector<uint32_t>>();
  } catch (const py::cast_error&) {
    throw_status(Status::invalid_argument("tokens: expected a sequence of token ids from 0 to 2^32-1"));
  }
}

// A rank bound to a store, with the memory it reads and writes.
class PyRankStore {
 public:
  // tensors None: a view for lookups only (a scheduler process holds no KV).
  // Tensors all of one kind: host memory, or device memory of one device
  // (staged through pinned host memory, RankStoreOptions).
  PyRankStore(std::shared_ptr<Store> store, const Layout& layout, py::object tensors, RankStoreOptions options)
      : tensors_(tensors), lookup_only_(tensors.is_none()) {
    std::vector<std::string> names;
    for (const Tensor& t : layout.tensors) names.push_back(t.name);
    const std::vector<Memory> memories = lookup_only_ ? std::vector<Memory>{} : memories_of(tensors, names, true);
    for (size_t t = 0; t < memories.size(); ++t) {
      const Memory& m = memories[t];
      if (m.memory != memories[0].memory) {
        throw_status(Status::invalid_argument("RankStore: tensor '" + names[t] + "' is " + m.memory + " and tensor '" +
                                              names[0] + "' " + memories[0].memory +
                                              ": a rank's tensors are all of one kind"));
      }
      spans_.emplace_back(m.data, m.bytes);
    }
    if (!memories.empty()) options.memory = memories[0].memory;
    rank_ = std::make_unique<RankStore>(unwrap(RankStore::create(std::move(store), layout, options)));
  }

  RankStore& get() { return *rank_; }
  // The rank's memory for get() and put(); InvalidArgument naming `call` for a lookup-only view.
  TensorMemory memory(const char* call) const {
    if (lookup_only_) {
      throw_status(Status::invalid_argument(std::string("RankStore.") + call +
                                            "(): this RankStore was made without tensors (tensors=None), "
                                            "for lookups only"));
    }
    return spans_;
  }

 private:
  py::object tensors_;  // keeps the memory alive
  bool lookup_only_ = false;
  std::vector<std::span<uint8_t>> spans_;
  std::unique_ptr<RankStore> rank_;
};

py::dict stats_dict(const StoreStats& s) {
  py::dict d;
  d["memory_objects"] = s.memory_objects;
  d["memory_bytes"] = s.memory_bytes;
  d["capacity_bytes"] = s.capacity_bytes;
  d["pooled_bytes"] = s.pooled_bytes;
  d["staging_objects"] = s.staging_objects;
  d["pinned_objects"] = s.pinned_objects;
  d["evictions"] = s.evictions;
  d["rejected"] = s.rejected;
  d["published"] = s.published;
  d["memory_hits"] = s.memory_hits;
  d["disk_hits"] = s.disk_hits;
  d["redis_hits"] = s.redis_hits;
  d["misses"] = s.misses;
  d["disk_configured"] = s.disk_configured;
  d["disk_objects"] = s.disk_objects;
  d["disk_bytes"] = s.disk_bytes;
  d["disk_capacity_bytes"] = s.disk_capacity_bytes;
  d["disk_writes"] = s.disk_writes;
  d["disk_evictions"] = s.disk_evictions;
  d["disk_errors"] = s.disk_errors;
  d["disk_bad_objects"] = s.disk_bad_objects;
  d["redis_configured"] = s.redis_configured;
  d["redis_up"] = s.redis_up;
  d["redis_writes"] = s.redis_writes;
  d["redis_parts"] = s.redis_parts;
  d["redis_errors"] = s.redis_errors;
  d["redis_skipped"] = s.redis_skipped;
  d["redis_last_error"] = s.redis_last_error;
  d["redis_bad_objects"] = s.redis_bad_objects;
  d["redis_redirects"] = s.redis_redirects;
  d["redis_slot_map_updates"] = s.redis_slot_map_updates;
  d["redis_nodes"] = s.redis_nodes;
  return d;
}

}  // namespace

void bind_store(py::module_& m) {
  py::class_<PutResult>(m, "PutResult", "What RankStore.put() stored.")
      .def_readonly("parts_written", &PutResult::parts_written)
      .def_readonly("objects_present", &PutResult::objects_present)
      .def_readonly("objects_published", &PutResult::objects_published)
      .def_readonly("objects_rejected", &PutResult::objects_rejected)
      .def_readonly("bytes_copied", &PutResult::bytes_copied)
      .def("__repr__", [](const PutResult& r) {
        return "<kvbridge.PutResult published=" + std::to_string(r.objects_published) +
               " present=" + std::to_string(r.objects_present) + " bytes_copied=" + std::to_string(r.bytes_copied) +
               ">";
      });
  py::class_<LookupResult>(m, "LookupResult", "The longest prefix the store can resume from.")
      .def_readonly("hit_tokens", &LookupResult::hit_tokens)
      .def_readonly("memory_objects", &LookupResult::memory_objects)
      .def_readonly("disk_objects", &LookupResult::disk_objects)
      .def_readonly("redis_objects", &LookupResult::redis_objects)
      .def("__repr__", [](const LookupResult& r) {
        return "<kvbridge.LookupResult hit_tokens=" + std::to_string(r.hit_tokens) + ">";
      });
  py::class_<GetResult>(m, "GetResult", "What RankStore.get() wrote into the rank's memory.")
      .def_readonly("hit_tokens", &GetResult::hit_tokens)
      .def_readonly("bytes_copied", &GetResult::bytes_copied)
      .def_readonly("memory_objects", &GetResult::memory_objects)
      .def_readonly("disk_objects", &GetResult::disk_objects)
      .def_readonly("redis_objects", &GetResult::redis_objects)
      .def("__repr__", [](const GetResult& r) {
        return "<kvbridge.GetResult hit_tokens=" + std::to_string(r.hit_tokens) +
               " bytes_copied=" + std::to_string(r.bytes_copied) + ">";
      });

  py::class_<Store, std::shared_ptr<Store>>(
      m, "Store",
      "The prefix store (docs/store.md): objects of hash_block_tokens tokens keyed by the chained hash\n"
      "of the tokens and the model's identity, in host memory (LRU), optionally on local disk and in\n"
      "Redis.")
      .def(py::init([](uint64_t hash_block_tokens, uint64_t memory_bytes, std::vector<std::string> extra_keys,
                       py::object redis, const std::string& assembly, std::string redis_key_prefix, py::object disk,
                       uint64_t disk_bytes, py::object redis_cluster) {
             StoreOptions o;
             o.hash_block_tokens = hash_block_tokens;
             o.memory_bytes = memory_bytes;
             o.extra_keys = std::move(extra_keys);
             if (!disk.is_none()) {
               DiskOptions d;
               d.directory = py::str(disk).cast<std::string>();
               d.capacity_bytes = disk_bytes;
               o.disk = d;
             }
             if (!redis.is_none() && !redis_cluster.is_none()) {
               throw_status(Status::invalid_argument("redis and redis_cluster: give one shared tier"));
             }
             if (!redis.is_none() || !redis_cluster.is_none()) {
               const bool cluster = !redis_cluster.is_none();
               net::HostPort hp = unwrap(net::parse_host_port((cluster ? redis_cluster : redis).cast<std::string>(),
                                                              cluster ? "redis_cluster" : "redis"));
               RedisOptions r;
               r.host = hp.host;
               r.port = hp.port;
               r.key_prefix = std::move(redis_key_prefix);
               r.cluster = cluster;
               o.redis = r;
             }
             if (assembly == "in_process") {
               o.assembly = Assembly::kInProcess;
             } else if (assembly == "shared") {
               o.assembly = Assembly::kShared;
             } else {
               throw_status(Status::invalid_argument("assembly '" + assembly + "': expected 'in_process' or 'shared'"));
             }
             return unwrap(Store::create(std::move(o)));
           }),
           py::arg("hash_block_tokens") = 16, py::arg("memory_bytes") = uint64_t{1} << 30,
           py::arg("extra_keys") = std::vector<std::string>{}, py::arg("redis") = py::none(),
           py::arg("assembly") = "in_process", py::arg("redis_key_prefix") = "kvb1:", py::arg("disk") = py::none(),
           py::arg("disk_bytes") = uint64_t{8} << 30, py::arg("redis_cluster") = py::none(),
           "redis: 'host:port' of the shared tier (None: memory only); assembly 'shared' when the ranks of\n"
           "a writing instance run in separate processes; disk: a directory (str or path) for the disk\n"
           "tier, of at most disk_bytes, one Store per directory; redis_cluster: 'host:port' of any node of a\n"
           "Redis Cluster as the shared tier. Raises InvalidArgument for bad options,\n"
           "Unavailable for a directory another Store holds; Redis is contacted by the first operation.")
      .def_property_readonly("hash_block_tokens", [](const Store& s) { return s.options().hash_block_tokens; })
      .def(
          "stats", [](const Store& s) { return stats_dict(s.stats()); }, "The tiers' counters, as a dict.")
      .def("clear_memory", &Store::clear_memory, py::arg("keep_buffers") = false,
           "Drops every unpinned object of the memory tier (not Redis).");

  py::class_<PyRankStore>(m, "RankStore",
                          "One rank's view of a Store: its layout and its tensors (kept alive), which put() reads\n"
                          "and get() writes. Tokens are a list of ints, a numpy array or a torch tensor. With\n"
                          "tensors=None it only looks up (a scheduler process, which holds no KV).")
      .def(py::init([](std::shared_ptr<Store> store, const Layout& layout, py::object tensors, uint64_t staging_bytes,
                       uint64_t staging_chunk_bytes, const std::string& device_copy) {
             RankStoreOptions o;
             o.staging_bytes = staging_bytes;
             o.staging_chunk_bytes = staging_chunk_bytes;
             o.device_copy = device_copy;
             return std::make_unique<PyRankStore>(std::move(store), layout, std::move(tensors), std::move(o));
           }),
           py::arg("store"), py::arg("layout"), py::arg("tensors") = py::none(),
           py::arg("staging_bytes") = RankStoreOptions().staging_bytes,
           py::arg("staging_chunk_bytes") = RankStoreOptions().staging_chunk_bytes,
           py::arg("device_copy") = RankStoreOptions().device_copy,
           "Raises InvalidArgument when the layout cannot use the store (a pipeline stage, a context\n"
           "shard, a hash block that does not fit a group), naming why. Tensors on a device (CUDA\n"
           "tensors, all on one device) move through staging_bytes of pinned host memory,\n"
           "staging_chunk_bytes per batched device copy (device_copy: 'copy_engine', 'kernel', 'auto').")
      .def_property_readonly("resume_align_tokens", [](PyRankStore& r) { return r.get().resume_align_tokens(); })
      .def(
          "lookup",
          [](PyRankStore& r, py::handle tokens, py::object limit_tokens) {
            const std::vector<uint32_t> t = tokens_of(tokens);
            const uint64_t limit = limit_tokens.is_none() ? UINT64_MAX : limit_tokens.cast<uint64_t>();
            Result<LookupResult> out = Status::internal("unset");
            {
              py::gil_scoped_release nogil;
              out = r.get().lookup(t, limit);
            }
            return unwrap(std::move(out));
          },
          py::arg("tokens"), py::arg("limit_tokens") = py::none(),
          "The longest prefix of the tokens the store can resume from (a multiple of resume_align_tokens).")
      .def(
          "get",
          [](PyRankStore& r, py::handle tokens, const Request& request, py::object ready) {
            const std::vector<uint32_t> t = tokens_of(tokens);
            const TensorMemory memory = r.memory("get");
            const Readiness readiness = readiness_of(ready);
            Result<GetResult> out = Status::internal("unset");
            {
              py::gil_scoped_release nogil;
              out = r.get().get(t, request, memory, readiness);
            }
            return unwrap(std::move(out));
          },
          py::arg("tokens"), py::arg("request"), py::arg("ready") = py::none(),
          "Writes the stored prefix of request.num_tokens tokens into the rank's blocks (request's local\n"
          "ids) and returns how many tokens it holds now. Device tensors: ready is the work still\n"
          "reading those blocks (a torch.cuda.Event recorded after it, or an IPC handle), waited for\n"
          "first; the bytes are on the device when it returns.")
      .def(
          "put",
          [](PyRankStore& r, py::handle tokens, const Request& request, py::object ready) {
            const std::vector<uint32_t> t = tokens_of(tokens);
            const TensorMemory memory = r.memory("put");
            const Readiness readiness = readiness_of(ready);
            Result<PutResult> out = Status::internal("unset");
            {
              py::gil_scoped_release nogil;
              out = r.get().put(t, request, memory, readiness);
            }
            return unwrap(std::move(out));
          },
          py::arg("tokens"), py::arg("request"), py::arg("ready") = py::none(),
          "Stores the full hash blocks of the first request.num_tokens tokens that the rank's blocks\n"
          "(request's local ids) hold. Redis failures are not errors (counted in Store.stats()).\n"
          "Device tensors: ready is the producer's word that the kernels writing those blocks are done\n"
          "(a torch.cuda.Event recorded after them, or an IPC handle), waited for first.");
}

}  // namespace kvbridge::python
