// The values the P/D connector's worker takes and returns (connector.h):
// LoadResult, ReaderEvent, WorkerStats and the rest, bound for
// connector.cc's ConnectorWorker. Times are time.monotonic() seconds, as in
// schedulers.cc.
#include <pybind11/stl.h>

#include "bindings.h"
#include "common/text.h"
#include "kvbridge/connector.h"
#include "request_id.h"

namespace kvbridge::python {
namespace {

double seconds_of(std::chrono::microseconds us) { return static_cast<double>(us.count()) / 1e6; }

}  // namespace

void bind_connector_values(py::module_& m) {
  py::class_<LoadResult>(m, "LoadResult",
                         "One rank's result for one request: error is OK when every byte arrived; otherwise\n"
                         "first_bad_token is the first token whose KV did not arrive whole.")
      .def(py::init([](Rid request, const Status& error, bool aborted, uint64_t first_bad_token) {
             LoadResult r;
             r.request = request;
             r.error = error;
             r.aborted = aborted;
             r.first_bad_token = first_bad_token;
             return r;
           }),
           py::arg("request"), py::arg("error") = Status(), py::arg("aborted") = false, py::arg("first_bad_token") = 0,
           "For a load that failed before it started (start_load raised): report it to the\n"
           "DecodeScheduler with the error and the request's skip_tokens as first_bad_token.")
      .def_readwrite("request", &LoadResult::request)
      .def_readwrite("error", &LoadResult::error)
      .def_readwrite("aborted", &LoadResult::aborted)
      .def_readwrite("first_bad_token", &LoadResult::first_bad_token)
      .def_readonly("bytes", &LoadResult::bytes)
      .def_readonly("descriptors", &LoadResult::descriptors)
      .def_readonly("naive_descriptors", &LoadResult::naive_descriptors)
      .def_property_readonly(
          "transfer_time", [](const LoadResult& r) { return seconds_of(r.transfer_time); },
          "Seconds from start_load to the last completion (a streamed load: waiting for the prefill included).")
      .def_property_readonly(
          "last_stage_time", [](const LoadResult& r) { return seconds_of(r.last_stage_time); },
          "Pull: seconds the reads of the stage that landed last took, from submit to last byte (0 in push mode).")
      .def_property_readonly(
          "submit_time", [](const LoadResult& r) { return seconds_of(r.submit_time); },
          "Pull: seconds from start_load to its last read submitted (planning, checking, submitting; streamed: the "
          "waits for the prefill included); 0 in push mode.")
      .def_property_readonly(
          "submit_cpu_time", [](const LoadResult& r) { return seconds_of(r.submit_cpu_time); },
          "Pull: CPU seconds the worker's threads spent planning, checking and submitting the load's reads (the "
          "copies not included); 0 in push mode.")
      .def_readonly("sources", &LoadResult::sources, "Prefill ranks read from (Layout.rank).")
      .def_readonly("stages", &LoadResult::stages, "Reads the load was cut into: chunks, or streamed stages.")
      .def_readonly("first_bad_layer", &LoadResult::first_bad_layer,
                    "On an error: the first layer of the first stage that did not land.")
      .def_property_readonly("ok", [](const LoadResult& r) { return r.error.ok() && !r.aborted; })
      .def("__eq__",
           [](const LoadResult& a, const LoadResult& b) {
             return a.request == b.request && a.error.code() == b.error.code() &&
                    a.error.message() == b.error.message() && a.aborted == b.aborted &&
                    a.first_bad_token == b.first_bad_token && a.bytes == b.bytes && a.descriptors == b.descriptors &&
                    a.naive_descriptors == b.naive_descriptors && a.transfer_time == b.transfer_time &&
                    a.completion_lag == b.completion_lag && a.sources == b.sources && a.stages == b.stages &&
                    a.first_bad_layer == b.first_bad_layer && a.last_stage_time == b.last_stage_time &&
                    a.submit_time == b.submit_time && a.submit_cpu_time == b.submit_cpu_time;
           })
      .def(py::pickle(
          // Every field, so that a result crosses a process boundary whole
          // (a worker process to the scheduler's).
          [](const LoadResult& r) {
            return py::make_tuple(
                r.request, r.error, r.aborted, r.first_bad_token, r.bytes, r.descriptors, r.naive_descriptors,
                static_cast<int64_t>(r.transfer_time.count()), static_cast<int64_t>(r.completion_lag.count()),
                r.sources, r.stages, r.first_bad_layer, static_cast<int64_t>(r.last_stage_time.count()),
                static_cast<int64_t>(r.submit_time.count()), static_cast<int64_t>(r.submit_cpu_time.count()));
          },
          [](const py::tuple& t) {
            if (t.size() != 15) throw py::value_error("LoadResult: a pickled state has 15 fields");
            LoadResult r;
            r.request = t[0].cast<Rid>();
            r.error = t[1].cast<Status>();
            r.aborted = t[2].cast<bool>();
            r.first_bad_token = t[3].cast<uint64_t>();
            r.bytes = t[4].cast<uint64_t>();
            r.descriptors = t[5].cast<uint64_t>();
            r.naive_descriptors = t[6].cast<uint64_t>();
            r.transfer_time = std::chrono::microseconds(t[7].cast<int64_t>());
            r.completion_lag = std::chrono::microseconds(t[8].cast<int64_t>());
            r.sources = t[9].cast<std::vector<uint32_t>>();
            r.stages = t[10].cast<uint32_t>();
            r.first_bad_layer = t[11].cast<std::string>();
            r.last_stage_time = std::chrono::microseconds(t[12].cast<int64_t>());
            r.submit_time = std::chrono::microseconds(t[13].cast<int64_t>());
            r.submit_cpu_time = std::chrono::microseconds(t[14].cast<int64_t>());
            return r;
          }))
      .def("__repr__", [](const LoadResult& r) {
        return "<kvbridge.LoadResult request='" + r.request + "'" +
               (r.error.ok() ? std::string(" ok") : " error=" + r.error.to_string()) + (r.aborted ? " aborted" : "") +
               " bytes=" + std::to_string(r.bytes) + " descriptors=" + std::to_string(r.descriptors) + ">";
      });

  auto reader_event = [](const std::string& kind, Rid request, std::string reader, uint32_t readers) {
    ReaderEvent e;
    e.readers = readers;
    if (kind == "done") {
      e.kind = ReaderEvent::Kind::kDone;
    } else if (kind == "heartbeat") {
      e.kind = ReaderEvent::Kind::kHeartbeat;
    } else {
      throw_status(Status::invalid_argument("ReaderEvent: kind '" + kind + "' is neither 'heartbeat' nor 'done'"));
    }
    e.request = request;
    e.reader = std::move(reader);
    return e;
  };
  py::class_<ReaderEvent>(m, "ReaderEvent", "A reader's heartbeat or done message, seen by a prefill rank.")
      .def(py::init(reader_event), py::arg("kind"), py::arg("request"), py::arg("reader"), py::arg("readers") = 0,
           "ReaderEvent(kind, request, reader, readers=0): kind 'heartbeat' or 'done'; reader the decode\n"
           "engine's name; readers how many ranks of its instance read the request (0: not said). To hand\n"
           "events from a worker process to the scheduler's.")
      .def("__eq__",
           [](const ReaderEvent& a, const ReaderEvent& b) {
             return a.kind == b.kind && a.request == b.request && a.reader == b.reader && a.readers == b.readers;
           })
      .def(py::pickle(
          [](const ReaderEvent& e) {
            return py::make_tuple(e.kind == ReaderEvent::Kind::kDone ? "done" : "heartbeat", e.request, e.reader,
                                  e.readers);
          },
          [reader_event](const py::tuple& t) {
            if (t.size() != 4)
              throw py::value_error("ReaderEvent: a pickled state is (kind, request, reader, readers)");
            return reader_event(t[0].cast<std::string>(), t[1].cast<Rid>(), t[2].cast<std::string>(),
                                t[3].cast<uint32_t>());
          }))
      .def_property_readonly(
          "kind", [](const ReaderEvent& e) { return e.kind == ReaderEvent::Kind::kDone ? "done" : "heartbeat"; },
          "'heartbeat' or 'done'.")
      .def_readonly("request", &ReaderEvent::request)
      .def_readonly("reader", &ReaderEvent::reader, "The decode engine's name.")
      .def_readonly("readers", &ReaderEvent::readers,
                    "How many ranks of the reader's instance read the request (0: not said).")
      .def("__repr__", [](const ReaderEvent& e) {
        return std::string("ReaderEvent(kind='") + (e.kind == ReaderEvent::Kind::kDone ? "done" : "heartbeat") +
               "', request='" + e.request + "', reader='" + e.reader + "', readers=" + std::to_string(e.readers) + ")";
      });

  py::class_<WorkerStats>(m, "WorkerStats", "Counters of a ConnectorWorker.")
      .def_readonly("handshakes", &WorkerStats::handshakes)
      .def_readonly("handshakes_served", &WorkerStats::handshakes_served)
      .def_readonly("handshakes_rejected", &WorkerStats::handshakes_rejected)
      .def_readonly("last_rejection", &WorkerStats::last_rejection)
      .def_readonly("loads_started", &WorkerStats::loads_started)
      .def_readonly("loads_ok", &WorkerStats::loads_ok)
      .def_readonly("loads_failed", &WorkerStats::loads_failed)
      .def_readonly("loads_aborted", &WorkerStats::loads_aborted)
      .def_readonly("plans_verified", &WorkerStats::plans_verified)
      .def_readonly("plans_rejected", &WorkerStats::plans_rejected)
      .def_readonly("plan_templates", &WorkerStats::plan_templates)
      .def_readonly("plans_from_templates", &WorkerStats::plans_from_templates)
      .def_readonly("plans_not_templated", &WorkerStats::plans_not_templated)
      .def_readonly("reads_as_runs", &WorkerStats::reads_as_runs)
      .def_readonly("moved_runs", &WorkerStats::moved_runs)
      .def_readonly("move_tables", &WorkerStats::move_tables)
      .def_readonly("move_tables_kept", &WorkerStats::move_tables_kept)
      .def_readonly("writes_as_runs", &WorkerStats::writes_as_runs)
      .def_readonly("moved_stage_reads", &WorkerStats::moved_stage_reads)
      .def_readonly("prepared_lists", &WorkerStats::prepared_lists)
      .def_readonly("prepared_lists_held", &WorkerStats::prepared_lists_held)
      .def_readonly("moved_stage_writes", &WorkerStats::moved_stage_writes)
      .def_readonly("announcements_sent", &WorkerStats::announcements_sent)
      .def_readonly("announcements_skipped", &WorkerStats::announcements_skipped)
      .def_readonly("plan_template_fallback", &WorkerStats::plan_template_fallback)
      .def_readonly("notifications_failed", &WorkerStats::notifications_failed)
      .def_readonly("reads_refused", &WorkerStats::reads_refused)
      .def_readonly("last_notification_error", &WorkerStats::last_notification_error);
}

}  // namespace kvbridge::python
