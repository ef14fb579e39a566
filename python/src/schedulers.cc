// The connector's schedulers (connector.h): pure bookkeeping, run with the
// GIL held (which also gives them the single owner they require). Time is a
// time.monotonic() value in seconds (None: now); on Linux both it and
// steady_clock read CLOCK_MONOTONIC.
#include <pybind11/stl.h>

#include "bindings.h"
#include "kvbridge/connector.h"
#include "request_id.h"

namespace kvbridge::python {

void bind_schedulers(py::module_& m) {
  py::class_<Release>(m, "Release", "A held request whose blocks may be freed now (PrefillScheduler).")
      .def_readonly("request", &Release::request)
      .def_property_readonly(
          "reason", [](const Release& r) { return std::string(release_reason_name(r.reason)); },
          "'read', 'lease_expired' or 'aborted'.")
      .def_readonly("readers_missing", &Release::readers_missing, "Expected readers that never reported done.")
      .def_readonly("missing_count", &Release::missing_count,
                    "Held by a reader count: how many readers short of it it was released.")
      .def_readonly("disagreement", &Release::disagreement,
                    "Held by the readers' own count: the readers that said different counts, named (empty when\n"
                    "they agreed).")
      .def_readonly("readers_done", &Release::readers_done,
                    "Readers that reported done before the release: pass them to blocks_released(), so that\n"
                    "their dones that reach another rank later are answered 'held'.")
      .def("__eq__",
           [](const Release& a, const Release& b) {
             return a.request == b.request && a.reason == b.reason && a.readers_missing == b.readers_missing &&
                    a.missing_count == b.missing_count && a.disagreement == b.disagreement &&
                    a.readers_done == b.readers_done;
           })
      .def(py::pickle(
          [](const Release& r) {
            return py::make_tuple(r.request, static_cast<int>(r.reason), r.readers_missing, r.missing_count,
                                  r.disagreement, r.readers_done);
          },
          [](const py::tuple& t) {
            if (t.size() != 6) {
              throw py::value_error(
                  "Release: a pickled state is (request, reason, readers_missing, missing_count, disagreement, "
                  "readers_done)");
            }
            Release r;
            r.request = t[0].cast<Rid>();
            const int reason = t[1].cast<int>();
            if (reason < 0 || reason > static_cast<int>(ReleaseReason::kAborted)) {
              throw py::value_error("Release: unknown reason " + std::to_string(reason));
            }
            r.reason = static_cast<ReleaseReason>(reason);
            r.readers_missing = t[2].cast<std::vector<std::string>>();
            r.missing_count = t[3].cast<uint32_t>();
            r.disagreement = t[4].cast<std::string>();
            r.readers_done = t[5].cast<std::vector<std::string>>();
            return r;
          }))
      .def("__repr__", [](const Release& r) {
        return "Release(request='" + r.request + "', reason='" + std::string(release_reason_name(r.reason)) + "')";
      });

  py::class_<PrefillScheduler>(m, "PrefillScheduler",
                               "Prefill instance bookkeeping: holds a finished request's blocks under a lease\n"
                               "(renewed by readers' heartbeats) and says, once per request, when they may be\n"
                               "freed: every expected reader reported done ('read'), the lease expired, or the\n"
                               "request was aborted and no reader is left. Times are time.monotonic() seconds\n"
                               "(None: now). Not thread-safe: one owner.")
      .def(py::init([](py::object lease, py::object abort_grace) {
             return PrefillScheduler(to_millis(lease, std::chrono::seconds(30)),
                                     to_millis(abort_grace, std::chrono::seconds(2)));
           }),
           py::arg("lease") = 30.0, py::arg("abort_grace") = 2.0,
           "lease: seconds a held request survives without a heartbeat. abort_grace: seconds an aborted\n"
           "request that no reader was heard reading is still held (a reader that started just before\n"
           "is heard first).")
      .def(
          "hold",
          [](PrefillScheduler& s, Rid request, py::object readers, py::object now) {
            if (readers.is_none()) {
              check(s.hold(request, to_steady(now)));
            } else if (py::isinstance<py::int_>(readers) && !py::isinstance<py::bool_>(readers)) {
              const int64_t n = readers.cast<int64_t>();
              if (n < 0 || n > UINT32_MAX) throw_status(Status::invalid_argument("readers: a count from 1 to 2^32-1"));
              check(s.hold(request, static_cast<uint32_t>(n), to_steady(now)));
            } else {
              check(s.hold(request, readers.cast<std::set<std::string>>(), to_steady(now)));
            }
          },
          py::arg("request"), py::arg("readers") = py::none(), py::arg("now") = py::none(),
          "Holds `request` until every rank of the instance that reads it reported done, or the lease\n"
          "(renewed by heartbeats) expires. readers None (the default): the readers say how many they\n"
          "are (ReaderEvent.readers, from their instance's layout), so nobody configures the number.\n"
          "readers may name the decode engines instead (a set), or give a count. Raises AlreadyExists\n"
          "when held, InvalidArgument for an empty set or 0.")
      .def(
          "heartbeat",
          [](PrefillScheduler& s, Rid request, const std::string& reader, py::object now) {
            s.heartbeat(request, reader, to_steady(now));
          },
          py::arg("request"), py::arg("reader"), py::arg("now") = py::none(), "A reader's heartbeat renews the lease.")
      .def(
          "reader_done",
          [](PrefillScheduler& s, Rid request, const std::string& reader, py::object now) {
            s.reader_done(request, reader, to_steady(now));
          },
          py::arg("request"), py::arg("reader"), py::arg("now") = py::none())
      .def(
          "on_reader_event",
          [](PrefillScheduler& s, const ReaderEvent& e, py::object now) { s.on_event(e, to_steady(now)); },
          py::arg("event"), py::arg("now") = py::none(),
          "Feeds a ReaderEvent from ConnectorWorker.take_reader_events() (heartbeat or done).")
      .def(
          "abort", [](PrefillScheduler& s, Rid request, py::object now) { check(s.abort(request, to_steady(now))); },
          py::arg("request"), py::arg("now") = py::none(),
          "Aborts; blocks are released once no reader is reading. Raises NotFound when not held.")
      .def(
          "take_releases", [](PrefillScheduler& s, py::object now) { return s.take_releases(to_steady(now)); },
          py::arg("now") = py::none(), "Requests whose blocks may be freed now, each exactly once.")
      .def_property_readonly("held", &PrefillScheduler::held)
      .def(
          "next_expiry",
          [](const PrefillScheduler& s) -> std::optional<double> {
            auto t = s.next_expiry();
            return t ? std::optional<double>(from_steady(*t)) : std::nullopt;
          },
          "The earliest lease expiry as a time.monotonic() value, or None.");

  py::class_<RequestOutcome>(m, "RequestOutcome", "How a request ended on the decode instance (DecodeScheduler).")
      .def_readonly("request", &RequestOutcome::request)
      .def_property_readonly(
          "outcome", [](const RequestOutcome& o) { return std::string(outcome_name(o.outcome)); },
          "'finished', 'failed', 'recompute' or 'aborted'.")
      .def_readonly("error", &RequestOutcome::error, "The first rank's error (a Status).")
      .def_readonly("recompute_from", &RequestOutcome::recompute_from, "'recompute': the first token to recompute.")
      .def("__eq__",
           [](const RequestOutcome& a, const RequestOutcome& b) {
             return a.request == b.request && a.outcome == b.outcome && a.error.code() == b.error.code() &&
                    a.error.message() == b.error.message() && a.recompute_from == b.recompute_from;
           })
      .def(py::pickle(
          [](const RequestOutcome& o) {
            return py::make_tuple(o.request, static_cast<int>(o.outcome), o.error, o.recompute_from);
          },
          [](const py::tuple& t) {
            if (t.size() != 4) {
              throw py::value_error("RequestOutcome: a pickled state is (request, outcome, error, recompute_from)");
            }
            RequestOutcome o;
            o.request = t[0].cast<Rid>();
            const int outcome = t[1].cast<int>();
            if (outcome < 0 || outcome > static_cast<int>(Outcome::kAborted)) {
              throw py::value_error("RequestOutcome: unknown outcome " + std::to_string(outcome));
            }
            o.outcome = static_cast<Outcome>(outcome);
            o.error = t[2].cast<Status>();
            o.recompute_from = t[3].cast<uint64_t>();
            return o;
          }))
      .def("__repr__", [](const RequestOutcome& o) {
        return "RequestOutcome(request='" + o.request + "', outcome='" + std::string(outcome_name(o.outcome)) + "'" +
               (o.error.ok() ? "" : ", error=" + o.error.to_string()) + ")";
      });

  py::class_<DecodeScheduler>(m, "DecodeScheduler",
                              "Decode instance bookkeeping: tracks requests waiting for remote KV, collects\n"
                              "each rank's LoadResult, and ends each request exactly once as 'finished',\n"
                              "'failed' (policy 'fail'), 'recompute' (policy 'recompute') or 'aborted'.\n"
                              "Not thread-safe: one owner.")
      .def(py::init([](uint32_t ranks, const std::string& policy) {
             return DecodeScheduler(ranks, unwrap(parse_failure_policy(policy)));
           }),
           py::arg("ranks"), py::arg("policy") = "fail", "ranks: the decode instance's TP size.")
      .def(
          "expect",
          [](DecodeScheduler& s, Rid request, uint64_t skip_tokens, py::object deadline, py::object timeout) {
            const auto d = deadline.is_none()
                               ? std::chrono::steady_clock::now() + to_millis(timeout, std::chrono::seconds(30))
                               : to_steady(deadline);
            check(s.expect(request, skip_tokens, d));
          },
          py::arg("request"), py::arg("skip_tokens") = 0, py::arg("deadline") = py::none(), py::arg("timeout") = 30.0,
          "The request now waits for remote KV from every rank until `deadline` (time.monotonic()\n"
          "seconds; None: now + timeout seconds).")
      .def(
          "rank_result", [](DecodeScheduler& s, uint32_t rank, const LoadResult& r) { check(s.rank_result(rank, r)); },
          py::arg("rank"), py::arg("result"),
          "A rank's LoadResult. Raises NotFound for a request not waiting, InvalidArgument for a rank\n"
          "out of range or reported twice.")
      .def(
          "rank_lost",
          [](DecodeScheduler& s, uint32_t rank, py::object why) {
            s.rank_lost(rank, py::isinstance<Status>(why) ? why.cast<Status>()
                                                          : Status::unavailable(py::str(why).cast<std::string>()));
          },
          py::arg("rank"), py::arg("why"), "A rank is gone (why: a Status or a message): its requests fail.")
      .def(
          "abort", [](DecodeScheduler& s, Rid request) { check(s.abort(request)); }, py::arg("request"))
      .def(
          "take_outcomes", [](DecodeScheduler& s, py::object now) { return s.take_outcomes(to_steady(now)); },
          py::arg("now") = py::none(), "Ended requests, each exactly once; requests past their deadline fail.")
      .def_property_readonly("waiting", &DecodeScheduler::waiting);
}

}  // namespace kvbridge::python
