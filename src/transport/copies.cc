// Splitting copies by bytes and running shares (see copies.h).
#include "transport/copies.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <iterator>
#include <map>
#include <memory>
#include <new>
#include <system_error>
#include <thread>

#include <xxhash.h>

#include "common/thread_name.h"
#include "common/xxh3.h"

namespace kvbridge::transport {

std::string engine_label(std::string_view name, uint64_t instance) {
  char hex[17];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(instance));
  return std::string(name) + " " + hex;
}

RunThreads::~RunThreads() {
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
  }
  cv_.notify_all();
  for (std::thread& t : threads_) t.join();
}

Status RunThreads::post(std::function<void()> job) {
  {
    std::lock_guard lock(mu_);
    jobs_.push_back(std::move(job));
    if (idle_ == 0 && threads_.size() < max_) {
      try {
        threads_.emplace_back([this] { loop(); });
      } catch (const std::system_error& e) {
        // With a thread already there, it takes the job when it is free.
        if (threads_.empty()) {
          jobs_.pop_back();
          return Status::resource_exhausted(std::string("cannot start a thread for the run: ") + e.what());
        }
      }
    }
  }
  cv_.notify_one();
  return Status();
}

void RunThreads::loop() {
  set_thread_name(name_);
  std::unique_lock lock(mu_);
  while (true) {
    ++idle_;
    cv_.wait(lock, [&] { return stopping_ || !jobs_.empty(); });
    --idle_;
    if (jobs_.empty()) return;  // stopping, nothing left
    std::function<void()> job = std::move(jobs_.front());
    jobs_.pop_front();
    lock.unlock();
    job();
    lock.lock();
  }
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

static_assert(std::endian::native == std::endian::little, "the content hash's leaves are little-endian u64s");

uint64_t content_hash(const void* data, uint64_t bytes) {
  // XXH3_64bits equals xxh3::hash64 (common_test): libxxhash is the fast one.
  const uint64_t n = xxh3::content_leaves(bytes);
  uint64_t small[16] = {};
  std::vector<uint64_t> large;
  uint64_t* leaves = small;
  if (n > std::size(small)) {
    large.resize(n);
    leaves = large.data();
  }
  const auto* p = static_cast<const uint8_t*>(data);
  for (uint64_t i = 0; i < n; ++i) {
    const uint64_t at = i * xxh3::kContentLeafBytes;
    leaves[i] = XXH3_64bits(p + at, std::min(xxh3::kContentLeafBytes, bytes - at));
  }
  return XXH3_64bits(leaves, n * sizeof(uint64_t));
}

ContentHasher::ContentHasher() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  reset();
}
ContentHasher::~ContentHasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void ContentHasher::reset() {
  XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_));
  in_leaf_ = 0;
  leaves_.clear();
}
void ContentHasher::update(const void* data, uint64_t bytes) {
  auto* state = static_cast<XXH3_state_t*>(state_);
  const auto* p = static_cast<const uint8_t*>(data);
  while (bytes > 0) {
    const uint64_t take = std::min(bytes, xxh3::kContentLeafBytes - in_leaf_);
    XXH3_64bits_update(state, p, take);
    p += take;
    bytes -= take;
    in_leaf_ += take;
    if (in_leaf_ == xxh3::kContentLeafBytes) {
      leaves_.push_back(XXH3_64bits_digest(state));
      XXH3_64bits_reset(state);
      in_leaf_ = 0;
    }
  }
}
uint64_t ContentHasher::digest() const {
  std::vector<uint64_t> leaves = leaves_;
  if (in_leaf_ > 0) leaves.push_back(XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)));
  return XXH3_64bits(leaves.data(), leaves.size() * sizeof(uint64_t));
}

Status content_hashes_in_place(std::span<const device::DeviceRange> ranges, bool maybe_device,
                               std::vector<uint64_t>* hashes) {
  hashes->assign(ranges.size(), 0);
  if (!maybe_device) {
    for (size_t i = 0; i < ranges.size(); ++i) (*hashes)[i] = content_hash(ranges[i].p, ranges[i].bytes);
    return Status();
  }
  device::Device& dev = device::current();
  // Device ranges inside one allocation, by device: one kernel each.
  std::map<int, std::pair<std::vector<device::DeviceRange>, std::vector<size_t>>> on;
  for (size_t i = 0; i < ranges.size(); ++i) {
    const device::DeviceRange& r = ranges[i];
    KVB_ASSIGN_OR_RETURN(device::PointerInfo info, dev.pointer_info(r.p));
    const uint64_t at = reinterpret_cast<uint64_t>(r.p);
    if (info.type != device::MemoryType::kDevice) {
      (*hashes)[i] = content_hash(r.p, r.bytes);
    } else if (at + r.bytes <= info.base + info.bytes) {
      on[info.device].first.push_back(r);
      on[info.device].second.push_back(i);
    } else {
      // Across allocations: copied to the host piece by piece (each inside one).
      ContentHasher hasher;
      std::vector<uint8_t> scratch;
      for (uint64_t done = 0; done < r.bytes;) {
        const auto* p = static_cast<const uint8_t*>(r.p) + done;
        KVB_ASSIGN_OR_RETURN(device::PointerInfo piece, dev.pointer_info(p));
        const uint64_t here = reinterpret_cast<uint64_t>(p);
        const uint64_t end = piece.type == device::MemoryType::kDevice ? piece.base + piece.bytes : here + 1;
        const uint64_t n = std::min({r.bytes - done, end - here, uint64_t{4} << 20});
        scratch.resize(n);
        KVB_RETURN_IF_ERROR(dev.copy_sync(scratch.data(), p, n));
        hasher.update(scratch.data(), n);
        done += n;
      }
      (*hashes)[i] = hasher.digest();
    }
  }
  for (auto& [device, batch] : on) {
    std::vector<uint64_t> got;
    KVB_RETURN_IF_ERROR(dev.content_hashes(device, batch.first, &got));
    for (size_t k = 0; k < got.size(); ++k) (*hashes)[batch.second[k]] = got[k];
  }
  return Status();
}

Status read_digests(Link& link, std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes,
                    uint64_t piece_bytes) {
  hashes->assign(copies.size(), content_hash(nullptr, 0));
  uint64_t total = 0;
  for (const Copy& c : copies) total += c.bytes;
  if (total == 0) return Status();
  piece_bytes = std::max<uint64_t>(piece_bytes, 1);
  std::vector<uint8_t> scratch(std::min(piece_bytes, total));
  ContentHasher hasher;
  // Copies (or their pieces) are read in batches that fill the scratch
  // memory: one run per batch, not one per copy.
  struct Piece {
    size_t copy;
    uint64_t offset;  // within the copy
    uint64_t bytes;
    uint64_t at;  // within the scratch memory
  };
  std::vector<Copy> batch;
  std::vector<Piece> pieces;
  size_t next = 0;
  uint64_t next_offset = 0;
  while (next < copies.size()) {
    batch.clear();
    pieces.clear();
    uint64_t used = 0;
    while (next < copies.size() && used < scratch.size()) {
      const Copy& c = copies[next];
      const uint64_t take = std::min(c.bytes - next_offset, scratch.size() - used);
      if (take > 0) {
        batch.push_back(Copy{scratch.data() + used, c.remote + next_offset, take, c.segment});
        pieces.push_back(Piece{next, next_offset, take, used});
      }
      used += take;
      next_offset += take;
      if (next_offset == c.bytes) {
        ++next;
        next_offset = 0;
      }
    }
    if (control.cancel.load(std::memory_order_acquire)) return Status::cancelled("content check cancelled");
    RunControl reread;
    reread.deadline = control.deadline;
    KVB_RETURN_IF_ERROR(link.run(TransferOp::kRead, batch, reread).with_context("content check: reading back"));
    for (const Piece& p : pieces) {
      const uint8_t* data = scratch.data() + p.at;
      if (p.offset == 0 && p.bytes == copies[p.copy].bytes) {
        (*hashes)[p.copy] = content_hash(data, p.bytes);
        continue;
      }
      if (p.offset == 0) hasher.reset();
      hasher.update(data, p.bytes);
      if (p.offset + p.bytes == copies[p.copy].bytes) (*hashes)[p.copy] = hasher.digest();
    }
  }
  return Status();
}

Status Link::digest(std::span<const Copy> copies, RunControl& control, std::vector<uint64_t>* hashes) {
  return read_digests(*this, copies, control, hashes);
}

}  // namespace kvbridge::transport
