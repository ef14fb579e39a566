// What a transfer's chunks hold: its copies cut into shares of about
// equal bytes (a list, or a program's runs, expanded when a share runs),
// and the content check of what a run moved.
#include <algorithm>

#include "engine/transfers.h"
#include "transport/copies.h"

namespace kvbridge::engine_internal {
namespace {

// Below these a batch is one chunk: splitting costs a queue hop per chunk and
// buys nothing for a batch one thread moves in microseconds.
constexpr uint64_t kSplitMinBytes = uint64_t{2} << 20;
constexpr size_t kSplitMinCopies = 2048;

}  // namespace

Status check_content(transport::Link& link, TransferOp op, std::span<const transport::Copy> copies, bool device,
                     transport::RunControl& control, bool* differ) {
  *differ = false;
  std::vector<uint64_t> remote, local;
  KVB_RETURN_IF_ERROR(link.digest(copies, control, &remote));
  if (remote.size() != copies.size()) {
    return Status::internal("content check: the link hashed " + std::to_string(remote.size()) + " copies of " +
                            std::to_string(copies.size()));
  }
  std::vector<device::DeviceRange> ranges;
  ranges.reserve(copies.size());
  for (const transport::Copy& c : copies) ranges.push_back({c.local, c.bytes});
  KVB_RETURN_IF_ERROR(
      transport::content_hashes_in_place(ranges, device, &local).with_context("content check: hashing here"));
  for (size_t i = 0; i < copies.size(); ++i) {
    const transport::Copy& c = copies[i];
    const uint64_t here = local[i];
    if (here == remote[i]) continue;
    const bool read = op == TransferOp::kRead;
    char text[200];
    std::snprintf(text, sizeof text,
                  "content check failed: the %llu bytes at address 0x%llx of the peer's segment %u %s "
                  "(source hash %016llx, landed %016llx)",
                  static_cast<unsigned long long>(c.bytes), static_cast<unsigned long long>(c.remote), c.segment,
                  read ? "differ from what landed here" : "differ from what was written there",
                  static_cast<unsigned long long>(read ? remote[i] : here),
                  static_cast<unsigned long long>(read ? here : remote[i]));
    *differ = true;
    return Status::io_error(text);
  }
  return Status();
}

void split_copies(std::vector<transport::Copy> copies, size_t parts, ChunkArray* chunks) {
  uint64_t total = 0;
  for (const transport::Copy& c : copies) total += c.bytes;
  if (parts <= 1 || (total < kSplitMinBytes && copies.size() < kSplitMinCopies)) {
    chunks->reset(1);
    (*chunks)[0].copies = std::move(copies);
    return;
  }
  std::vector<std::vector<transport::Copy>> shares = transport::split_by_bytes(copies, parts);
  chunks->reset(shares.size());
  for (size_t i = 0; i < shares.size(); ++i) (*chunks)[i].copies = std::move(shares[i]);
}

uint64_t copies_of(std::span<const CopyRun> runs) {
  uint64_t n = 0;
  for (const CopyRun& r : runs) n += r.count * (r.moves != nullptr ? r.move_count : 1);
  return n;
}

// Written through a pointer into room made beforehand: push_back's
// bookkeeping per copy was most of a table run's expansion.
uint64_t expand_runs(const CopyProgram& program, std::span<const CopyRun> runs, transport::Copy* out) {
  transport::Copy* to = out;
  for (const CopyRun& r : runs) {
    if (r.moves != nullptr) {
      for (uint64_t k = 0; k < r.move_count; ++k) {
        const CopyRun one = r.move(k);
        to += expand_runs(program, {&one, 1}, to);
      }
      continue;
    }
    const transport::Copy* from = program.copies().data() + r.first;
    if (!r.moved) {
      to = std::copy_n(from, r.count, to);
      continue;
    }
    for (uint64_t k = 0; k < r.count; ++k) {
      to[k] = {reinterpret_cast<uint8_t*>(reinterpret_cast<uintptr_t>(from[k].local) + r.local_delta),
               from[k].remote + r.remote_delta, from[k].bytes, r.segment};
    }
    to += r.count;
  }
  return static_cast<uint64_t>(to - out);
}

void expand_runs(const CopyProgram& program, std::span<const CopyRun> runs, std::vector<transport::Copy>* out) {
  const size_t at = out->size();
  out->resize(at + copies_of(runs));
  expand_runs(program, runs, out->data() + at);
}

std::vector<std::vector<CopyRun>> split_runs(const CopyProgram& program, size_t parts) {
  uint64_t total = 0, count = 0;
  for (const CopyRun& r : program.runs)
    total += program.bytes(r), count += r.count * std::max<uint64_t>(r.move_count, 1);
  std::vector<std::vector<CopyRun>> out(1);
  if (parts <= 1 || (total < kSplitMinBytes && count < kSplitMinCopies)) {
    out[0] = program.runs;
    return out;
  }
  const uint64_t share = total / parts + 1;
  uint64_t room = share;                               // bytes the share under way still takes
  const size_t per = program.runs.size() / parts + 2;  // a share's runs, about
  out.back().reserve(per);
  // Places a run that is not a table run, cutting it at copy boundaries.
  auto place = [&](CopyRun r) {
    while (r.count > 0) {
      const uint64_t bytes = program.bytes(r);
      if (bytes <= room || out.size() == parts) {
        out.back().push_back(r);
        room -= std::min(room, bytes);
        break;
      }
      // The copies of r that fit in the room (at least one when the share
      // is empty so far), the rest to the next share.
      const uint64_t limit = program.ends()[r.first] + room;
      uint64_t k = static_cast<uint64_t>(
                       std::upper_bound(program.ends().begin() + static_cast<ptrdiff_t>(r.first),
                                        program.ends().begin() + static_cast<ptrdiff_t>(r.first + r.count), limit) -
                       program.ends().begin()) -
                   1 - r.first;
      if (k == 0 && out.back().empty()) k = 1;
      if (k > 0) {
        CopyRun head = r;
        head.count = k;
        out.back().push_back(head);
        r.first += k;
        r.count -= k;
      }
      out.emplace_back().reserve(per);
      room = share;
    }
  };
  for (CopyRun r : program.runs) {
    // A table run: the whole moves that fit stay one table run; where less
    // than a move's bytes are left, the next move is placed as a moved run.
    while (r.moves != nullptr && r.move_count > 0) {
      const uint64_t one = program.ends()[r.first + r.count] - program.ends()[r.first];
      if (one * r.move_count <= room || out.size() == parts) {
        out.back().push_back(r);
        room -= std::min(room, one * r.move_count);
        r.move_count = 0;
        break;
      }
      if (const uint64_t q = one > 0 ? room / one : r.move_count; q > 0) {
        CopyRun head = r;
        head.move_count = q;
        out.back().push_back(head);
        room -= q * one;
        r.moves += q;
        r.move_count -= q;
        continue;
      }
      place(r.move(0));
      ++r.moves;
      --r.move_count;
    }
    if (r.moves == nullptr) place(r);
  }
  if (out.back().empty()) out.pop_back();
  return out;
}

}  // namespace kvbridge::engine_internal
