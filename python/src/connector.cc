// The P/D connector's per-rank worker (connector.h); the schedulers are in
// schedulers.cc, the values the worker returns in connector_values.cc. The worker's blocking calls (create, start_load
// with its first handshake, abort, wait_results, close) release the GIL. Times are time.monotonic() seconds, as in
// schedulers.cc.
#include <pybind11/stl.h>

#include <algorithm>
#include <set>

#include "common/text.h"
#include "connector/worker_internal.h"
#include "engine_wrapper.h"
#include "kvbridge/connector.h"
#include "request_id.h"

namespace kvbridge::python {
namespace {

using std::chrono::milliseconds;

// The Python ConnectorWorker: holds its engine (the parent) and the objects
// that own its tensors' memory, and buffers results taken while waiting.
class PyWorker {
 public:
  PyWorker(py::object engine, std::vector<py::object> tensors, std::unique_ptr<ConnectorWorker> worker)
      : engine_obj_(std::move(engine)), tensors_(std::move(tensors)), worker_(std::move(worker)) {
    engine_obj_.cast<PyEngine&>().add_worker();
  }
  ~PyWorker() {
    if (worker_) {
      worker_.reset();
      engine_obj_.cast<PyEngine&>().remove_worker();
    }
  }

  ConnectorWorker& get() {
    if (!worker_) throw_status(Status::unavailable("the ConnectorWorker is closed"));
    return *worker_;
  }
  bool closed() const { return worker_ == nullptr; }

  void close() {
    if (!worker_) return;
    {
      py::gil_scoped_release nogil;
      worker_.reset();
    }
    engine_obj_.cast<PyEngine&>().remove_worker();
    tensors_.clear();
  }

  std::vector<LoadResult> take_results() {
    std::vector<LoadResult> out = std::move(pending_);
    pending_.clear();
    for (LoadResult& r : get().take_results()) out.push_back(std::move(r));
    return out;
  }

  // Waits in slices, running Python's signal handlers between them; true when
  // a result is ready to take.
  bool wait_results(milliseconds timeout) {
    ConnectorWorker& w = get();
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      if (!pending_.empty()) return true;
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      std::vector<LoadResult> got;
      {
        py::gil_scoped_release nogil;
        w.wait_results(std::clamp(left, milliseconds(0), kWaitSlice));
        got = w.take_results();
      }
      for (LoadResult& r : got) pending_.push_back(std::move(r));
      if (!pending_.empty()) return true;
      if (left <= kWaitSlice) return false;
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

  // Waits for the results of `requests`; kTimeout naming the missing ones.
  std::map<RequestId, LoadResult> collect(const std::set<RequestId>& requests, milliseconds timeout) {
    std::map<RequestId, LoadResult> out;
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    for (;;) {
      std::vector<LoadResult> keep;
      for (LoadResult& r : take_results()) {
        if (requests.count(r.request) != 0) {
          out[r.request] = std::move(r);
        } else {
          keep.push_back(std::move(r));
        }
      }
      pending_ = std::move(keep);
      if (out.size() == requests.size()) return out;
      const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
      if (left <= milliseconds(0)) {
        std::string missing;
        for (RequestId id : requests) {
          if (out.count(id) == 0) missing += (missing.empty() ? "" : ", ") + q(id);
        }
        throw_status(Status::timeout("no load result for request(s) " + missing + " within the timeout"));
      }
      // Results of other requests stay in pending_; wait for new ones.
      ConnectorWorker& w = get();
      std::vector<LoadResult> got;
      {
        py::gil_scoped_release nogil;
        w.wait_results(std::min(left, kWaitSlice));
        got = w.take_results();
      }
      for (LoadResult& r : got) pending_.push_back(std::move(r));
      if (PyErr_CheckSignals() != 0) throw py::error_already_set();
    }
  }

 private:
  py::object engine_obj_;
  std::vector<py::object> tensors_;
  std::unique_ptr<ConnectorWorker> worker_;
  std::vector<LoadResult> pending_;
};

void bind_worker_testing(py::module_& m) {
  // Test hooks, out of the API: kvbridge.testing.
  py::module_ t = m.def_submodule("testing", "Hooks for tests and tools; not part of the API.");
  py::class_<connector_internal::RemoteRankView>(t, "RemoteRankView", "What the handshake told about a remote rank.")
      .def_readonly("layout", &connector_internal::RemoteRankView::layout)
      .def_readonly("pid", &connector_internal::RemoteRankView::pid)
      .def_readonly("tensor_bases", &connector_internal::RemoteRankView::tensor_bases);
  t.def(
      "remote_ranks",
      [](PyWorker& w, const std::string& instance) {
        return unwrap(connector_internal::remote_ranks(w.get(), instance));
      },
      py::arg("worker"), py::arg("instance"),
      "What the handshake told `worker` about a remote instance's ranks. Raises NotFound before the\n"
      "first load from it.");
}

void bind_worker(py::module_& m) {
  py::class_<PyWorker>(m, "ConnectorWorker",
                       "The connector on one rank (prefill or decode): registers the rank's tensors with an\n"
                       "Engine, serves its metadata on a side channel (side_channel_address), fetches each\n"
                       "remote rank's metadata once (the handshake, on the first load from an instance),\n"
                       "plans each request and runs it as engine reads, sends heartbeats and done messages\n"
                       "to the prefill ranks it reads from, and reports LoadResults. On the prefill side it\n"
                       "reports readers' messages (take_reader_events).\n\n"
                       "The worker holds its Engine and the tensor objects: close it (or leave the `with`\n"
                       "block) before closing the engine. Every method may be called from any thread;\n"
                       "blocking ones release the GIL.")
      .def(py::init([](py::object engine, const Layout& layout, py::object tensors, const std::string& instance_id,
                       const std::string& side_channel_host, const std::string& secret, py::object handshake_timeout,
                       py::object transfer_timeout, py::object heartbeat_interval, bool verify_plans,
                       const std::string& remote_access, uint64_t load_chunk_tokens, uint32_t stream_layers_per_stage,
                       const std::string& side_channel_advertise_host, const std::string& mode, bool verify_content) {
             PyEngine& pe = engine.cast<PyEngine&>();
             std::vector<std::string> names;
             for (const Tensor& t : layout.tensors) names.push_back(t.name);
             std::vector<Memory> mems = memories_of(tensors, names, true);
             std::vector<std::span<uint8_t>> spans;
             std::vector<py::object> owners;
             for (size_t i = 0; i < mems.size(); ++i) {
               if (mems[i].memory != layout.tensors[i].memory) {
                 throw_status(Status::invalid_argument("tensor '" + names[i] + "' is " + mems[i].memory +
                                                       " memory but the layout says " + layout.tensors[i].memory));
               }
               spans.emplace_back(mems[i].data, mems[i].bytes);
               owners.push_back(py::isinstance<py::dict>(tensors)
                                    ? py::reinterpret_borrow<py::object>(tensors[py::str(names[i])])
                                    : py::reinterpret_borrow<py::object>(tensors.cast<py::sequence>()[i]));
             }
             WorkerOptions o;
             o.instance_id = instance_id;
             o.side_channel_host = side_channel_host;
             o.side_channel_advertise_host = side_channel_advertise_host;
             o.secret = secret;
             o.handshake_timeout = to_millis(handshake_timeout, o.handshake_timeout);
             o.transfer_timeout = to_millis(transfer_timeout, o.transfer_timeout);
             o.heartbeat_interval = to_millis(heartbeat_interval, o.heartbeat_interval);
             o.verify_plans = verify_plans;
             o.verify_content = verify_content;
             o.remote_access = unwrap(parse_remote_access(remote_access));
             o.load_chunk_tokens = load_chunk_tokens;
             o.stream_layers_per_stage = stream_layers_per_stage;
             o.mode = unwrap(parse_transfer_mode(mode));
             Engine& e = pe.get();
             Result<std::unique_ptr<ConnectorWorker>> w = [&] {
               py::gil_scoped_release nogil;
               return ConnectorWorker::create(e, layout, spans, o);
             }();
             return std::make_unique<PyWorker>(engine, std::move(owners), unwrap(std::move(w)));
           }),
           py::arg("engine"), py::arg("layout"), py::arg("tensors"), py::arg("instance_id"),
           py::arg("side_channel_host") = "127.0.0.1", py::arg("secret") = "", py::arg("handshake_timeout") = 5.0,
           py::arg("transfer_timeout") = 30.0, py::arg("heartbeat_interval") = 1.0, py::arg("verify_plans") = false,
           py::arg("remote_access") = "read", py::arg("load_chunk_tokens") = WorkerOptions{}.load_chunk_tokens,
           py::arg("stream_layers_per_stage") = WorkerOptions{}.stream_layers_per_stage,
           py::arg("side_channel_advertise_host") = "", py::arg("mode") = "pull", py::arg("verify_content") = false,
           "Registers each tensor of `layout` with `engine` and starts the side channel.\n\n"
           "tensors: one object per layout tensor (list in layout order, or dict by tensor name), each\n"
           "exactly the tensor's bytes and of its memory kind: torch tensors, numpy arrays, buffers.\n"
           "instance_id: e.g. 'prefill-0'. secret: shared secret of the side channel ('' = none); it\n"
           "must be the engine's own (Engine(secret=...)), or InvalidArgument. Timeouts and the\n"
           "heartbeat interval are seconds. verify_plans: check every plan with verify() before it\n"
           "runs. verify_content: hash every byte moved at its source and where it landed (xxh3), and\n"
           "fail a load whose bytes differ, naming the piece (reads every byte again; device memory on the device). "
           "remote_access: "
           "what peers may do to this rank's tensors: 'read' (a pull-mode\n"
           "prefill rank, the default), 'granted_read' (a reader may read only the blocks handed off\n"
           "to it: hand_off()) or 'none' (a rank that only reads from others).\n"
           "load_chunk_tokens: loads move in token-ordered chunks of about this many tokens, so that\n"
           "a failed load's first_bad_token is its first chunk not whole (0: one chunk per load).\n"
           "stream_layers_per_stage: a streamed load (start_load(stream=True)) reads this many\n"
           "consecutive layers per stage (0: all layers in one stage). side_channel_advertise_host:\n"
           "the address remote ranks are given for the side channel when not side_channel_host\n"
           "(required when that is a wildcard such as '0.0.0.0'). mode: 'pull' (decode ranks read)\n"
           "or 'push' (prefill ranks write into the decode ranks' blocks: push(); decode ranks then\n"
           "grant remote_access='granted_write': each prefill rank may write only the blocks of a\n"
           "load in flight, where the transport serves the writes (tcp), or 'write'); the same on\n"
           "every rank of both instances.")
      .def_property_readonly(
          "side_channel_address", [](PyWorker& w) { return w.get().side_channel_address(); },
          "host:port of this rank's side channel: give it to the other instance's add_remote().")
      .def_property_readonly("layout", [](PyWorker& w) { return w.get().layout(); })
      .def_property_readonly(
          "incarnation", [](PyWorker& w) { return w.get().incarnation(); },
          "This rank's incarnation (its engine's instance id, 16 hex digits): a restarted rank has\n"
          "another. A hand-off names it (start_load(incarnations=)) so a reader never reads a stranger.")
      .def(
          "add_remote",
          [](PyWorker& w, const std::string& instance, std::vector<std::string> addresses) {
            check(w.get().add_remote(instance, std::move(addresses)));
          },
          py::arg("instance"), py::arg("rank_addresses"),
          "The side channel addresses of a remote instance's ranks, in tp_rank order. Other addresses\n"
          "for a known instance replace them (it restarted or moved): the next load handshakes again.")
      .def(
          "remove_remote", [](PyWorker& w, const std::string& instance) { check(w.get().remove_remote(instance)); },
          py::arg("instance"),
          "Forgets a remote instance (it left); loads queued for it fail naming it. NotFound if unknown.")
      .def(
          "blocks_released",
          [](PyWorker& w, Rid request, const std::vector<std::string>& readers_done) {
            w.get().blocks_released(request, readers_done);
          },
          py::arg("request"), py::arg("readers_done") = std::vector<std::string>{},
          "Prefill side: the engine frees the request's blocks now. A reader's done that comes later is\n"
          "answered 'released', so a read that may have seen the blocks' next owner fails; except from\n"
          "the readers named in readers_done (Release.readers_done: their reads ended while the blocks\n"
          "were held). Call it before anything can write to those blocks again.")
      .def(
          "hand_off",
          [](PyWorker& w, Rid request, const std::map<std::string, std::vector<int64_t>>& blocks) {
            check(w.get().hand_off(request, blocks));
          },
          py::arg("request"), py::arg("blocks"),
          "Prefill side, pull mode: the request's KV is in these blocks of this rank ({group: [ids]}),\n"
          "handed off. With remote_access='granted_read', a reader may read exactly those blocks from\n"
          "its first heartbeat for the request until blocks_released(), and nothing else not handed\n"
          "off to it (enforced where this rank serves reads itself: tcp). InvalidArgument naming an\n"
          "unknown group, OutOfRange a block past its group, AlreadyExists if handed off already.")
      .def(
          "connect", [](PyWorker& w, const std::string& instance) { check(w.get().connect(instance)); },
          py::arg("instance"),
          "Handshakes with the instance's ranks and connects to their engines ahead of the first load,\n"
          "on the worker's connect thread: returns at once (NotFound for an instance never added).")
      .def(
          "wait_connected",
          [](PyWorker& w, const std::string& instance, py::object timeout) {
            ConnectorWorker& c = w.get();
            const milliseconds t = to_millis(timeout, std::chrono::seconds(30));
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.wait_connected(instance, t);
            }
            check(s);
          },
          py::arg("instance"), py::arg("timeout") = 30.0,
          "Returns once connected (starting an attempt if none is under way); raises the attempt's\n"
          "error (naming the rank) or Timeout.")
      .def(
          "start_load",
          [](PyWorker& w, Rid request, const std::string& instance, const Request& blocks, bool stream,
             py::object ready, py::object incarnations, py::object addresses) {
            ConnectorWorker& c = w.get();
            LoadOptions o = LoadOptions::streaming(stream);
            o.ready = readiness_of(ready);
            if (!incarnations.is_none()) o.incarnations = incarnations.cast<std::vector<std::string>>();
            if (!addresses.is_none()) o.addresses = addresses.cast<std::vector<std::string>>();
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.start_load(request, instance, blocks, o);
            }
            check(s);
          },
          py::arg("request"), py::arg("instance"), py::arg("blocks"), py::arg("stream") = false,
          py::arg("ready") = py::none(), py::arg("incarnations") = py::none(), py::arg("addresses") = py::none(),
          "Decode side: queues the load of `blocks` (local ids = this rank's blocks, remote ids = the\n"
          "prefill instance's) and returns; the worker's threads handshake (first load from an\n"
          "instance), plan and submit it. Every error after that (Incompatible naming the differing\n"
          "layout field, PermissionDenied for a wrong secret, Unavailable, the planner's) arrives as\n"
          "its LoadResult. Raises here only InvalidArgument for a bad id, NotFound for an unknown\n"
          "instance, AlreadyExists for a request loading.\n"
          "stream=True: layer-wise streaming, started at admission; each stage is read once every\n"
          "prefill rank it reads from announced its layers (save_layer).\n"
          "ready: the engine's pending work on the local blocks (device memory: a torch.cuda.Event, an\n"
          "IPC event handle as bytes, or an int cudaEvent_t): the reads wait for it on the device.\n"
          "incarnations: each prefill rank's incarnation as the hand-off named it; a rank that is\n"
          "another process now fails the load, naming both. addresses: the ranks' side channels as the\n"
          "hand-off named them (default: the instance's); others are handshaken with beside them.\n"
          "A pull load is ok once every prefill rank it read answered that its blocks were still the\n"
          "request's when the reads ended (blocks_released() there says when they stop being).")
      .def(
          "wait_for_layer",
          [](PyWorker& w, Rid request, const std::string& layer, py::object timeout) {
            ConnectorWorker& c = w.get();
            const milliseconds t = to_millis(timeout, std::chrono::seconds(30));
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.wait_for_layer(request, layer, t);
            }
            check(s);
          },
          py::arg("request"), py::arg("layer"), py::arg("timeout") = 30.0,
          "Decode side: returns once every byte of `layer` the load moves has landed (GIL released).\n"
          "Raises the load's error if it ended without it, Timeout, NotFound for an unknown request,\n"
          "InvalidArgument for an unknown layer.")
      .def(
          "stream_to",
          [](PyWorker& w, Rid request, const std::string& instance) {
            ConnectorWorker& c = w.get();
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.stream_to(request, instance);
            }
            check(s);
          },
          py::arg("request"), py::arg("instance"),
          "Prefill side: the decode instance (known by add_remote) whose ranks load `request`\n"
          "streamed; layers saved so far are announced once it is connected. Never blocks: the\n"
          "handshake runs on the worker's connect thread, and its error comes from wait_for_save().")
      .def(
          "push",
          [](PyWorker& w, Rid request, const std::string& instance, const Request& blocks, bool stream,
             py::object ready, bool host_synchronized) {
            ConnectorWorker& c = w.get();
            LoadOptions o = LoadOptions::streaming(stream);
            o.ready = readiness_of(ready);
            o.ready.host_synchronized = host_synchronized;
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.push(request, instance, blocks, o);
            }
            check(s);
          },
          py::arg("request"), py::arg("instance"), py::arg("blocks"), py::arg("stream") = false,
          py::arg("ready") = py::none(), py::arg("host_synchronized") = false,
          "Push mode, prefill side: writes this rank's part of `request` into the blocks of the\n"
          "decode instance `instance` (blocks: what its ranks pass to start_load). Plans as each\n"
          "decode rank does, over every rank of this instance (add_remote() this instance too).\n"
          "stream=False: writes everything now; True: each stage once save_layer() saved its\n"
          "layers. wait_for_save() waits for every write. GIL released: the first call dials.\n"
          "ready (not streamed, device memory): the event after the kernels that wrote the KV (as\n"
          "save_layer's); host_synchronized=True once the host waited for them.")
      .def(
          "save_layer",
          [](PyWorker& w, Rid request, const std::string& layer, py::object ready, bool host_synchronized) {
            Readiness r = readiness_of(ready);
            r.host_synchronized = host_synchronized;
            check(w.get().save_layer(request, layer, r));
          },
          py::arg("request"), py::arg("layer"), py::arg("ready") = py::none(), py::arg("host_synchronized") = false,
          "Prefill side: every token of `layer` of the request is written, or queued on a device:\n"
          "readers may read it once `ready` completed. ready: for device memory, the event recorded\n"
          "after the kernels that wrote the layer (a torch.cuda.Event made interprocess, or its IPC\n"
          "handle as bytes; in push mode also an int cudaEvent_t of this process); readers wait for it\n"
          "on their device. host_synchronized=True instead once the host waited for them. Host memory\n"
          "needs neither. Never blocks. InvalidArgument for an unknown layer, or a device layer\n"
          "without either.")
      .def(
          "wait_for_save",
          [](PyWorker& w, Rid request, py::object timeout) {
            ConnectorWorker& c = w.get();
            const milliseconds t = to_millis(timeout, std::chrono::seconds(30));
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.wait_for_save(request, t);
            }
            check(s);
          },
          py::arg("request"), py::arg("timeout") = 30.0,
          "Prefill side: waits until every announcement of `request` was acknowledged, raises the\n"
          "first error, and forgets the request.")
      .def(
          "poll_saves",
          [](PyWorker& w, std::vector<Rid> requests) {
            ConnectorWorker& c = w.get();
            std::vector<std::pair<Rid, Status>> ended;
            {
              py::gil_scoped_release nogil;
              for (const Rid& r : requests) {
                // A wait of 0 ms: kTimeout only while acknowledgements are missing.
                Status s = c.wait_for_save(r, std::chrono::milliseconds(0));
                if (s.code() != Code::kTimeout) ended.emplace_back(r, std::move(s));
              }
            }
            py::dict out;
            for (auto& [r, s] : ended) out[py::str(r)] = s;
            return out;
          },
          py::arg("requests"),
          "Prefill side: wait_for_save() of each request without waiting: {request: Status} of those\n"
          "whose every announcement (or write) ended, each then forgotten; the others are left out.\n"
          "Never raises for a request.")
      .def(
          "abort",
          [](PyWorker& w, Rid request) {
            ConnectorWorker& c = w.get();
            Status s;
            {
              py::gil_scoped_release nogil;
              s = c.abort(request);
            }
            check(s);
          },
          py::arg("request"),
          "Cancels a load; when it returns no byte of it lands in local memory. Its LoadResult comes\n"
          "with aborted=True. Raises NotFound for an unknown request.")
      .def("take_results", &PyWorker::take_results, "LoadResults of loads that ended since the last call.")
      .def(
          "wait_results",
          [](PyWorker& w, py::object timeout) { return w.wait_results(to_millis(timeout, milliseconds(0))); },
          py::arg("timeout"),
          "Waits (GIL released) until a result is ready or `timeout` seconds pass; True when one is.")
      .def(
          "collect",
          [](PyWorker& w, py::object requests, py::object timeout) {
            std::set<RequestId> ids;
            if (py::isinstance<py::int_>(requests) || py::isinstance<py::str>(requests)) {
              ids.insert(requests.cast<Rid>());
            } else {
              for (py::handle h : requests) ids.insert(h.cast<Rid>());
            }
            return w.collect(ids, to_millis(timeout, std::chrono::seconds(60)));
          },
          py::arg("requests"), py::arg("timeout") = 60.0,
          "Waits for the LoadResults of `requests` (an id or ids) and returns {request: LoadResult}.\n"
          "Results of other requests stay for take_results(). Raises Timeout naming the missing ones.")
      .def(
          "take_reader_events", [](PyWorker& w) { return w.get().take_reader_events(); },
          "Prefill side: readers' heartbeats and done messages since the last call.")
      .def("stats", [](PyWorker& w) { return w.get().stats(); })
      .def_property_readonly("closed", &PyWorker::closed)
      .def("close", &PyWorker::close,
           "Cancels every load in progress, stops the side channel and deregisters the tensors.\n"
           "Idempotent.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyWorker& w, py::args) { w.close(); })
      .def("__repr__", [](PyWorker& w) {
        return w.closed() ? std::string("<kvbridge.ConnectorWorker (closed)>")
                          : "<kvbridge.ConnectorWorker side_channel=" + w.get().side_channel_address() + ">";
      });
}

}  // namespace

void bind_connector(py::module_& m) {
  bind_schedulers(m);
  bind_connector_values(m);
  bind_worker(m);
  bind_worker_testing(m);
}

}  // namespace kvbridge::python
