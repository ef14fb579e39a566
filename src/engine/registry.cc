// Registrations: deduplication, merging into segments, reference and in-use
// counts.
#include "engine/registry.h"

#include <algorithm>

#include "common/checked.h"
#include "device/device.h"

namespace kvbridge::engine_internal {
namespace {

std::string region_name(RegionId id) { return "region " + std::to_string(id); }

bool overlaps(const uint8_t* a, uint64_t a_bytes, const uint8_t* b, uint64_t b_bytes) {
  return a < b + b_bytes && b < a + a_bytes;
}

}  // namespace

}  // namespace kvbridge::engine_internal

namespace kvbridge {

std::string_view remote_access_name(RemoteAccess access) {
  switch (access) {
    case RemoteAccess::kNone:
      return "none";
    case RemoteAccess::kRead:
      return "read";
    case RemoteAccess::kWrite:
      return "write";
    case RemoteAccess::kReadWrite:
      return "read_write";
    case RemoteAccess::kGrantedWrite:
      return "granted_write";
    case RemoteAccess::kReadGrantedWrite:
      return "read_granted_write";
    case RemoteAccess::kGrantedRead:
      return "granted_read";
  }
  return "unknown";
}

Result<RemoteAccess> parse_remote_access(std::string_view name) {
  for (RemoteAccess a : {RemoteAccess::kNone, RemoteAccess::kRead, RemoteAccess::kWrite, RemoteAccess::kReadWrite,
                         RemoteAccess::kGrantedWrite, RemoteAccess::kReadGrantedWrite, RemoteAccess::kGrantedRead}) {
    if (remote_access_name(a) == name) return a;
  }
  return Status::invalid_argument(
      "unknown remote access '" + std::string(name) +
      "' (expected none, read, write, read_write, granted_write, read_granted_write or granted_read)");
}

}  // namespace kvbridge

namespace kvbridge::engine_internal {

Status check_memory_kind(std::string_view memory) {
  if (memory == "host") return Status();
  if (memory.substr(0, 5) == "cuda:") return device::parse_cuda_memory(memory).status();
  return Status::invalid_argument("unknown memory kind '" + std::string(memory) + "' (expected 'host' or 'cuda:N')");
}

Result<uint32_t> Registry::add_segment(uint8_t* begin, uint8_t* end, const std::string& memory, uint8_t access) {
  SegmentEntry e;
  e.segment.id = next_segment_;
  e.segment.base = begin;
  e.segment.bytes = static_cast<uint64_t>(end - begin);
  e.segment.memory = memory;
  e.segment.access = access;
  for (size_t t = 0; t < transports_.size(); ++t) {
    // A transport is told only of the memory kinds it serves; it has no key
    // for the others, and peers never reach them through it.
    if (!transports_[t]->serves(memory)) {
      e.keys.emplace_back();
      continue;
    }
    Result<std::string> key = transports_[t]->add_segment(e.segment);
    if (key.ok() && key->size() > kMaxBlobBytes) {
      key = Status::internal("key blob of " + std::to_string(key->size()) + " bytes exceeds " +
                             std::to_string(kMaxBlobBytes));
    }
    if (!key.ok()) {
      for (size_t u = 0; u < t; ++u) {
        if (transports_[u]->serves(memory)) (void)transports_[u]->remove_segment(e.segment.id);
      }
      return key.error().with_context("transport '" + std::string(transports_[t]->name()) + "' add_segment");
    }
    e.keys.push_back(std::move(*key));
  }
  ++next_segment_;
  const uint32_t id = e.segment.id;
  segments_.emplace(id, std::move(e));
  return id;
}

Registry::~Registry() {
  for (auto& [id, s] : segments_) {
    if (s.pinned) (void)device::current().unregister_host(s.segment.base);
  }
}

void Registry::pin(uint32_t id) {
  SegmentEntry& s = segments_.at(id);
  if (!pin_host_ || s.segment.memory != "host" || s.pinned) return;
  s.pinned = device::current().register_host(s.segment.base, s.segment.bytes).ok();
}

void Registry::drop_segment(uint32_t id) {
  // A transport that fails to forget a segment leaves it registered with
  // itself only; the engine no longer advertises it, so no peer can name it.
  auto it = segments_.find(id);
  if (it != segments_.end() && it->second.pinned) (void)device::current().unregister_host(it->second.segment.base);
  for (transport::Transport* t : transports_) {
    if (it == segments_.end() || t->serves(it->second.segment.memory)) (void)t->remove_segment(id);
  }
  segments_.erase(id);
}

Result<RegionId> Registry::add(void* base_ptr, uint64_t bytes, std::string_view memory, uint8_t access) {
  uint8_t* base = static_cast<uint8_t*>(base_ptr);
  if (base == nullptr) return Status::invalid_argument("register_memory: base is null");
  if (bytes == 0) return Status::invalid_argument("register_memory: bytes is 0");
  uint64_t end_address = 0;
  if (!checked_add(reinterpret_cast<uint64_t>(base), bytes, &end_address)) {
    return Status::invalid_argument("register_memory: [base, base + bytes) wraps around the address space");
  }
  KVB_RETURN_IF_ERROR(check_memory_kind(memory).with_context("register_memory"));
  if (memory != "host") {
    KVB_RETURN_IF_ERROR(
        device::check_device_range(device::current(), base, bytes, memory).with_context("register_memory"));
    device_seen_ = true;
  } else if (device_seen_) {
    // Device memory registered as host memory would be read by cma or tcp
    // as if it were: once this process uses a device (asking before would
    // start a CUDA context in processes that never use one), host ranges
    // are checked at both ends.
    for (const uint8_t* p : {base, base + bytes - 1}) {
      Result<device::PointerInfo> info = device::current().pointer_info(p);
      if (info.ok() && info->type != device::MemoryType::kHost) {
        return Status::invalid_argument(
            "register_memory: the range is device memory of cuda:" + std::to_string(info->device) +
            "; register it as cuda:" + std::to_string(info->device));
      }
    }
  }
  if ((access > 7 && access != 9) || access == 4 || access == 5) {
    return Status::invalid_argument("register_memory: access " + std::to_string(access) +
                                    " is not a RemoteAccess (0, 1, 2, 3, 6, 7 or 9)");
  }
  for (auto& [id, r] : regions_) {
    if (r.base == base && r.bytes == bytes && r.memory == memory && r.access == access) {
      ++r.refs;
      return id;
    }
  }
  // The new segment is the union of the new range and every segment it
  // overlaps; those segments' regions move into it.
  uint8_t* begin = base;
  uint8_t* end = base + bytes;
  std::vector<uint32_t> merged;
  for (const auto& [id, s] : segments_) {
    if (!overlaps(s.segment.base, s.segment.bytes, base, bytes)) continue;
    if (s.segment.memory != memory) {
      return Status::invalid_argument("register_memory: range overlaps registered memory of kind '" + s.segment.memory +
                                      "' but is '" + std::string(memory) + "'");
    }
    if (s.segment.access != access) {
      return Status::invalid_argument("register_memory: range overlaps registered memory that grants peers access '" +
                                      std::string(remote_access_name(static_cast<RemoteAccess>(s.segment.access))) +
                                      "' but asks for '" +
                                      std::string(remote_access_name(static_cast<RemoteAccess>(access))) + "'");
    }
    begin = std::min(begin, s.segment.base);
    end = std::max(end, s.segment.base + s.segment.bytes);
    merged.push_back(id);
  }
  KVB_ASSIGN_OR_RETURN(uint32_t segment, add_segment(begin, end, std::string(memory), access));
  for (auto& [id, r] : regions_) {
    if (std::find(merged.begin(), merged.end(), r.segment) != merged.end()) r.segment = segment;
  }
  for (uint32_t id : merged) drop_segment(id);
  pin(segment);
  const RegionId id = next_region_++;
  Region region;
  region.id = id;
  region.base = base;
  region.bytes = bytes;
  region.memory = std::string(memory);
  region.access = access;
  region.segment = segment;
  region.refs = 1;
  regions_.emplace(id, std::move(region));
  return id;
}

Status Registry::remove(RegionId id) {
  auto it = regions_.find(id);
  if (it == regions_.end()) return Status::not_found("deregister_memory: " + region_name(id) + " is not registered");
  Region& r = it->second;
  if (const uint32_t users = r.in_use->load(std::memory_order_acquire); users > 0) {
    return Status::unavailable("deregister_memory: " + region_name(id) + " is used by " + std::to_string(users) +
                               " transfer(s) in progress");
  }
  if (r.refs > 1) {
    --r.refs;
    return Status();
  }
  // Re-cover the remaining regions of the segment: the removed range may have
  // joined them, so they can split into several segments.
  const uint32_t old = r.segment;
  std::vector<Region*> rest;
  for (auto& [rid, other] : regions_) {
    if (rid != id && other.segment == old) rest.push_back(&other);
  }
  std::sort(rest.begin(), rest.end(), [](const Region* a, const Region* b) { return a->base < b->base; });
  std::vector<std::pair<uint8_t*, uint8_t*>> cover;
  for (const Region* x : rest) {
    if (!cover.empty() && x->base < cover.back().second) {
      cover.back().second = std::max(cover.back().second, x->base + x->bytes);
    } else {
      cover.emplace_back(x->base, x->base + x->bytes);
    }
  }
  const SegmentEntry& s = segments_.at(old);
  const bool unchanged =
      cover.size() == 1 && cover[0].first == s.segment.base && cover[0].second == s.segment.base + s.segment.bytes;
  if (!unchanged) {
    std::vector<uint32_t> added;
    for (const auto& [b, e] : cover) {
      Result<uint32_t> seg = add_segment(b, e, r.memory, r.access);
      if (!seg.ok()) {
        for (uint32_t a : added) drop_segment(a);
        return seg.error().with_context("deregister_memory");
      }
      added.push_back(*seg);
      for (Region* x : rest) {
        if (x->base >= b && x->base < e) x->segment = *seg;
      }
    }
    drop_segment(old);
    for (uint32_t a : added) pin(a);
  }
  regions_.erase(it);
  return Status();
}

Result<uint8_t*> Registry::resolve(RegionId id, uint64_t offset, uint64_t bytes, std::string_view what) const {
  auto it = regions_.find(id);
  if (it == regions_.end()) {
    return Status::not_found(std::string(what) + ": local " + region_name(id) + " is not registered");
  }
  const Region& r = it->second;
  uint64_t end = 0;
  if (!checked_add(offset, bytes, &end) || end > r.bytes) {
    return Status::out_of_range(std::string(what) + ": local range [" + std::to_string(offset) + ", " +
                                std::to_string(offset) + " + " + std::to_string(bytes) + ") is outside " +
                                region_name(id) + " of " + std::to_string(r.bytes) + " bytes");
  }
  return r.base + offset;
}

RegionHold Registry::acquire(RegionId id) {
  RegionHold hold = regions_.at(id).in_use;
  hold->fetch_add(1, std::memory_order_acq_rel);
  return hold;
}

void Registry::release(RegionId id) { release(regions_.at(id).in_use); }

const Region* Registry::find(RegionId id) const {
  auto it = regions_.find(id);
  return it == regions_.end() ? nullptr : &it->second;
}

void Registry::describe(EngineMetadata* m) const {
  for (const auto& [id, s] : segments_) {
    if (s.segment.access == 0) continue;
    // Peers see read and write; whether writes need a grant is this side's.
    m->segments.push_back(MetadataSegment{id, reinterpret_cast<uint64_t>(s.segment.base), s.segment.bytes,
                                          s.segment.memory, static_cast<uint8_t>(s.segment.access & 3), s.keys});
  }
  for (const auto& [id, r] : regions_) {
    if (r.access == 0) continue;
    m->regions.push_back(MetadataRegion{id, r.segment, reinterpret_cast<uint64_t>(r.base), r.bytes});
  }
}

}  // namespace kvbridge::engine_internal
