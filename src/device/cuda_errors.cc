// What a CUDA runtime error means to kvbridge (cuda_errors.h). The numbers
// are cudaError_t's (driver_types.h); cuda_device.cc checks them against
// the enum at compile time.
#include "device/cuda_errors.h"

namespace kvbridge::device {

bool cuda_sticky(int code) {
  switch (code) {
    case 700:  // cudaErrorIllegalAddress
    case 702:  // cudaErrorLaunchTimeout
    case 710:  // cudaErrorAssert
    case 714:  // cudaErrorHardwareStackError
    case 715:  // cudaErrorIllegalInstruction
    case 716:  // cudaErrorMisalignedAddress
    case 717:  // cudaErrorInvalidAddressSpace
    case 718:  // cudaErrorInvalidPc
    case 719:  // cudaErrorLaunchFailure
    case 721:  // cudaErrorTensorMemoryLeak
    case 810:  // cudaErrorMpsClientTerminated
      return true;
    default:
      return false;
  }
}

Status cuda_status(int code, std::string_view name, std::string_view text, const std::string& what, bool opening) {
  const std::string said = "CUDA: " + what + ": " + std::string(name) + ": " + std::string(text);
  if (cuda_sticky(code)) {
    return Status::unavailable(said +
                               " (a sticky error: this process's CUDA context is unusable, every later CUDA call "
                               "fails the same way; restart the process)");
  }
  switch (code) {
    case 100:  // cudaErrorNoDevice
    case 35:   // cudaErrorInsufficientDriver
    case 3:    // cudaErrorInitializationError
      return Status::unavailable(said);
    case 2:  // cudaErrorMemoryAllocation
      return Status::resource_exhausted(said);
    case 1:    // cudaErrorInvalidValue
    case 17:   // cudaErrorInvalidDevicePointer
    case 101:  // cudaErrorInvalidDevice
      return Status::invalid_argument(said);
    case 400:  // cudaErrorInvalidResourceHandle
      if (opening) return Status::not_found(said + " (its exporter freed it, or exited)");
      return Status::invalid_argument(said +
                                      " (a stream, event or mapping of another device, or one already destroyed)");
    case 205:  // cudaErrorMapBufferObjectFailed
      return Status::not_found(said);
    default:
      return Status::io_error(said);
  }
}

}  // namespace kvbridge::device
