// An engine with armed faults (see engine_faults.h).
#include "testing/engine_faults.h"

#include <atomic>
#include <charconv>

#include "engine/engine_impl.h"
#include "transport/fault/fault.h"

namespace kvbridge::testing {
namespace {

Result<std::shared_ptr<transport::Faults>> parse_faults(std::string_view spec, uint64_t* refuse_tables) {
  auto faults = std::make_shared<transport::Faults>();
  uint64_t drop_rate = 0, duplicate_rate = 0, seed = 1;
  while (!spec.empty()) {
    const size_t comma = spec.find(',');
    const std::string_view item = spec.substr(0, comma);
    spec = comma == std::string_view::npos ? std::string_view() : spec.substr(comma + 1);
    const size_t eq = item.find('=');
    const std::string_view key = item.substr(0, eq);
    const std::string_view value = eq == std::string_view::npos ? std::string_view() : item.substr(eq + 1);
    uint64_t n = 0;
    const auto [end, ec] = std::from_chars(value.data(), value.data() + value.size(), n);
    if (value.empty() || ec != std::errc() || end != value.data() + value.size() || n > 999999999) {
      return Status::invalid_argument("engine faults: '" + std::string(item) + "' needs a number (e.g. delay=5)");
    }
    if (key == "delay") {
      faults->set_delay(std::chrono::milliseconds(n), UINT64_MAX);  // per copy, as documented
    } else if (key == "drop-notifications") {
      faults->drop_notifications(n);
    } else if (key == "drop-done") {
      faults->drop_notifications(n, "kvb/1 done ");  // the connector's done messages only
    } else if (key == "drop-rate" || key == "duplicate-rate") {
      if (n > 1000) {
        return Status::invalid_argument("engine faults: '" + std::string(item) + "' is per mille: 0 to 1000");
      }
      (key == "drop-rate" ? drop_rate : duplicate_rate) = n;
    } else if (key == "seed") {
      seed = n;
    } else if (key == "skip-copies") {
      faults->set_skip_copies(n != 0);
    } else if (key == "refuse-tables") {
      *refuse_tables = n;
    } else {
      return Status::invalid_argument("engine faults: unknown fault '" + std::string(key) +
                                      "' (known: delay, drop-notifications, drop-done, drop-rate, duplicate-rate, "
                                      "seed, skip-copies, refuse-tables)");
    }
  }
  if (drop_rate > 0 || duplicate_rate > 0) {
    faults->set_notification_chaos(static_cast<uint32_t>(drop_rate), static_cast<uint32_t>(duplicate_rate), seed);
  }
  return faults;
}

}  // namespace

Result<std::unique_ptr<Engine>> create_engine_with_faults(const EngineOptions& options, std::string_view spec) {
  if (spec.empty()) return Engine::create(options);
  uint64_t refuse_tables = 0;
  KVB_ASSIGN_OR_RETURN(std::shared_ptr<transport::Faults> faults, parse_faults(spec, &refuse_tables));
  std::vector<TransportReport> reports;
  KVB_ASSIGN_OR_RETURN(auto transports, engine_internal::make_transports(options, &reports));
  for (auto& t : transports) t = transport::make_fault_transport(std::move(t), faults);
  engine_internal::EngineHooks hooks;
  hooks.drop_notification = [faults](std::string_view m) { return faults->take_notification_drop(m); };
  hooks.duplicate_notification = [faults](std::string_view m) { return faults->take_notification_duplicate(m); };
  if (refuse_tables > 0) {
    auto left = std::make_shared<std::atomic<uint64_t>>(refuse_tables);
    hooks.refuse_table = [left] {
      uint64_t n = left->load();
      while (n > 0 && !left->compare_exchange_weak(n, n - 1)) {
      }
      return n > 0;
    };
  }
  return engine_internal::create_engine(options, std::move(transports), std::move(reports), std::move(hooks));
}

}  // namespace kvbridge::testing
