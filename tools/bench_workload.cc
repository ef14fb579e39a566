// Workload construction and the repeat-until-min-time timer of `kvbridge bench`.
#include <algorithm>
#include <numeric>
#include <random>

#include "bench.h"

namespace kvbridge::cli::bench {

Workload::Workload(uint64_t buffer_bytes, uint64_t block_bytes, bool shuffled, uint64_t batch, RegionId local,
                   RegionId remote)
    : block_bytes_(block_bytes),
      num_blocks_(std::max<uint64_t>(buffer_bytes / block_bytes, 1)),
      batch_(std::clamp<uint64_t>(batch, 1, num_blocks_)) {
  std::vector<uint64_t> perm(num_blocks_);
  std::iota(perm.begin(), perm.end(), 0);
  if (shuffled) {
    // A fixed seed: every run, and the baseline, see the same permutation.
    std::mt19937_64 rng(0x6b76627269646765);
    std::shuffle(perm.begin(), perm.end(), rng);
  }
  items_.reserve(num_blocks_ + batch_);
  for (uint64_t j = 0; j < num_blocks_ + batch_; ++j) {
    const uint64_t i = j % num_blocks_;
    items_.push_back(TransferItem{local, i * block_bytes, remote, perm[i] * block_bytes, block_bytes});
  }
}

Timing time_median(const std::function<bool(uint64_t)>& once, double min_seconds, uint32_t reps) {
  using Clock = std::chrono::steady_clock;
  std::vector<double> per_call;
  uint64_t k = 0;
  if (!once(k++)) return Timing{0, false};  // warm-up: first touch, connection setup
  for (uint32_t r = 0; r < std::max<uint32_t>(reps, 1); ++r) {
    const auto start = Clock::now();
    uint64_t calls = 0;
    double elapsed = 0;
    do {
      if (!once(k++)) return Timing{0, false};
      ++calls;
      elapsed = std::chrono::duration<double>(Clock::now() - start).count();
    } while (elapsed < min_seconds);
    per_call.push_back(elapsed / static_cast<double>(calls));
  }
  std::sort(per_call.begin(), per_call.end());
  return Timing{per_call[per_call.size() / 2], true};
}

}  // namespace kvbridge::cli::bench
