// device.h's choice of implementation, and what both share.
#include <cstdlib>
#include <string>

#include "device/device.h"

namespace kvbridge::device {

#if KVB_HAVE_CUDA
Device& real();  // cuda_device.cc
#else
namespace {

// A build without CUDA: every question about device memory has one answer.
class NoCuda final : public Device {
 public:
  std::string_view name() const override { return "cuda"; }
  Result<int> count() override { return none(); }
  Result<std::string> uuid(int) override { return none(); }
  Result<PointerInfo> pointer_info(const void*) override { return none(); }
  Result<std::string> export_memory(const void*) override { return none(); }
  Result<void*> open_memory(std::string_view, int) override { return none(); }
  Status close_memory(void*) override { return none(); }
  Result<Stream> create_stream(int) override { return none(); }
  void destroy_stream(Stream) override {}
  Result<Event> create_event(int, bool) override { return none(); }
  void destroy_event(Event) override {}
  Result<std::string> export_event(Event) override { return none(); }
  Result<Event> open_event(std::string_view) override { return none(); }
  Status record(Event, Stream) override { return none(); }
  Status wait_event(Stream, Event) override { return none(); }
  Result<bool> done(Event) override { return none(); }
  Status enable_peer_access(int, int) override { return none(); }
  Status register_host(void*, uint64_t) override { return none(); }
  Status unregister_host(void*) override { return none(); }
  Status copy(Stream, std::span<const DeviceCopy>, CopyMethod, uint32_t) override { return none(); }
  Status copy_each(Stream, std::span<const DeviceCopy>) override { return none(); }
  Result<void*> allocate(int, uint64_t, bool) override { return none(); }
  Result<void*> allocate_unexportable(int, uint64_t) override { return none(); }
  Status free(void*) override { return none(); }
  Status fill_after(Stream, void*, uint64_t, uint8_t, std::chrono::microseconds) override { return none(); }
  Status copy_sync(void*, const void*, uint64_t) override { return none(); }
  Status content_hashes(int, std::span<const DeviceRange>, std::vector<uint64_t>*) override { return none(); }

 private:
  static Status none() {
    return Status::unavailable(
        "this kvbridge was built without CUDA (configure with the CUDA toolkit installed, "
        "or -DKVB_CUDA=ON)");
  }
};

Device& real() {
  static NoCuda device;
  return device;
}

}  // namespace
#endif

bool cuda_compiled() { return KVB_HAVE_CUDA != 0; }

const char* const kNotLegacyIpcCapable =
    "it was not allocated by cudaMalloc (memory from cuMemCreate, as PyTorch's expandable segments make, has no "
    "legacy IPC handle: set PYTORCH_CUDA_ALLOC_CONF=expandable_segments:False)";

Device& current() {
  static Device& chosen = []() -> Device& {
    const char* which = std::getenv("KVB_DEVICE");
    if (which != nullptr && std::string(which) == "fake") return fake();
    return real();
  }();
  return chosen;
}

Result<int> ordinal_of(Device& device, std::string_view uuid) {
  KVB_ASSIGN_OR_RETURN(int n, device.count());
  for (int i = 0; i < n; ++i) {
    KVB_ASSIGN_OR_RETURN(std::string u, device.uuid(i));
    if (u == uuid) return i;
  }
  return -1;
}

std::string_view copy_method_name(CopyMethod method) {
  return method == CopyMethod::kKernel ? "kernel" : method == CopyMethod::kAuto ? "auto" : "copy_engine";
}

Result<CopyMethod> parse_copy_method(std::string_view name) {
  if (name == "copy_engine") return CopyMethod::kCopyEngine;
  if (name == "kernel") return CopyMethod::kKernel;
  if (name == "auto") return CopyMethod::kAuto;
  return Status::invalid_argument("unknown copy method '" + std::string(name) +
                                  "' (expected copy_engine, kernel or auto)");
}

Result<int> parse_cuda_memory(std::string_view memory) {
  // N is one to five decimal digits, as the layout format says.
  if (memory.substr(0, 5) != "cuda:" || memory.size() == 5 || memory.size() > 10) {
    return Status::invalid_argument("memory kind '" + std::string(memory) + "' is not cuda:N");
  }
  int n = 0;
  for (char c : memory.substr(5)) {
    if (c < '0' || c > '9') return Status::invalid_argument("memory kind '" + std::string(memory) + "' is not cuda:N");
    n = n * 10 + (c - '0');
  }
  return n;
}

Status check_device_range(Device& dev, const void* p, uint64_t bytes, std::string_view memory) {
  KVB_ASSIGN_OR_RETURN(int want, parse_cuda_memory(memory));
  const auto* base = static_cast<const uint8_t*>(p);
  Result<int> n = dev.count();
  if (!n.ok()) return Status::unavailable(std::string(memory) + ": " + n.error().message());
  if (want >= *n) {
    return Status::invalid_argument(std::string(memory) + ": there is no such device (" + std::to_string(*n) +
                                    " here)");
  }
  const uint64_t begin = reinterpret_cast<uint64_t>(base), end = begin + bytes;
  for (uint64_t at = begin; at < end;) {
    KVB_ASSIGN_OR_RETURN(PointerInfo info, dev.pointer_info(reinterpret_cast<const void*>(at)));
    const std::string where = "byte " + std::to_string(at - begin) + " of the range";
    switch (info.type) {
      case MemoryType::kHost:
        return Status::invalid_argument(where + " is host memory, not " + std::string(memory));
      case MemoryType::kManaged:
        return Status::invalid_argument(where +
                                        " is managed (unified) memory; kvbridge moves device memory from "
                                        "cudaMalloc, as cuda:N, or host memory");
      case MemoryType::kDevice:
        break;
    }
    if (info.device != want) {
      return Status::invalid_argument(where + " is memory of cuda:" + std::to_string(info.device) + ", not " +
                                      std::string(memory));
    }
    if (info.base + info.bytes <= at) return Status::internal("device reports an allocation that ends before it");
    at = info.base + info.bytes;
  }
  return Status();
}

}  // namespace kvbridge::device
