// The report of `kvbridge demo`: a table, or one JSON object with --json, and
// whether the run was clean for its --inject.
#include <unistd.h>

#include <algorithm>
#include <cstdio>

#include "demo_driver.h"
#include "device/device.h"

namespace kvbridge::cli::demo {
namespace {

// What the ranks' device is: the GPUs, or the host fake.
std::string device_text() {
  device::Device& d = device::current();
  Result<int> n = d.count();
  if (d.name() == "fake") return "(the host fake, KVB_DEVICE=fake)";
  return "(" + (n.ok() ? std::to_string(*n) : std::string("no")) + " GPU(s))";
}

using nlohmann::json;

double gbps(uint64_t bytes, uint64_t us) {
  return us == 0 ? 0.0 : static_cast<double>(bytes) / static_cast<double>(us) / 1000.0;
}

// The upper middle value (what the report's p50 figures are), 0 if empty.
double p50(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

double median(std::vector<double> v) {
  if (v.empty()) return 0.0;
  std::sort(v.begin(), v.end());
  return v.size() % 2 ? v[v.size() / 2] : (v[v.size() / 2 - 1] + v[v.size() / 2]) / 2;
}

struct Figures {
  uint64_t ok = 0, failed = 0, recomputed = 0, aborted = 0, lease_expired = 0, verify_failures = 0;
  uint64_t timed = 0;  // finished loads the transfer figures are over
  uint64_t bytes = 0, descriptors = 0, naive = 0, transfer_us = 0, raw_us = 0, raw_bytes = 0;
  // --flood: median GB/s of the loads under the flood and after it. The
  // first load is left out of both: it pays for the first connections and
  // page faults (about 3x the others), and would count against the flood.
  double flooded_gbps = 0, quiet_gbps = 0;
  uint64_t recompute_kept = 0, recompute_moving = 0;  // recomputed: tokens kept of the tokens to move
  double p50_ms = 0, p99_ms = 0;
  double lag_p50_us = 0, lag_p99_us = 0;  // the last byte landing to the load's result
  // The hand-off of unstreamed requests, the same span in pull and push:
  // the last prefill rank done to the last decode rank holding all its KV
  // (the driver's messages, planning and every rank's transfer included).
  uint64_t handoff_bytes = 0;
  double handoff_ms = 0, handoff_p50_ms = 0;
  double start_p50_us = 0, start_max_us = 0;  // start_load's return, the first load's handshake included
  std::vector<std::string> errors;
};

// The transfer figures (throughput, latency, descriptors) of finished
// loads that were not streamed: a streamed load's time includes waiting for
// the prefill. With --stream they come from the unstreamed reruns.
Figures figures(const Summary& s) {
  Figures f;
  std::vector<uint64_t> lat, lags;
  std::vector<double> flooded, quiet, handoffs;
  const auto handoff = [&](const RequestRecord& r) {
    if (r.exposed_ms <= 0) return;
    f.handoff_bytes += r.bytes;
    f.handoff_ms += r.exposed_ms;
    handoffs.push_back(r.exposed_ms);
  };
  for (const RequestRecord& r : s.baselines) {
    if (r.outcome != "finished" || r.streamed) continue;
    f.bytes += r.bytes;
    f.descriptors += r.descriptors;
    f.naive += r.naive;
    f.transfer_us += r.transfer_us;
    ++f.timed;
    if (r.raw_us > 0) {
      f.raw_us += r.raw_us;
      f.raw_bytes += r.bytes;
    }
    lat.push_back(r.transfer_us);
    lags.push_back(r.completion_lag_us);
    handoff(r);
  }
  for (const RequestRecord& r : s.requests) {
    if (r.verify_bad > 0) ++f.verify_failures;
    if (r.outcome == "finished") {
      ++f.ok;
      if (r.streamed) {
        lags.push_back(r.completion_lag_us);
        continue;
      }
      ++f.timed;
      f.bytes += r.bytes;
      f.descriptors += r.descriptors;
      f.naive += r.naive;
      f.transfer_us += r.transfer_us;
      if (f.timed > 1) (r.flooded ? flooded : quiet).push_back(gbps(r.bytes, r.transfer_us));
      if (r.raw_us > 0) {
        f.raw_us += r.raw_us;
        f.raw_bytes += r.bytes;
      }
      lat.push_back(r.transfer_us);
      lags.push_back(r.completion_lag_us);
      handoff(r);
    } else {
      if (r.outcome == "recomputed") {
        ++f.recomputed;
        f.recompute_kept += r.recompute_from - r.skip;
        f.recompute_moving += r.tokens - r.skip;
      }
      if (r.outcome == "aborted") ++f.aborted;
      if (r.outcome == "lease_expired") ++f.lease_expired;
      if (r.outcome == "failed" || r.outcome == "lease_expired") ++f.failed;
      if (!r.error.empty() && f.errors.size() < 8) f.errors.push_back("request " + r.id + ": " + r.error);
    }
  }
  if (!handoffs.empty()) {
    std::sort(handoffs.begin(), handoffs.end());
    f.handoff_p50_ms = handoffs[handoffs.size() / 2];
  }
  std::sort(lat.begin(), lat.end());
  auto pct = [&](double p) {
    if (lat.empty()) return 0.0;
    const size_t i = std::min(lat.size() - 1, static_cast<size_t>(p * static_cast<double>(lat.size() - 1) + 0.5));
    return static_cast<double>(lat[i]) / 1000.0;
  };
  f.p50_ms = pct(0.50);
  f.p99_ms = pct(0.99);
  f.flooded_gbps = median(flooded);
  f.quiet_gbps = median(quiet);
  std::vector<uint64_t> starts;
  for (const RequestRecord& r : s.requests) starts.push_back(r.start_ns);
  std::sort(starts.begin(), starts.end());
  if (!starts.empty()) {
    f.start_p50_us = static_cast<double>(starts[starts.size() / 2]) / 1000.0;
    f.start_max_us = static_cast<double>(starts.back()) / 1000.0;
  }
  std::sort(lags.begin(), lags.end());
  if (!lags.empty()) {
    f.lag_p50_us = static_cast<double>(lags[std::min(lags.size() - 1, lags.size() / 2)]);
    f.lag_p99_us = static_cast<double>(lags[std::min(lags.size() - 1, (lags.size() * 99 + 50) / 100)]);
  }
  return f;
}

// p50 of the TTFT and exposed-transfer figures of `records` (finished ones),
// and of the exposed transfer over the last stage's reads per request (pull
// only: push has no per-stage read time).
struct Ttft {
  size_t n = 0;
  double ttft_ms = 0, exposed_ms = 0, last_stage_ms = 0, exposed_per_last_stage = 0;
};
Ttft ttft(const std::vector<RequestRecord>& records, bool streamed_only) {
  std::vector<double> t, e, l, x;
  for (const RequestRecord& r : records) {
    if (r.outcome != "finished" || r.ttft_ms <= 0 || (streamed_only && !r.streamed)) continue;
    t.push_back(r.ttft_ms);
    e.push_back(r.exposed_ms);
    if (r.last_stage_ms > 0) {
      l.push_back(r.last_stage_ms);
      x.push_back(r.exposed_ms / r.last_stage_ms);
    }
  }
  Ttft out;
  out.n = t.size();
  if (t.empty()) return out;
  out.ttft_ms = p50(std::move(t));
  out.exposed_ms = p50(std::move(e));
  out.last_stage_ms = p50(std::move(l));
  out.exposed_per_last_stage = p50(std::move(x));
  return out;
}

// p50 over the requests of each one's TTFT against its own unstreamed
// rerun's: the pairs share tokens, prefix hit and decode instance, so a
// request that is slow for its own reasons (the first, which also pays the
// handshakes) does not shift one p50 and not the other. 0 without pairs
// (streaming off, or a fault injected: no reruns).
double paired_ttft_ratio(const Summary& s) {
  if (s.baselines.size() != s.requests.size()) return 0;
  std::vector<double> r;
  for (size_t i = 0; i < s.requests.size(); ++i) {
    const RequestRecord &a = s.requests[i], &b = s.baselines[i];
    if (a.outcome != "finished" || b.outcome != "finished" || a.ttft_ms <= 0 || b.ttft_ms <= 0) continue;
    r.push_back(a.ttft_ms / b.ttft_ms);
  }
  return p50(std::move(r));
}

}  // namespace

void add_final(Summary& s, const std::string& engine, const nlohmann::json& f) {
  const auto count = [&f](const char* key) { return f.value(key, uint64_t{0}); };
  const auto text = [&f](const char* key) { return f.value(key, std::string()); };
  s.stray_bytes += count("stray_bytes");
  if (s.first_stray.empty() && count("stray_bytes") > 0) s.first_stray = engine + " " + text("first_stray");
  s.handshakes += count("handshakes");
  s.handshakes_rejected += count("rejected");
  if (!text("last_rejection").empty()) s.last_rejection = text("last_rejection");
  s.notifications_failed += count("notifications_failed");
  s.plans_verified += count("plans_verified");
  s.content_checked += count("content_checked");
  s.content_check_failures += count("content_check_failures");
  s.wire_frames += count("wire_frames");
  s.wire_bytes += count("wire_bytes");
  s.wire_small_frames += count("wire_small_frames");
  s.staged_chunks += count("staged_chunks");
  if (!text("last_notification_error").empty()) s.last_notification_error = text("last_notification_error");
}

void print_progress(uint32_t done, uint32_t total) {
  if (!::isatty(STDERR_FILENO)) return;
  const int width = 30, filled = static_cast<int>(width * done / total);
  std::fprintf(stderr, "\r[%.*s%*s] %u/%u requests", filled, "##############################", width - filled, "", done,
               total);
  if (done == total) std::fprintf(stderr, "\n");
  std::fflush(stderr);
}

bool clean(const Summary& s) {
  const Figures f = figures(s);
  const uint64_t total = s.requests.size();
  // With --inject corrupt, exactly the request whose byte was flipped fails
  // its check.
  const uint64_t flipped = s.args->inject == Inject::kCorrupt ? 1 : 0;
  if (s.leaked_blocks != 0 || s.stray_bytes != 0 || s.double_frees != 0 || f.verify_failures != flipped) return false;
  if (!s.rank_errors.empty() || total != s.args->requests) return false;
  auto released = [&](const char* why) {
    auto it = s.releases.find(why);
    return it == s.releases.end() ? uint64_t{0} : it->second;
  };
  if (s.listeners_elsewhere != 0) return false;
  if (!s.args->etcd.empty() && s.discovered != s.args->decode_instances * s.args->decode.ranks()) return false;
  for (const RequestRecord& b : s.baselines) {  // the unstreamed reruns must be clean too
    if (b.outcome != "finished" || b.verify_bad != 0) return false;
  }
  switch (s.args->inject) {
    case Inject::kNone:
    case Inject::kPause:
    case Inject::kCorrupt:
      return f.ok == total;
    case Inject::kAbort:
      return f.aborted == 1 && f.ok + 1 == total;
    case Inject::kLease:
      return f.lease_expired == 1 && released("lease_expired") >= 1 && f.ok + 1 == total;
    case Inject::kDropNotification:
      // The lost done is asked again (its answer says the blocks were still
      // held): every request is ok, and every release is a read.
      return f.ok == total && released("read") == total;
    default:
      return f.ok < total && !f.errors.empty();
  }
}

void print_report(const Summary& s) {
  const DemoArgs& a = *s.args;
  const Figures f = figures(s);
  const double g = gbps(f.bytes, f.transfer_us), raw = gbps(f.raw_bytes, f.raw_us);
  // The baseline copies in the direction the library copied (host memory).
  const char* raw_syscall = a.mode == "push" ? "process_vm_writev" : "process_vm_readv";
  const double per_req = f.timed ? static_cast<double>(f.descriptors) / static_cast<double>(f.timed) : 0.0;
  const double naive_per_req = f.timed ? static_cast<double>(f.naive) / static_cast<double>(f.timed) : 0.0;
  if (a.json) {
    json j = {{"preset", a.preset},
              {"prefill_tp", a.prefill.tp},
              {"decode_tp", a.decode.tp},
              {"prefill_pp", a.prefill.pp},
              {"decode_pp", a.decode.pp},
              {"prefill_dcp", a.prefill.dcp},
              {"decode_dcp", a.decode.dcp},
              {"decode_instances", a.decode_instances},
              {"transport", a.transport},
              {"mode", a.mode},
              {"policy", a.policy},
              {"inject", std::string(inject_name(a.inject))},
              {"requests", s.requests.size()},
              {"ok", f.ok},
              {"failed", f.failed},
              {"recomputed", f.recomputed},
              {"recompute_kept_tokens", f.recompute_kept},
              {"recompute_moving_tokens", f.recompute_moving},
              {"aborted", f.aborted},
              {"verify_failures", f.verify_failures},
              {"stray_bytes", s.stray_bytes},
              {"leaked_blocks", s.leaked_blocks},
              {"double_frees", s.double_frees},
              {"bytes", f.bytes},
              {"descriptors_per_request", per_req},
              {"baseline_descriptors_per_request", naive_per_req},
              {"gbps", g},
              {"raw_gbps", raw},
              {"raw_baseline", a.memory == "cuda" ? "" : raw_syscall},
              {"ratio", raw > 0 ? g / raw : 0.0},
              {"p50_ms", f.p50_ms},
              {"handoff_gbps", f.handoff_ms > 0 ? static_cast<double>(f.handoff_bytes) / f.handoff_ms / 1e6 : 0.0},
              {"handoff_p50_ms", f.handoff_p50_ms},
              {"p99_ms", f.p99_ms},
              {"completion_lag_p50_us", f.lag_p50_us},
              {"completion_lag_p99_us", f.lag_p99_us},
              {"start_load_p50_us", f.start_p50_us},
              {"start_load_max_us", f.start_max_us},
              {"handshakes", s.handshakes},
              {"handshakes_rejected", s.handshakes_rejected},
              {"last_rejection", s.last_rejection},
              {"notifications_failed", s.notifications_failed},
              {"plans_verified", s.plans_verified},
              {"content_checked_bytes", s.content_checked},
              {"content_check_failures", s.content_check_failures},
              {"wire_frames", s.wire_frames},
              {"wire_bytes", s.wire_bytes},
              {"wire_small_frames", s.wire_small_frames},
              {"staged_chunks", s.staged_chunks},
              {"pin_cores", a.pin_cores},
              {"last_notification_error", s.last_notification_error},
              {"releases", s.releases},
              {"errors", f.errors},
              {"rank_errors", s.rank_errors},
              {"seconds", s.seconds},
              {"listeners", s.listeners},
              {"listeners_elsewhere", s.listeners_elsewhere},
              {"clean", clean(s)}};
    if (a.stream != "off") {
      // The requests as streaming ran them (auto: the ones it streamed and
      // the ones it did not), against the same requests rerun unstreamed.
      const Ttft with = ttft(s.requests, false), without = ttft(s.baselines, false);
      j["stream"] = a.stream;
      j["layers_per_stage"] = a.layers_per_stage;
      j["compute_us_per_layer"] = a.compute_us_per_layer;
      j["prefill_layers"] = s.prefill_layers;
      j["prefill_layers_over_budget"] = s.prefill_layers_over_budget;
      j["streamed_requests"] =
          std::count_if(s.requests.begin(), s.requests.end(), [](const RequestRecord& r) { return r.streamed; });
      j["ttft_ms"] = with.ttft_ms;
      j["ttft_no_stream_ms"] = without.ttft_ms;
      j["ttft_ratio"] = without.ttft_ms > 0 ? with.ttft_ms / without.ttft_ms : 0.0;
      j["ttft_paired_ratio"] = paired_ttft_ratio(s);
      j["exposed_transfer_ms"] = with.exposed_ms;
      j["exposed_transfer_no_stream_ms"] = without.exposed_ms;
      j["last_stage_ms"] = with.last_stage_ms;
      j["exposed_per_last_stage"] = with.exposed_per_last_stage;
      j["baselines"] = s.baselines.size();
    }
    if (!a.etcd.empty()) {
      j["etcd"] = a.etcd;
      j["discovered"] = s.discovered;
      j["discovery_ms_max"] = s.discovery_ms_max;
    }
    if (a.flood > 0) {
      j["flood_connections"] = s.flood_connections;
      j["flood_listeners"] = s.flood_listeners;
      j["listener_cpu_max_pct"] = s.listener_cpu_max_pct;
      j["gbps_flooded"] = f.flooded_gbps;
      j["gbps_unflooded"] = f.quiet_gbps;
      j["flood_ratio"] = f.quiet_gbps > 0 ? f.flooded_gbps / f.quiet_gbps : 0.0;
    }
    std::printf("%s\n", j.dump(2).c_str());
    return;
  }
  auto blocks = [](const SideArgs& side) {
    std::string b = side.block_tokens ? std::to_string(side.block_tokens) + "-token blocks" : "preset blocks";
    if (side.kernel_block_tokens) b += ", " + std::to_string(side.kernel_block_tokens) + "-token kernel blocks";
    return b;
  };
  auto shape = [](const SideArgs& side) {
    return (side.pp > 1 ? "PP " + std::to_string(side.pp) + " x " : std::string()) + "TP " + std::to_string(side.tp) +
           (side.dcp > 1 ? " (DCP " + std::to_string(side.dcp) + ")" : std::string());
  };
  std::printf("kvbridge demo: %s, prefill %s (%s, %s) -> %u decode instance(s) of %s (%s, %s)\n", a.preset.c_str(),
              shape(a.prefill).c_str(), a.prefill.order.c_str(), blocks(a.prefill).c_str(), a.decode_instances,
              shape(a.decode).c_str(), a.decode.order.c_str(), blocks(a.decode).c_str());
  std::printf("transport %s%s, %s mode%s, failure policy %s, injected fault: %s; %zu requests in %.1f s\n\n",
              a.transport.c_str(), a.memory == "cuda" ? (", device memory " + device_text()).c_str() : "",
              a.mode.c_str(), a.pin_cores ? ", each rank on its own core" : "", a.policy.c_str(),
              std::string(inject_name(a.inject)).c_str(), s.requests.size(), s.seconds);
  auto released = [&](const char* why) {
    auto it = s.releases.find(why);
    return it == s.releases.end() ? 0ull : static_cast<unsigned long long>(it->second);
  };
  std::printf("  requests          %llu ok, %llu failed, %llu recomputed, %llu aborted\n",
              static_cast<unsigned long long>(f.ok), static_cast<unsigned long long>(f.failed),
              static_cast<unsigned long long>(f.recomputed), static_cast<unsigned long long>(f.aborted));
  if (f.recomputed > 0) {
    std::printf("  recomputed        from the first chunk not whole: %llu of %llu tokens to move were kept\n",
                static_cast<unsigned long long>(f.recompute_kept), static_cast<unsigned long long>(f.recompute_moving));
  }
  std::printf("  verify failures   %llu (every byte of every load checked), stray bytes %llu\n",
              static_cast<unsigned long long>(f.verify_failures), static_cast<unsigned long long>(s.stray_bytes));
  std::printf(
      "  blocks leaked     %llu (prefill releases: %llu read, %llu lease expired, %llu aborted; %llu double frees)\n",
      static_cast<unsigned long long>(s.leaked_blocks), released("read"), released("lease_expired"),
      released("aborted"), static_cast<unsigned long long>(s.double_frees));
  if (!s.baselines.empty()) {
    std::printf("  (the transfer figures below are the unstreamed reruns': a streamed load waits for the prefill)\n");
  }
  std::printf("  bytes moved       %.1f MB\n", static_cast<double>(f.bytes) / 1e6);
  std::printf("  descriptors       %.1f per request (one per (layer, component, block): %.1f, %.1fx more)\n", per_req,
              naive_per_req, per_req > 0 ? naive_per_req / per_req : 0.0);
  if (a.memory == "cuda") {
    std::printf(
        "  throughput        %.2f GB/s (device memory: kvbridge bench --memory cuda compares with cudaMemcpy)\n", g);
  } else {
    std::printf("  throughput        %.2f GB/s; raw %s, same descriptors: %.2f GB/s (ratio %.2f)\n", g, raw_syscall,
                raw, raw > 0 ? g / raw : 0.0);
  }
  std::printf("  transfer latency  p50 %.2f ms, p99 %.2f ms\n", f.p50_ms, f.p99_ms);
  if (a.inject == Inject::kKillPrefill || a.inject == Inject::kKillDecode || a.inject == Inject::kAbort ||
      a.inject == Inject::kStall) {
    std::printf(
        "                    (--inject %s slows every copy on the side that copies, so that the fault lands "
        "mid-transfer)\n",
        std::string(inject_name(a.inject)).c_str());
  }
  if (f.handoff_ms > 0) {
    std::printf(
        "  hand-off          p50 %.2f ms, %.2f GB/s: the last prefill rank done to every decode rank holding its\n"
        "                    KV (messages, planning and every rank's transfer; comparable across pull and push)\n",
        f.handoff_p50_ms, static_cast<double>(f.handoff_bytes) / f.handoff_ms / 1e6);
  }
  std::printf("  load completion   p50 %.0f us, p99 %.0f us after the last byte landed (no polling)\n", f.lag_p50_us,
              f.lag_p99_us);
  std::printf(
      "  start_load        p50 %.1f us, max %.1f us to return (the first load's handshake runs on the connect "
      "thread)\n",
      f.start_p50_us, f.start_max_us);
  std::printf("  listeners         %zu, %llu not on the host asked for\n", s.listeners.size(),
              static_cast<unsigned long long>(s.listeners_elsewhere));
  if (!a.etcd.empty()) {
    std::printf(
        "  discovery         etcd at %s: %u of %u decode ranks found the prefill instance there, the slowest "
        "in %.1f ms\n",
        a.etcd.c_str(), s.discovered, a.decode_instances * a.decode.ranks(), s.discovery_ms_max);
  }
  if (a.flood > 0) {
    const double flooded = f.flooded_gbps, quiet = f.quiet_gbps;
    std::printf("  flood             %llu idle connections to %u prefill listeners during the first %u requests;\n",
                static_cast<unsigned long long>(s.flood_connections), s.flood_listeners, a.requests / 2);
    std::printf("                    busiest listener thread %.1f%% of a core (%s)\n", s.listener_cpu_max_pct,
                s.listener_cpu_max_thread.c_str());
    std::printf(
        "                    median throughput %.2f GB/s under the flood, %.2f GB/s after it (ratio %.2f; the first "
        "load, a warm-up, left out)\n",
        flooded, quiet, quiet > 0 ? flooded / quiet : 0.0);
  }
  if (a.stream != "off") {
    const Ttft with = ttft(s.requests, false), without = ttft(s.baselines, false);
    const long streamed =
        std::count_if(s.requests.begin(), s.requests.end(), [](const RequestRecord& r) { return r.streamed; });
    std::printf("  streaming         %s: %ld of %zu requests streamed, %u layer(s) per stage, %llu us of prefill\n",
                a.stream.c_str(), streamed, s.requests.size(), a.layers_per_stage,
                static_cast<unsigned long long>(a.compute_us_per_layer));
    std::printf(
        "                    compute per layer, its KV write included (the write alone took longer in\n"
        "                    %llu of %llu layers); %s\n",
        static_cast<unsigned long long>(s.prefill_layers_over_budget),
        static_cast<unsigned long long>(s.prefill_layers),
        s.baselines.empty() ? "no baseline (a fault was injected)" : "each request rerun unstreamed as the baseline");
    std::printf("  TTFT              p50 %.1f ms; the same requests unstreamed: %.1f ms (ratio %.2f)\n", with.ttft_ms,
                without.ttft_ms, without.ttft_ms > 0 ? with.ttft_ms / without.ttft_ms : 0.0);
    if (const double paired = paired_ttft_ratio(s); paired > 0) {
      std::printf("                    each request against its own unstreamed rerun: p50 ratio %.2f\n", paired);
    }
    std::printf("  exposed transfer  p50 %.1f ms after the prefill's last layer; unstreamed: %.1f ms\n",
                with.exposed_ms, without.exposed_ms);
    if (with.last_stage_ms > 0) {
      std::printf("                    the last stage's reads alone: p50 %.1f ms (exposed / last stage p50 %.2f)\n",
                  with.last_stage_ms, with.exposed_per_last_stage);
    }
  }
  if (a.inject == Inject::kPause) {
    std::printf("  paused            prefill rank 0 stopped for 100 ms of every 300 ms throughout\n");
  }
  std::printf("  handshakes        %llu (once per remote rank per decode rank%s), %llu rejected\n",
              static_cast<unsigned long long>(s.handshakes),
              a.stream != "off" ? ", and per streaming prefill rank" : "",
              static_cast<unsigned long long>(s.handshakes_rejected));
  if (a.verify_content) {
    std::printf("  content check     %.1f MB hashed at their source and where they landed, %llu runs differed\n",
                static_cast<double>(s.content_checked) / 1e6,
                static_cast<unsigned long long>(s.content_check_failures));
  }
  if (a.verify_plans) {
    std::printf("  plans verified    %llu (verify() before each load)\n",
                static_cast<unsigned long long>(s.plans_verified));
  }
  if (!s.last_rejection.empty()) std::printf("  last rejection    %s\n", s.last_rejection.c_str());
  if (s.notifications_failed) {
    std::printf("  notifications     %llu failed: %s\n", static_cast<unsigned long long>(s.notifications_failed),
                s.last_notification_error.c_str());
  }
  if (!s.first_stray.empty()) std::printf("  first stray byte  %s\n", s.first_stray.c_str());
  for (const std::string& e : f.errors) std::printf("  error: %s\n", e.c_str());
  for (const std::string& e : s.rank_errors) std::printf("  rank error: %s\n", e.c_str());
  for (const RequestRecord& r : s.requests) {
    if (r.verify_bad) std::printf("  verify: request %s: %s\n", r.id.c_str(), r.verify_error.c_str());
  }
  std::printf("\n%s\n", clean(s) ? "clean: every request ended as expected, nothing leaked, nothing stray"
                                 : "NOT CLEAN: see above");
}

}  // namespace kvbridge::cli::demo
