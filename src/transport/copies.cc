// Splitting copies by bytes and running shares (see copies.h).
#include "transport/copies.h"

#include <algorithm>
#include <cstdio>
#include <memory>
#include <new>
#include <system_error>
#include <thread>

#include <xxhash.h>

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

uint64_t content_hash(const void* data, uint64_t bytes) { return XXH3_64bits(data, bytes); }

ContentHasher::ContentHasher() : state_(XXH3_createState()) {
  if (state_ == nullptr) throw std::bad_alloc();
  reset();
}
ContentHasher::~ContentHasher() { XXH3_freeState(static_cast<XXH3_state_t*>(state_)); }
void ContentHasher::reset() { XXH3_64bits_reset(static_cast<XXH3_state_t*>(state_)); }
void ContentHasher::update(const void* data, uint64_t bytes) {
  XXH3_64bits_update(static_cast<XXH3_state_t*>(state_), data, bytes);
}
uint64_t ContentHasher::digest() const { return XXH3_64bits_digest(static_cast<const XXH3_state_t*>(state_)); }

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
