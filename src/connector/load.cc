#include "connector/load.h"

#include "common/text.h"

#include <algorithm>

namespace kvbridge::connector {

void settle(Load& load, std::span<const TransferStatus> statuses, const std::vector<std::string>& layers,
            std::chrono::milliseconds timeout, Clock::time_point now) {
  if (load.last_byte == Clock::time_point{}) load.last_byte = load.started;
  load.result.transfer_time = std::chrono::duration_cast<std::chrono::microseconds>(load.last_byte - load.started);
  load.result.completion_lag = std::chrono::duration_cast<std::chrono::microseconds>(now - load.last_byte);
  load.result.aborted = load.aborted;
  const LoadStage* last = nullptr;
  for (const LoadStage& st : load.stages) {
    if (!st.landed || st.submitted_at == Clock::time_point{}) continue;
    if (last == nullptr || st.landed_at > last->landed_at) last = &st;
  }
  if (last != nullptr) {
    load.result.last_stage_time =
        std::chrono::duration_cast<std::chrono::microseconds>(last->landed_at - last->submitted_at);
  }
  uint64_t first_bad = load.stages.empty() ? load.result.first_bad_token : load.stages.back().end_token;
  const size_t n = load.stages.size();
  for (uint32_t k = 0; k < n; ++k) {
    const LoadStage& st = load.stages[k];
    if (st.landed) continue;
    first_bad = std::min(first_bad, st.resume_token);
    if (!load.result.error.ok()) continue;
    if (load.result.first_bad_layer.empty() && st.first_layer < layers.size()) {
      load.result.first_bad_layer = layers[st.first_layer];
    }
    std::string what = "request " + q(load.request) + ": ";
    std::string where;
    if (load.stream) {
      where = layers[st.first_layer] +
              (st.end_layer - st.first_layer > 1 ? ".." + layers[st.end_layer - 1] : std::string());
    }
    if (n > 1) {
      where += std::string(where.empty() ? "" : ", ") + "tokens " + std::to_string(st.first_token) + ".." +
               std::to_string(st.end_token) + ", " + (load.stream ? "stage " : "chunk ") + std::to_string(k + 1) +
               " of " + std::to_string(n);
    }
    if (!st.submitted) {
      if (!load.start_error.ok() || load.aborted) continue;  // said below
      load.result.error = Status::timeout(what + (where.empty() ? "" : "(" + where + ") ") +
                                          (load.push ? "not written by every prefill rank it reads from within "
                                                     : "not announced by every prefill rank it reads from within ") +
                                          std::to_string(timeout.count()) + " ms");
      continue;
    }
    for (size_t i = 0; i < load.transfers.size(); ++i) {
      const LoadTransfer& t = load.transfers[i];
      const TransferStatus& ts = statuses[i];
      if (t.stage != k || ts.state == TransferState::kDone) continue;
      Status e = ts.error.ok() ? Status::internal("transfer ended as " + std::string(transfer_state_name(ts.state)))
                               : ts.error;
      load.result.error = e.with_context(what + "reading from " + load.instance + " rank " + std::to_string(t.source) +
                                         " (" + (where.empty() ? "" : where + ": ") + std::to_string(ts.bytes_done) +
                                         " of " + std::to_string(ts.bytes_total) + " bytes)");
      break;
    }
  }
  if (load.result.error.ok() && !load.start_error.ok()) load.result.error = load.start_error;
  if (load.aborted && load.result.error.ok()) {
    load.result.error = Status::cancelled("request " + q(load.request) + " was aborted");
  }
  // Every byte landed, but a source could not vouch that they were the
  // request's when they were read: none of them counts.
  const bool unconfirmed = load.result.error.ok() && !load.confirm_error.ok();
  if (unconfirmed) {
    load.result.error = load.confirm_error;
    if (!load.stages.empty() && load.stages.front().first_layer < layers.size()) {
      load.result.first_bad_layer = layers[load.stages.front().first_layer];
    }
  }
  if ((load.aborted || unconfirmed) && !load.stages.empty()) first_bad = load.stages.front().resume_token;
  load.result.first_bad_token = load.result.error.ok() ? 0 : first_bad;
  if (load.result.error.ok()) load.result.first_bad_layer.clear();
}

}  // namespace kvbridge::connector
