// kvbridge/execute.h: the host executor: runs a plan's descriptors as memory
// copies between caller-given tensor memory.
//
// A descriptor (plan.h) names a local tensor and offset, a source (an index
// into the remote layouts the plan was made for), a remote tensor and offset,
// and a length. execute_read() copies each descriptor's remote bytes into its
// local bytes (a pull, a store get, filling a canonical object from a rank);
// execute_write() copies local bytes into remote bytes (a push). Memory is
// given per side as one span per tensor (TensorMemory, layout.h): `local`
// for the local layout's tensors, `remotes[s]` for source s's tensors. Spans
// need not be whole tensors: a caller may pass an empty span for a tensor no
// descriptor touches, and every descriptor is checked against the spans it
// is given, never against a layout.
//
// Every descriptor is checked before the first byte is copied: an error
// copies nothing. Descriptors run in order; a descriptor's source and
// destination bytes may overlap (each copy is a memmove).
//
// Pure: no I/O, no threads, no globals. Thread-safety: reentrant; callers
// keep other writers off the destination bytes for the duration of a call.
// Ownership: the caller owns all memory; nothing is kept after the call.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

#include "kvbridge/layout.h"
#include "kvbridge/plan.h"
#include "kvbridge/status.h"

namespace kvbridge {

// Copies remote bytes into local bytes for every descriptor. Returns the
// bytes copied (the descriptors' sum). Errors, naming the descriptor by its
// index in `descriptors`, and copying nothing:
//  - kInvalidArgument: a descriptor's source has no entry in `remotes`, or a
//    tensor index has no span on its side;
//  - kOutOfRange: a descriptor's range is not inside its span, e.g.
//    "descriptor 7: local range [4096, +8192) is outside local tensor 2
//    (8192 bytes given)".
Result<uint64_t> execute_read(std::span<const Descriptor> descriptors, TensorMemory local,
                              std::span<const ConstTensorMemory> remotes);

// Copies local bytes into remote bytes for every descriptor, with the same
// checks and errors as execute_read().
Result<uint64_t> execute_write(std::span<const Descriptor> descriptors, ConstTensorMemory local,
                               std::span<const TensorMemory> remotes);

// One descriptor resolved into caller memory: `bytes` from `src` to `dst`.
struct ByteCopy {
  uint8_t* dst = nullptr;
  const uint8_t* src = nullptr;
  uint64_t bytes = 0;
};

// The copies execute_read() and execute_write() would make, checked as they
// check them, appended to `out` in descriptor order; nothing is copied (for
// a caller that moves the bytes itself: device memory, through pinned host
// memory). Returns the bytes; on an error nothing is appended.
Result<uint64_t> resolve_read(std::span<const Descriptor> descriptors, TensorMemory local,
                              std::span<const ConstTensorMemory> remotes, std::vector<ByteCopy>* out);
Result<uint64_t> resolve_write(std::span<const Descriptor> descriptors, ConstTensorMemory local,
                               std::span<const TensorMemory> remotes, std::vector<ByteCopy>* out);

}  // namespace kvbridge
