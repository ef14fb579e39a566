// Engine: engine.h.
//
// Blocking calls (create, connect, wait, cancel, close) release the GIL.
// wait() sleeps in slices of at most 100 ms and takes the GIL between them
// to run Python's signal handlers, so Ctrl-C interrupts a long wait.
#include <pybind11/numpy.h>
#include <pybind11/stl.h>

#include <algorithm>

#include "engine_wrapper.h"
#include "testing/engine_faults.h"

namespace kvbridge::python {
namespace {

using std::chrono::milliseconds;
constexpr milliseconds kForever{std::chrono::hours(24 * 365)};

TransferOp op_of(py::handle op) {
  if (py::isinstance<py::str>(op)) {
    const std::string s = op.cast<std::string>();
    if (s == "read") return TransferOp::kRead;
    if (s == "write") return TransferOp::kWrite;
    throw_status(Status::invalid_argument("op must be 'read' or 'write', not '" + s + "'"));
  }
  return op.cast<TransferOp>();
}

// items: a sequence of TransferItem, or anything numpy reads as an (N, 5)
// array of unsigned integers (local, local_offset, remote, remote_offset, bytes).
std::vector<TransferItem> items_of(py::handle items) {
  std::vector<TransferItem> out;
  if (py::isinstance<py::sequence>(items) && !py::isinstance<py::array>(items)) {
    py::sequence s = py::reinterpret_borrow<py::sequence>(items);
    if (s.size() > 0 && py::isinstance<TransferItem>(s[0])) {
      for (py::handle h : s) out.push_back(h.cast<TransferItem>());
      return out;
    }
    if (s.size() == 0) return out;
  }
  auto a = py::array_t<uint64_t, py::array::c_style | py::array::forcecast>::ensure(items);
  if (!a || a.ndim() != 2 || a.shape(1) != 5) {
    PyErr_Clear();
    throw_status(Status::invalid_argument(
        "items must be TransferItems or an (N, 5) array of (local, local_offset, remote, remote_offset, bytes)"));
  }
  auto r = a.unchecked<2>();
  for (py::ssize_t i = 0; i < r.shape(0); ++i) {
    out.push_back(
        TransferItem{static_cast<RegionId>(r(i, 0)), r(i, 1), static_cast<RegionId>(r(i, 2)), r(i, 3), r(i, 4)});
  }
  return out;
}

TransferStatus wait_interruptibly(Engine& e, TransferId id, milliseconds timeout) {
  const auto deadline = std::chrono::steady_clock::now() + timeout;
  for (;;) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - std::chrono::steady_clock::now());
    TransferStatus s;
    {
      py::gil_scoped_release nogil;
      s = e.wait(id, std::clamp(left, milliseconds(0), kWaitSlice));
    }
    if (s.state != TransferState::kInProgress || left <= kWaitSlice) return s;
    if (PyErr_CheckSignals() != 0) throw py::error_already_set();
  }
}

std::string bytes_of(py::handle h) {
  if (py::isinstance<py::bytes>(h)) return h.cast<std::string>();
  if (py::isinstance<py::str>(h)) return h.cast<std::string>();
  return py::bytes(py::reinterpret_borrow<py::object>(h)).cast<std::string>();
}

// One "ready" object of submit() into `options`.
void ready_event_of(py::handle h, SubmitOptions* options) {
  const Readiness r = readiness_of(h);
  if (!r.event_handle.empty()) options->ready_event_handles.push_back(r.event_handle);
  if (r.event != 0) {
    if (options->ready_event != 0) {
      throw_status(Status::invalid_argument("submit: ready: at most one event of this process"));
    }
    options->ready_event = r.event;
  }
}

void ready_events_of(py::handle ready, SubmitOptions* options) {
  if (ready.is_none()) return;
  if (py::isinstance<py::list>(ready) || py::isinstance<py::tuple>(ready)) {
    for (py::handle h : ready) ready_event_of(h, options);
  } else {
    ready_event_of(ready, options);
  }
}

void bind_values(py::module_& m) {
  py::enum_<TransferOp>(m, "TransferOp", "read: peer -> local; write: local -> peer.")
      .value("READ", TransferOp::kRead)
      .value("WRITE", TransferOp::kWrite);
  py::enum_<TransferState>(m, "TransferState", "How a transfer stands; it ends exactly once.")
      .value("IN_PROGRESS", TransferState::kInProgress)
      .value("DONE", TransferState::kDone)
      .value("FAILED", TransferState::kFailed)
      .value("CANCELLED", TransferState::kCancelled);

  py::class_<TransferItem>(m, "TransferItem", "One copy of a transfer; offsets from the start of each registration.")
      .def(py::init([](RegionId local, uint64_t local_offset, RegionId remote, uint64_t remote_offset, uint64_t bytes) {
             return TransferItem{local, local_offset, remote, remote_offset, bytes};
           }),
           py::arg("local"), py::arg("local_offset"), py::arg("remote"), py::arg("remote_offset"), py::arg("bytes"))
      .def_readwrite("local", &TransferItem::local)
      .def_readwrite("local_offset", &TransferItem::local_offset)
      .def_readwrite("remote", &TransferItem::remote)
      .def_readwrite("remote_offset", &TransferItem::remote_offset)
      .def_readwrite("bytes", &TransferItem::bytes)
      .def("__repr__", [](const TransferItem& i) {
        return "TransferItem(local=" + std::to_string(i.local) + ", local_offset=" + std::to_string(i.local_offset) +
               ", remote=" + std::to_string(i.remote) + ", remote_offset=" + std::to_string(i.remote_offset) +
               ", bytes=" + std::to_string(i.bytes) + ")";
      });

  py::class_<TransferStatus>(m, "TransferStatus",
                             "A transfer's state; error is a Status (the first error when FAILED, why when "
                             "CANCELLED).")
      .def_readonly("state", &TransferStatus::state)
      .def_readonly("error", &TransferStatus::error)
      .def_readonly("bytes_done", &TransferStatus::bytes_done)
      .def_readonly("bytes_total", &TransferStatus::bytes_total)
      .def_property_readonly(
          "ok", [](const TransferStatus& s) { return s.state == TransferState::kDone; }, "True when DONE.")
      .def_property_readonly(
          "finished", [](const TransferStatus& s) { return s.state != TransferState::kInProgress; },
          "True when the transfer ended (DONE, FAILED or CANCELLED).")
      .def(
          "raise_if_failed",
          [](const TransferStatus& s) {
            if (s.state == TransferState::kFailed || s.state == TransferState::kCancelled) {
              check(s.error.ok() ? Status::internal("transfer ended without an error") : s.error);
            }
          },
          "Raises the error's kvbridge exception when FAILED or CANCELLED (Cancelled, Timeout, ...).")
      .def("__repr__", [](const TransferStatus& s) {
        return "<kvbridge.TransferStatus " + std::string(transfer_state_name(s.state)) + " " +
               std::to_string(s.bytes_done) + "/" + std::to_string(s.bytes_total) + " bytes" +
               (s.error.ok() ? "" : " error=" + s.error.to_string()) + ">";
      });

  py::class_<Notification>(m, "Notification", "A message a peer sent; peer is the sender's engine name.")
      .def_readonly("peer", &Notification::peer)
      .def_readonly("peer_instance", &Notification::peer_instance, "The sender engine's instance id.")
      .def_property_readonly(
          "message", [](const Notification& n) { return py::bytes(n.message); }, "The message bytes.")
      .def_property_readonly(
          "text", [](const Notification& n) { return py::bytes(n.message).attr("decode")("utf-8", "replace"); },
          "The message decoded as UTF-8.")
      .def("__repr__", [](const Notification& n) {
        return "Notification(peer='" + n.peer + "', message=" + std::string(py::repr(py::bytes(n.message))) + ")";
      });

  py::class_<TransportReport>(m, "TransportReport", "A transport this engine can or cannot use, and why.")
      .def_readonly("name", &TransportReport::name)
      .def_readonly("available", &TransportReport::available)
      .def_readonly("reason", &TransportReport::reason)
      .def("__repr__", [](const TransportReport& t) {
        return "TransportReport(name='" + t.name + "', available=" + (t.available ? "True" : "False") +
               (t.reason.empty() ? "" : ", reason='" + t.reason + "'") + ")";
      });

  py::class_<EngineMetrics>(m, "EngineMetrics", "Counters of an engine (Engine.metrics()).")
      .def_readonly("transfers_submitted", &EngineMetrics::transfers_submitted)
      .def_readonly("transfers_done", &EngineMetrics::transfers_done)
      .def_readonly("transfers_failed", &EngineMetrics::transfers_failed)
      .def_readonly("transfers_cancelled", &EngineMetrics::transfers_cancelled)
      .def_readonly("descriptors", &EngineMetrics::descriptors)
      .def_readonly("bytes_read", &EngineMetrics::bytes_read)
      .def_readonly("bytes_written", &EngineMetrics::bytes_written)
      .def_readonly("notifications_sent", &EngineMetrics::notifications_sent)
      .def_readonly("notifications_received", &EngineMetrics::notifications_received)
      .def_readonly("bytes_content_checked", &EngineMetrics::bytes_content_checked)
      .def_readonly("content_check_failures", &EngineMetrics::content_check_failures)
      .def_readonly("worker_wakeups", &EngineMetrics::worker_wakeups,
                    "Times a submit woke the engine's sleeping threads (a batch of submits: a few).")
      .def_readonly("latency_us_buckets", &EngineMetrics::latency_us_buckets,
                    "Completed transfers by latency: bucket k counts < 2^k us (the last: the rest).")
      .def("to_dict", [](const EngineMetrics& e) {
        py::dict d;
        d["transfers_submitted"] = e.transfers_submitted;
        d["transfers_done"] = e.transfers_done;
        d["transfers_failed"] = e.transfers_failed;
        d["transfers_cancelled"] = e.transfers_cancelled;
        d["descriptors"] = e.descriptors;
        d["bytes_read"] = e.bytes_read;
        d["bytes_written"] = e.bytes_written;
        d["notifications_sent"] = e.notifications_sent;
        d["notifications_received"] = e.notifications_received;
        d["bytes_content_checked"] = e.bytes_content_checked;
        d["content_check_failures"] = e.content_check_failures;
        d["worker_wakeups"] = e.worker_wakeups;
        d["latency_us_buckets"] = e.latency_us_buckets;
        return d;
      });
}

// An engine with `faults` armed (testing/engine_faults.h; "" = none): what
// kvbridge.Engine(...) starts without faults and kvbridge.testing.engine_with_faults
// with them.
std::unique_ptr<PyEngine> start_engine(const std::string& faults, const std::string& name,
                                       std::optional<std::vector<std::string>> transports, const std::string& host,
                                       uint32_t tcp_streams, uint32_t threads, py::object default_timeout,
                                       uint64_t inline_bytes, const std::string& secret,
                                       const std::string& advertise_host, const std::string& device_copy,
                                       uint32_t device_copy_blocks, bool ucx_trusted_network,
                                       uint64_t device_copy_kernel_below, uint32_t device_copy_kernel_min,
                                       bool pin_host_memory) {
  EngineOptions o;
  o.name = name;
  if (transports) o.transports = *transports;
  o.host = host;
  o.advertise_host = advertise_host;
  o.tcp_streams = tcp_streams;
  o.threads = threads;
  o.default_timeout = to_millis(default_timeout, o.default_timeout);
  o.inline_bytes = inline_bytes;
  o.secret = secret;
  o.ucx_trusted_network = ucx_trusted_network;
  o.device_copy = device_copy;
  o.device_copy_blocks = device_copy_blocks;
  o.device_copy_kernel_below = device_copy_kernel_below;
  o.device_copy_kernel_min = device_copy_kernel_min;
  o.pin_host_memory = pin_host_memory;
  Result<std::unique_ptr<Engine>> e = [&] {
    py::gil_scoped_release nogil;
    return testing::create_engine_with_faults(o, faults);
  }();
  return std::make_unique<PyEngine>(unwrap(std::move(e)));
}

// Calls bind(args...) with kvbridge.Engine's arguments and their defaults, in
// start_engine's order (after `faults`): Engine(...) and
// testing.engine_with_faults(faults, ...) take the same.
template <typename Bind>
void with_engine_args(Bind&& bind) {
  bind(py::arg("name") = "", py::arg("transports") = py::none(), py::arg("host") = "127.0.0.1",
       py::arg("tcp_streams") = 4, py::arg("threads") = 2, py::arg("default_timeout") = 30.0,
       py::arg("inline_bytes") = EngineOptions{}.inline_bytes, py::arg("secret") = "", py::arg("advertise_host") = "",
       py::arg("device_copy") = "copy_engine", py::arg("device_copy_blocks") = 0,
       py::arg("ucx_trusted_network") = false, py::arg("device_copy_kernel_below") = 0,
       py::arg("device_copy_kernel_min") = EngineOptions{}.device_copy_kernel_min, py::arg("pin_host_memory") = true);
}

}  // namespace

void bind_engine(py::module_& m) {
  bind_values(m);
  py::class_<PyEngine> engine(m, "Engine",
                              "Registered memory, peers and asynchronous transfers: one per process.\n\n"
                              "An Engine registers memory (torch CPU tensors, numpy arrays, any writable buffer; CUDA\n"
                              "tensors in a build with CUDA), publishes metadata() that a peer passes to connect(),\n"
                              "and runs batches of copies as reads (peer -> local) or writes (local -> peer), each\n"
                              "ending exactly once as DONE, FAILED or CANCELLED, with an optional notification to\n"
                              "the peer after the last byte. Transports (local, cma, tcp, ucx) are chosen per peer.\n\n"
                              "The engine keeps a reference to every registered object until deregister_memory()\n"
                              "or close(), so its memory cannot be freed under a transfer. Blocking calls release\n"
                              "the GIL; every method may be called from any thread. Use it as a context manager,\n"
                              "or call close(), to stop its threads deterministically.\n\n"
                              "    with kvbridge.Engine(name='prefill/r0', transports=['cma']) as engine:\n"
                              "        region = engine.register_memory(kv_cache)  # a torch tensor\n"
                              "        blob = engine.metadata()                  # send to the peer");
  with_engine_args([&](auto... args) {
    engine.def(
        py::init([](const std::string& name, std::optional<std::vector<std::string>> transports,
                    const std::string& host, uint32_t tcp_streams, uint32_t threads, py::object default_timeout,
                    uint64_t inline_bytes, const std::string& secret, const std::string& advertise_host,
                    const std::string& device_copy, uint32_t device_copy_blocks, bool ucx_trusted_network,
                    uint64_t device_copy_kernel_below, uint32_t device_copy_kernel_min, bool pin_host_memory) {
          return start_engine("", name, std::move(transports), host, tcp_streams, threads, std::move(default_timeout),
                              inline_bytes, secret, advertise_host, device_copy, device_copy_blocks,
                              ucx_trusted_network, device_copy_kernel_below, device_copy_kernel_min, pin_host_memory);
        }),
        args...,
        "Starts the engine's threads and listeners.\n\n"
        "name: shown to peers and in errors; '' = a name of this engine's own (kvbridge-<host>-<pid>-<hex>).\n"
        "Peers are told apart by name and a random instance id, so names need not be unique. transports: "
        "preference order, e.g.\n"
        "['cma', 'tcp']; None = every available one. host: address the tcp and control listeners\n"
        "bind. advertise_host: the address peers are told to dial, when not host (required when\n"
        "host is a wildcard such as '0.0.0.0'). default_timeout: seconds (or a timedelta) for transfers submitted "
        "without one.\n"
        "secret: shared secret of every control connection and tcp stream ('' = none); peers\n"
        "must hold the same (docs/security.md). UCX's own listener cannot check it: with a secret,\n"
        "ucx is left out of the default transports, and transports=['ucx'] raises InvalidArgument\n"
        "unless ucx_trusted_network=True (every host that can reach UCX's interface is trusted).\n"
        "inline_bytes: a transfer of at most this many bytes without a notification, over local or\n"
        "cma, runs inside submit() (it has ended when submit returns); 0 = always on engine threads.\n"
        "device_copy: how device memory is copied, 'copy_engine' (one cudaMemcpyBatchAsync per transfer)\n"
        "or 'kernel' (a gather/scatter kernel on at most device_copy_blocks blocks, 0 = 32), or 'auto'\n"
        "(the kernel for a transfer of at least device_copy_kernel_min copies of at most\n"
        "device_copy_kernel_below bytes on average, the copy engines otherwise: the crossover gpu_bench\n"
        "measures on the GPU; 0 until then); docs/gpu.md. pin_host_memory: pin registered host memory\n"
        "for copies to and from the GPU, when the engine moves device memory and a GPU is present.\n"
        "Raises Unavailable when a named transport cannot run here (the message says why).");
  });
  engine.def_property_readonly("name", [](PyEngine& e) { return e.get().name(); })
      .def(
          "transports", [](PyEngine& e) { return e.get().transports(); },
          "Every transport with whether this engine can use it, and why not.")
      .def(
          "register_memory",
          [](PyEngine& e, py::object obj, std::optional<std::string> memory, const std::string& access) {
            Memory mem = memory_of(obj, true, "register_memory");
            if (memory) mem.memory = *memory;
            const RemoteAccess a = unwrap(parse_remote_access(access));
            Engine& engine = e.get();
            Result<RegionId> id = [&] {
              py::gil_scoped_release nogil;
              return engine.register_memory(mem.data, mem.bytes, mem.memory, a);
            }();
            const RegionId region = unwrap(std::move(id));
            e.keep(region, obj);
            return region;
          },
          py::arg("obj"), py::arg("memory") = py::none(), py::arg("access") = "read_write",
          "Registers the memory of `obj` and returns its region id. obj: a contiguous torch tensor\n"
          "(CPU; CUDA in a build with CUDA), a writable C-contiguous numpy array or buffer, or a\n"
          "(data_ptr, bytes[, memory]) tuple for memory owned elsewhere. memory overrides the kind\n"
          "('host' or 'cuda:N'). access: what peers may do to it: 'read_write', 'read', 'write' or\n"
          "'none'. Registering the same range again returns the same id (counted).\n"
          "The engine keeps a reference to `obj` until deregister_memory(). Raises InvalidArgument\n"
          "for an empty range, a non-contiguous tensor or an unsupported memory kind.")
      .def(
          "deregister_memory",
          [](PyEngine& e, RegionId id) {
            check(e.get().deregister_memory(id));
            e.drop(id);
          },
          py::arg("region"),
          "Drops one reference to a registration. Raises Unavailable while a transfer uses it,\n"
          "NotFound for an unknown id.")
      .def(
          "metadata", [](PyEngine& e) { return py::bytes(e.get().metadata()); },
          "The bytes a peer passes to connect(): transports and registrations. Registrations made\n"
          "later need a fresh metadata() and connect() again (which refreshes the peer).")
      .def(
          "connect",
          [](PyEngine& e, py::bytes metadata) {
            const std::string md = metadata;
            Engine& engine = e.get();
            Result<PeerId> r = [&] {
              py::gil_scoped_release nogil;
              return engine.connect(md);
            }();
            return unwrap(std::move(r));
          },
          py::arg("metadata"),
          "Connects to the peer whose metadata() this is; returns its peer id (the same id again for\n"
          "the same peer, with its registrations refreshed). Raises InvalidArgument for malformed\n"
          "metadata, Incompatible for a version mismatch, Unavailable when no transport is shared.")
      .def(
          "submit",
          [](PyEngine& e, PeerId peer, py::object op, py::object items, py::object notification, py::object timeout,
             py::object ready) {
            const TransferOp o = op_of(op);
            std::vector<TransferItem> v = items_of(items);
            SubmitOptions options;
            options.notification = notification.is_none() ? std::string() : bytes_of(notification);
            options.timeout = to_millis(timeout, milliseconds(0));
            ready_events_of(ready, &options);
            Engine& engine = e.get();
            Result<TransferId> r = [&] {
              py::gil_scoped_release nogil;
              return engine.submit(peer, o, v, std::move(options));
            }();
            return unwrap(std::move(r));
          },
          py::arg("peer"), py::arg("op"), py::arg("items"), py::arg("notification") = py::none(),
          py::arg("timeout") = py::none(), py::arg("ready") = py::none(),
          "Submits a transfer and returns its id at once.\n\n"
          "op: 'read' (peer -> local) or 'write', or a TransferOp. items: a list of TransferItem, or\n"
          "an (N, 5) integer array/list of (local region, local offset, remote region, remote offset,\n"
          "bytes) such as Plan.transfer_items(). notification: str/bytes delivered to the peer after\n"
          "the last byte. timeout: seconds (None: the engine's default_timeout).\n"
          "ready: device memory only, what the KV is ready after: a torch.cuda.Event (interprocess\n"
          "events by their IPC handle, others as this process's event), bytes of an IPC event handle,\n"
          "an int cudaEvent_t, or a list of them; nothing is copied before they completed.\n"
          "Every item is checked first; on error nothing moves: NotFound (peer, region), OutOfRange\n"
          "(naming the item and region), InvalidArgument (empty batch, zero-length item).")
      .def(
          "status", [](PyEngine& e, TransferId id) { return e.get().status(id); }, py::arg("transfer"),
          "The TransferStatus of a transfer (error NotFound for an unknown id).")
      .def(
          "wait",
          [](PyEngine& e, TransferId id, py::object timeout) {
            return wait_interruptibly(e.get(), id, to_millis(timeout, kForever));
          },
          py::arg("transfer"), py::arg("timeout") = py::none(),
          "Waits (GIL released) until the transfer ends or `timeout` seconds pass, and returns its\n"
          "TransferStatus (IN_PROGRESS on timeout). None waits until it ends: every transfer has a\n"
          "deadline. Does not raise for a failed transfer: call raise_if_failed() on the result.")
      .def(
          "cancel",
          [](PyEngine& e, TransferId id) {
            Engine& engine = e.get();
            Status s;
            {
              py::gil_scoped_release nogil;
              s = engine.cancel(id);
            }
            check(s);
          },
          py::arg("transfer"),
          "Cancels a transfer; when it returns no further byte of it lands in local memory. No error\n"
          "when it had already ended.")
      .def(
          "release", [](PyEngine& e, TransferId id) { check(e.get().release(id)); }, py::arg("transfer"),
          "Forgets an ended transfer. Raises Unavailable while it is in progress.")
      .def(
          "notify",
          [](PyEngine& e, PeerId peer, py::object message) {
            Engine& engine = e.get();
            std::string msg = bytes_of(message);
            Status s;
            {
              py::gil_scoped_release nogil;
              s = engine.notify(peer, std::move(msg));
            }
            check(s);
          },
          py::arg("peer"), py::arg("message"),
          "Sends a notification (str or bytes) after every earlier transfer to the peer.")
      .def(
          "take_notifications", [](PyEngine& e) { return e.get().take_notifications(); },
          "Notifications received since the last call, in arrival order per peer.")
      .def(
          "metrics", [](PyEngine& e) { return e.get().metrics(); }, "The engine's EngineMetrics.")
      .def(
          "metrics_prometheus", [](PyEngine& e) { return e.get().metrics_prometheus(); },
          "Prometheus text exposition of metrics() (names prefixed 'kvbridge_').")
      .def_property_readonly("closed", &PyEngine::closed)
      .def("close", &PyEngine::close,
           "Cancels every transfer in progress, closes peers and joins threads (GIL released), then\n"
           "drops the references to registered objects. Raises Unavailable while a ConnectorWorker of\n"
           "this engine is open. Idempotent.")
      .def("__enter__", [](py::object self) { return self; })
      .def("__exit__", [](PyEngine& e, py::args) { e.close(); })
      .def("__repr__", [](PyEngine& e) {
        return e.closed() ? std::string("<kvbridge.Engine (closed)>") : "<kvbridge.Engine '" + e.get().name() + "'>";
      });
}

// One "ready" object: a torch.cuda.Event (its IPC handle when it was made
// interprocess, else its cudaEvent_t), bytes of an IPC event handle, or an
// int cudaEvent_t of this process.
Readiness readiness_of(py::handle h) {
  Readiness r;
  if (h.is_none()) return r;
  if (py::isinstance<py::bytes>(h)) {
    r.event_handle = h.cast<std::string>();
  } else if (py::isinstance<py::int_>(h) && !py::isinstance<py::bool_>(h)) {
    r.event = h.cast<uintptr_t>();
  } else if (py::hasattr(h, "ipc_handle") && py::hasattr(h, "cuda_event")) {
    // torch makes an Event's CUDA event at its first record: none yet is
    // an event never recorded, which CUDA would call complete.
    const uintptr_t raw = h.attr("cuda_event").cast<uintptr_t>();
    if (raw == 0) {
      throw_status(Status::invalid_argument(
          "ready: this torch.cuda.Event was never recorded: record it on the stream that writes the KV, after "
          "that work, before handing it over"));
    }
    // Whether it is interprocess is asked once per event (ipc_handle()
    // raises for one that is not) and kept on the event.
    static constexpr const char* kKept = "_kvbridge_ipc_handle";
    py::object handle;
    if (py::hasattr(h, kKept)) {
      handle = h.attr(kKept);
    } else {
      try {
        handle = h.attr("ipc_handle")();
      } catch (py::error_already_set&) {
        handle = py::none();  // not an interprocess event: this process's own
      }
      try {
        h.attr(kKept) = handle;
      } catch (py::error_already_set&) {
        // an event type without attributes of its own: asked again next time
      }
    }
    if (!handle.is_none()) {
      r.event_handle = handle.cast<std::string>();
    } else {
      r.event = raw;
    }
  } else {
    throw_status(Status::invalid_argument(
        "ready: expected a torch.cuda.Event, bytes of an IPC event handle or an int cudaEvent_t, not " +
        std::string(py::str(h.get_type().attr("__name__")))));
  }
  return r;
}

void bind_engine_testing(py::module_& m) {
  py::module_ t = m.attr("testing");
  with_engine_args([&](auto... args) {
    t.def("engine_with_faults", &start_engine, py::arg("faults"), args...,
          "A kvbridge.Engine (the same arguments after `faults`) whose transports misbehave on\n"
          "purpose, for tests only. faults, comma-separated: 'delay=MS' (every copy sleeps MS first),\n"
          "'drop-notifications=N' (the next N notifications it sends are lost), 'drop-done=N' (the\n"
          "same for the next N connector done messages only), 'drop-rate=P', 'duplicate-rate=P',\n"
          "'seed=S' (each notification is lost, or sent twice, with probability P per mille, drawn\n"
          "from a generator seeded with S); '' = none. Raises InvalidArgument naming an unknown fault.");
  });
}

}  // namespace kvbridge::python
