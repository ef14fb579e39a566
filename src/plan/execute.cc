// The host executor: see kvbridge/execute.h.
//
// Checking every descriptor before copying any costs one pass over 32-byte
// records, against copying their bytes: a plan's descriptors are few and
// large (the planner merges what is contiguous), so the pass is noise, and a
// wrong plan then never leaves half its bytes behind.
#include "kvbridge/execute.h"

#include <cstring>
#include <string>

namespace kvbridge {
namespace {

std::string range_error(size_t i, const char* side, uint64_t offset, uint64_t bytes, size_t tensor,
                        uint64_t span_bytes) {
  return "descriptor " + std::to_string(i) + ": " + side + " range [" + std::to_string(offset) + ", +" +
         std::to_string(bytes) + ") is outside " + side + " tensor " + std::to_string(tensor) + " (" +
         std::to_string(span_bytes) + " bytes given)";
}

// `span` holds [offset, offset + bytes), without overflow.
bool inside(uint64_t offset, uint64_t bytes, size_t span_bytes) {
  return offset <= span_bytes && bytes <= span_bytes - offset;
}

template <typename Local, typename Remote>
Status describe_error(std::span<const Descriptor> descriptors, size_t i, std::span<const Local> local,
                      std::span<const std::span<const Remote>> remotes);

// The common case, every descriptor fine, in one pass without branches
// beyond the loop's; a bad one is described by describe_error().
template <typename Local, typename Remote>
Status check(std::span<const Descriptor> descriptors, std::span<const Local> local,
             std::span<const std::span<const Remote>> remotes) {
  for (size_t i = 0; i < descriptors.size(); ++i) {
    const Descriptor& d = descriptors[i];
    bool ok = d.source < remotes.size() && d.local_tensor < local.size();
    if (ok) {
      const std::span<const Remote> remote = remotes[d.source];
      ok = d.remote_tensor < remote.size() && inside(d.local_offset, d.bytes, local[d.local_tensor].size()) &&
           inside(d.remote_offset, d.bytes, remote[d.remote_tensor].size());
    }
    if (!ok) return describe_error(descriptors, i, local, remotes);
  }
  return Status();
}

template <typename Local, typename Remote>
Status describe_error(std::span<const Descriptor> descriptors, size_t i, std::span<const Local> local,
                      std::span<const std::span<const Remote>> remotes) {
  {
    const Descriptor& d = descriptors[i];
    if (d.source >= remotes.size()) {
      return Status::invalid_argument("descriptor " + std::to_string(i) + " names source " + std::to_string(d.source) +
                                      " but memory of " + std::to_string(remotes.size()) + " sources is given");
    }
    const std::span<const Remote> remote = remotes[d.source];
    if (d.local_tensor >= local.size() || d.remote_tensor >= remote.size()) {
      const bool at_local = d.local_tensor >= local.size();
      return Status::invalid_argument("descriptor " + std::to_string(i) + " names " + (at_local ? "local" : "remote") +
                                      " tensor " + std::to_string(at_local ? d.local_tensor : d.remote_tensor) +
                                      " but memory of " + std::to_string(at_local ? local.size() : remote.size()) +
                                      " tensors is given" +
                                      (at_local ? "" : " for source " + std::to_string(d.source)));
    }
    if (!inside(d.local_offset, d.bytes, local[d.local_tensor].size())) {
      return Status::out_of_range(
          range_error(i, "local", d.local_offset, d.bytes, d.local_tensor, local[d.local_tensor].size()));
    }
    if (!inside(d.remote_offset, d.bytes, remote[d.remote_tensor].size())) {
      return Status::out_of_range(
          range_error(i, "remote", d.remote_offset, d.bytes, d.remote_tensor, remote[d.remote_tensor].size()) +
          " of source " + std::to_string(d.source));
    }
  }
  return Status::internal("descriptor " + std::to_string(i) + " failed a check that it passes");
}

}  // namespace

Result<uint64_t> execute_read(std::span<const Descriptor> descriptors, TensorMemory local,
                              std::span<const ConstTensorMemory> remotes) {
  KVB_RETURN_IF_ERROR(check(descriptors, local, remotes));
  uint64_t copied = 0;
  for (const Descriptor& d : descriptors) {
    std::memmove(local[d.local_tensor].data() + d.local_offset,
                 remotes[d.source][d.remote_tensor].data() + d.remote_offset, d.bytes);
    copied += d.bytes;
  }
  return copied;
}

Result<uint64_t> execute_write(std::span<const Descriptor> descriptors, ConstTensorMemory local,
                               std::span<const TensorMemory> remotes) {
  KVB_RETURN_IF_ERROR(check(descriptors, local, remotes));
  uint64_t copied = 0;
  for (const Descriptor& d : descriptors) {
    std::memmove(remotes[d.source][d.remote_tensor].data() + d.remote_offset,
                 local[d.local_tensor].data() + d.local_offset, d.bytes);
    copied += d.bytes;
  }
  return copied;
}

Result<uint64_t> resolve_read(std::span<const Descriptor> descriptors, TensorMemory local,
                              std::span<const ConstTensorMemory> remotes, std::vector<ByteCopy>* out) {
  KVB_RETURN_IF_ERROR(check(descriptors, local, remotes));
  uint64_t copied = 0;
  for (const Descriptor& d : descriptors) {
    out->push_back(ByteCopy{local[d.local_tensor].data() + d.local_offset,
                            remotes[d.source][d.remote_tensor].data() + d.remote_offset, d.bytes});
    copied += d.bytes;
  }
  return copied;
}

Result<uint64_t> resolve_write(std::span<const Descriptor> descriptors, ConstTensorMemory local,
                               std::span<const TensorMemory> remotes, std::vector<ByteCopy>* out) {
  KVB_RETURN_IF_ERROR(check(descriptors, local, remotes));
  uint64_t copied = 0;
  for (const Descriptor& d : descriptors) {
    out->push_back(ByteCopy{remotes[d.source][d.remote_tensor].data() + d.remote_offset,
                            local[d.local_tensor].data() + d.local_offset, d.bytes});
    copied += d.bytes;
  }
  return copied;
}

}  // namespace kvbridge
