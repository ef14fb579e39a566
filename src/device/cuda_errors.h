// device/cuda_errors.h: what a CUDA runtime error means to kvbridge, as a
// Status. Pure (the error's number, name and text come in; cuda_device.cc
// passes cudaGetErrorName/cudaGetErrorString), so the mapping is built and
// tested without CUDA.
//
//  - A sticky error (CUDA's documentation: "the process must be terminated
//    and relaunched": an illegal address, a kernel fault or trap, a launch
//    timeout, ...): kUnavailable saying that this process's CUDA context is
//    unusable and the process must restart; every later CUDA call fails the
//    same way.
//  - No device, no or too old a driver: kUnavailable.
//  - Out of device memory: kResourceExhausted.
//  - A bad value, pointer or device: kInvalidArgument.
//  - An invalid resource handle: kNotFound when opening another process's
//    memory or event (`opening`: the exporter freed it, or exited), else
//    kInvalidArgument (a stream, event or mapping of another device, or
//    one already destroyed).
//  - Anything else: kIoError.
//
// Thread-safety: pure functions.
#pragma once

#include <string>
#include <string_view>

#include "kvbridge/status.h"

namespace kvbridge::device {

// Whether CUDA documents error `code` as leaving the context unusable.
bool cuda_sticky(int code);

// The Status of CUDA error `code` (named `name`, described `text`) from the
// call `what`.
Status cuda_status(int code, std::string_view name, std::string_view text, const std::string& what,
                   bool opening = false);

}  // namespace kvbridge::device
