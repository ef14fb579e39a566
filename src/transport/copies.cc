// Splitting copies by bytes and running shares (see copies.h).
#include "transport/copies.h"

#include <algorithm>
#include <cstdio>
#include <system_error>
#include <thread>

namespace kvbridge::transport {

std::string engine_label(std::string_view name, uint64_t instance) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(instance));
  return std::string(name) + " " + hex;
}

std::vector<std::vector<Copy>> split_by_bytes(std::span<const Copy> copies, size_t parts, uint64_t max_piece) {
  uint64_t total = 0;
  for (const Copy& c : copies) total += c.bytes;
  parts = static_cast<size_t>(std::max<uint64_t>(1, std::min<uint64_t>(parts, std::max<uint64_t>(total, 1))));
  std::vector<std::vector<Copy>> shares(parts);
  const uint64_t per_share = (total + parts - 1) / parts;
  size_t share = 0;
  uint64_t in_share = 0;
  for (const Copy& c : copies) {
    for (uint64_t done = 0; done < c.bytes;) {
      if (in_share >= per_share && share + 1 < parts) {
        ++share;
        in_share = 0;
      }
      uint64_t n = share + 1 == parts ? c.bytes - done : std::min(c.bytes - done, per_share - in_share);
      if (max_piece > 0) n = std::min(n, max_piece);
      shares[share].push_back(Copy{c.local + done, c.remote + done, n, c.segment});
      done += n;
      in_share += n;
    }
  }
  while (shares.size() > 1 && shares.back().empty()) shares.pop_back();
  return shares;
}

Status run_shares(const std::vector<std::vector<Copy>>& shares, const ShareRun& run) {
  std::atomic<bool> abort{false};
  std::vector<Status> results(shares.size());
  std::vector<std::thread> helpers;
  std::vector<size_t> here = {0};  // shares this thread runs: 0, and any no helper could take
  for (size_t i = 1; i < shares.size(); ++i) {
    try {
      helpers.emplace_back([&, i] {
        results[i] = run(i, shares[i], abort);
        if (!results[i].ok()) abort.store(true);
      });
    } catch (const std::system_error&) {
      here.push_back(i);
    }
  }
  for (size_t i : here) {
    if (i >= shares.size()) break;
    results[i] = run(i, shares[i], abort);
    if (!results[i].ok()) abort.store(true);
  }
  for (std::thread& t : helpers) t.join();
  Status first;
  for (Status& s : results) {
    if (!s.ok() && (first.ok() || (first.code() == Code::kCancelled && s.code() != Code::kCancelled))) first = s;
  }
  return first;
}

}  // namespace kvbridge::transport
