// The host fake of device.h: device memory that is shared host memory, so
// that everything above the seam runs, across processes, on a machine
// without a GPU.
//
// An allocation is a memfd (memfd_create(2)) mapped MAP_SHARED; its handle
// names the owner's pid, the descriptor number and the allocation's serial,
// and open_memory() opens /proc/PID/fd/FD, checking by the memfd's name
// (readlink(2) shows "/memfd:NAME (deleted)") that the descriptor still holds
// that allocation: a freed allocation, or one whose process exited, does
// not open (kNotFound), and a descriptor number reused by a later
// allocation is not mistaken for it. The mapping an opener holds stays
// valid after the owner frees (the kernel keeps the file while it is
// mapped), which is the hazard real IPC has too: the layers above must not
// use a mapping of memory the peer no longer advertises.
//
// A stream is a thread that runs its queue in order. An event is a page of
// shared memory with two counters: record() takes the next sequence number
// and queues its completion; wait_event() queues a wait for the sequence
// number recorded last at the time of the call (cudaStreamWaitEvent's
// rule); done() compares the two (and refuses an event never recorded).
// An event's page is a memfd too, so an event handle opens in another
// process like a memory handle. A handle names its host (the network
// namespace) and opens on that host only.
//
// Devices as CUDA has them (device.h): KVB_FAKE_DEVICES devices (default
// 2), whose "physical" numbers KVB_FAKE_VISIBLE_DEVICES lists in this
// process's order ("1,0": ordinal 0 is physical 1), and whose UUID follows
// the physical number. A memory handle names the physical device; a
// mapping belongs to the device it was opened on. The kernels' rules
// (kernel_reaches()): a kernel on device D may touch D's allocations,
// another device's when D enabled peer access to it, mappings opened on D,
// and host memory registered with register_host(); anything else fails as
// CUDA's illegal address does. Which devices got a context is recorded
// (fake_context_on()).
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>
#include <vector>

#include "common/thread_name.h"
#include "common/xxh3.h"
#include "device/cuda_errors.h"
#include "device/device.h"
#include "device/fake_internal.h"
#include "device/gather.h"

namespace kvbridge::device {
namespace {

using namespace fake_internal;

// Which "host" this process is on: its network namespace (the tests' stand-in
// for a second host is a namespace pair joined by veth). Handles carry it,
// and one from another host does not open, as CUDA IPC handles do not cross
// hosts, although the fake's memfds would.
uint64_t this_host() {
  struct stat st {};
  return ::stat("/proc/self/ns/net", &st) == 0 ? static_cast<uint64_t>(st.st_ino) : 0;
}
const std::string kOtherHost =
    "the handle comes from another host (network namespace); CUDA IPC handles do not cross hosts";

struct Alloc {
  uint64_t bytes = 0;
  int device = 0;  // this process's ordinal: where it was allocated, or opened
  int fd = -1;     // owned allocations; -1 for opened ones
  bool managed = false;
  std::string opened_from;    // the handle, for opened ones
  bool unexportable = false;  // allocate_unexportable (cuMemCreate on a GPU)
};

class FakeDevice final : public Device {
 public:
  FakeDevice() {
    if (const char* n = std::getenv("KVB_FAKE_DEVICES"); n != nullptr && *n != '\0') devices_ = std::atoi(n);
    for (int i = 0; i < devices_; ++i) physical_.push_back(i);
    if (const char* v = std::getenv("KVB_FAKE_VISIBLE_DEVICES"); v != nullptr && *v != '\0') {
      physical_.clear();
      std::istringstream in(v);
      for (std::string item; std::getline(in, item, ',');) {
        const int n = std::atoi(item.c_str());
        if (n >= 0 && n < devices_ && std::find(physical_.begin(), physical_.end(), n) == physical_.end())
          physical_.push_back(n);
      }
      devices_ = static_cast<int>(physical_.size());
    }
  }

  std::string_view name() const override { return "fake"; }

  Result<int> count() override {
    if (devices_ <= 0) return Status::unavailable("fake device: KVB_FAKE_DEVICES is " + std::to_string(devices_));
    return devices_;
  }

  Result<std::string> uuid(int device) override {
    KVB_RETURN_IF_ERROR(check_device(device));
    std::string u = "kvb-fake-gpu-";
    u.resize(12);
    const uint32_t n = static_cast<uint32_t>(physical_[static_cast<size_t>(device)]);
    for (int i = 0; i < 4; ++i) u.push_back(static_cast<char>(n >> (8 * i)));
    return u;
  }

  Result<PointerInfo> pointer_info(const void* p) override {
    const auto at = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.upper_bound(at);
    PointerInfo info;
    if (it == allocs_.begin()) return info;
    --it;
    if (at >= it->first + it->second.bytes) return info;
    info.type = it->second.managed ? MemoryType::kManaged : MemoryType::kDevice;
    info.device = it->second.device;
    info.base = it->first;
    info.bytes = it->second.bytes;
    info.exportable = !it->second.managed && !it->second.unexportable && it->second.fd >= 0;
    if (!info.exportable) {
      info.why_not = it->second.managed        ? "managed memory has no IPC handle"
                     : it->second.unexportable ? kNotLegacyIpcCapable
                                               : "it was opened from another process";
    }
    return info;
  }

  Result<std::string> export_memory(const void* base) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(base));
    if (it == allocs_.end()) return Status::invalid_argument("fake device: export_memory: not an allocation's start");
    if (it->second.fd < 0 || it->second.managed || it->second.unexportable) {
      return Status::unavailable("fake device: export_memory: this allocation cannot be exported");
    }
    std::ostringstream h;
    h << "fake-mem " << ::getpid() << " " << it->second.fd << " " << serial_of_.at(it->first) << " " << it->second.bytes
      << " " << physical_[static_cast<size_t>(it->second.device)] << " " << this_host();
    return h.str();
  }

  Result<void*> open_memory(std::string_view handle, int device) override {
    std::istringstream in{std::string(handle)};
    std::string tag;
    long pid = 0, fd = 0;
    uint64_t serial = 0, bytes = 0;
    int physical = 0;
    uint64_t host = 0;
    if (!(in >> tag >> pid >> fd >> serial >> bytes >> physical >> host) || tag != "fake-mem" || bytes == 0) {
      return Status::invalid_argument("fake device: open_memory: not a memory handle");
    }
    if (host != this_host()) return Status::invalid_argument("fake device: open_memory: " + kOtherHost);
    KVB_RETURN_IF_ERROR(check_device(device));
    {
      std::lock_guard<std::mutex> lock(mu_);
      for (const auto& [base, a] : allocs_) {
        if (a.opened_from == handle && a.device == device) {
          return Status::already_exists("fake device: open_memory: this handle is already open on device " +
                                        std::to_string(device) + " in this process");
        }
      }
      contexts_.insert(device);
    }
    KVB_ASSIGN_OR_RETURN(int opened, open_peer_memfd(pid, fd, memfd_name(pid, "mem", serial)));
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
    ::close(opened);
    if (p == MAP_FAILED)
      return Status::io_error(std::string("fake device: open_memory: mmap: ") + std::strerror(errno));
    std::lock_guard<std::mutex> lock(mu_);
    allocs_[reinterpret_cast<uintptr_t>(p)] = Alloc{bytes, device, -1, false, std::string(handle), false};
    return p;
  }

  Status close_memory(void* opened) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(opened));
    if (it == allocs_.end() || it->second.opened_from.empty()) {
      return Status::invalid_argument("fake device: close_memory: not an opened allocation");
    }
    ::munmap(opened, it->second.bytes);
    allocs_.erase(it);
    return Status();
  }

  Result<Stream> create_stream(int device) override {
    KVB_RETURN_IF_ERROR(use_device(device));
    return static_cast<Stream>(new FakeStream(device));
  }
  void destroy_stream(Stream stream) override { delete static_cast<FakeStream*>(stream); }

  Result<Event> create_event(int device, bool interprocess) override {
    (void)interprocess;
    KVB_RETURN_IF_ERROR(use_device(device));
    const uint64_t serial = next_serial_.fetch_add(1);
    const int fd = ::memfd_create(memfd_name(::getpid(), "event", serial).c_str(), MFD_CLOEXEC);
    if (fd < 0) return Status::io_error(std::string("fake device: memfd_create: ") + std::strerror(errno));
    if (::ftruncate(fd, 4096) != 0) {
      ::close(fd);
      return Status::io_error(std::string("fake device: ftruncate: ") + std::strerror(errno));
    }
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return Status::io_error(std::string("fake device: mmap: ") + std::strerror(errno));
    }
    new (p) EventPage();
    auto mapping = std::make_shared<PageMapping>(p);
    {
      std::lock_guard<std::mutex> lock(mu_);
      if (events_.size() >= 1024) std::erase_if(events_, [](const auto& e) { return e.second.expired(); });
      events_[serial] = mapping;
    }
    return static_cast<Event>(new FakeEvent{mapping, mapping->page, fd, serial, device});
  }

  void destroy_event(Event event) override {
    auto* e = static_cast<FakeEvent*>(event);
    if (e->fd >= 0) ::close(e->fd);
    delete e;
  }

  Result<std::string> export_event(Event event) override {
    auto* e = static_cast<FakeEvent*>(event);
    if (e->fd < 0) return Status::invalid_argument("fake device: export_event: an opened event cannot be exported");
    return "fake-event " + std::to_string(::getpid()) + " " + std::to_string(e->fd) + " " + std::to_string(e->serial) +
           " " + std::to_string(this_host());
  }

  Result<Event> open_event(std::string_view handle) override {
    std::istringstream in{std::string(handle)};
    std::string tag;
    long pid = 0, fd = 0;
    uint64_t serial = 0, host = 0;
    if (!(in >> tag >> pid >> fd >> serial >> host) || tag != "fake-event") {
      return Status::invalid_argument("fake device: open_event: not an event handle");
    }
    if (host != this_host()) return Status::invalid_argument("fake device: open_event: " + kOtherHost);
    if (pid == ::getpid()) {
      // This process's own event shares its creator's mapping: two mappings
      // of one page would hide from ThreadSanitizer that their atomics are
      // the same (it cannot see aliases), and report races that are not.
      std::lock_guard<std::mutex> lock(mu_);
      auto it = events_.find(serial);
      std::shared_ptr<PageMapping> mapping = it == events_.end() ? nullptr : it->second.lock();
      if (!mapping) return Status::not_found("fake device: open_event: the event is gone");
      return static_cast<Event>(new FakeEvent{mapping, mapping->page, -1, serial});
    }
    KVB_ASSIGN_OR_RETURN(int opened, open_peer_memfd(pid, fd, memfd_name(pid, "event", serial)));
    void* p = ::mmap(nullptr, 4096, PROT_READ | PROT_WRITE, MAP_SHARED, opened, 0);
    ::close(opened);
    if (p == MAP_FAILED) return Status::io_error(std::string("fake device: open_event: mmap: ") + std::strerror(errno));
    auto mapping = std::make_shared<PageMapping>(p);
    return static_cast<Event>(new FakeEvent{mapping, mapping->page, -1, serial});
  }

  Status record(Event event, Stream stream) override {
    auto* e = static_cast<FakeEvent*>(event);
    auto* s = static_cast<FakeStream*>(stream);
    if (e->device >= 0 && e->device != s->device) {
      return Status::invalid_argument("fake device: cudaEventRecord: an event of device " + std::to_string(e->device) +
                                      " cannot be recorded on a stream of device " + std::to_string(s->device) +
                                      " (CUDA: cudaErrorInvalidResourceHandle)");
    }
    EventPage* page = e->page;
    const uint64_t seq = page->recorded.fetch_add(1) + 1;
    static_cast<FakeStream*>(stream)->push([page, seq](const std::atomic<bool>&) {
      uint64_t was = page->completed.load();
      while (was < seq && !page->completed.compare_exchange_weak(was, seq)) {
      }
    });
    return Status();
  }

  Status wait_event(Stream stream, Event event) override {
    EventPage* page = static_cast<FakeEvent*>(event)->page;
    const uint64_t target = page->recorded.load();
    static_cast<FakeStream*>(stream)->push([page, target](const std::atomic<bool>& stopping) {
      while (page->completed.load() < target && !stopping.load())
        std::this_thread::sleep_for(std::chrono::microseconds(50));
    });
    return Status();
  }

  Result<bool> done(Event event) override {
    EventPage* page = static_cast<FakeEvent*>(event)->page;
    const uint64_t recorded = page->recorded.load();
    if (recorded == 0) {
      return Status::invalid_argument(
          "fake device: the event was never recorded: CUDA would call it complete before its work was queued");
    }
    return page->completed.load() >= recorded;
  }

  Status enable_peer_access(int device, int peer) override {
    KVB_RETURN_IF_ERROR(use_device(device));
    KVB_RETURN_IF_ERROR(check_device(peer));
    std::lock_guard<std::mutex> lock(mu_);
    peers_.insert({device, peer});
    return Status();
  }

  // The copy engines move anything; the kernel only what its device
  // reaches, cut and copied lane by lane with the kernel's own code
  // (gather.h), so a bug in the cutting or the lanes' shares shows here.
  Status copy(Stream stream, std::span<const DeviceCopy> copies, CopyMethod method, uint32_t max_blocks) override {
    (void)max_blocks;
    auto* s = static_cast<FakeStream*>(stream);
    if (method == CopyMethod::kKernel) {
      std::vector<gather::Piece> pieces;
      for (size_t i = 0; i < copies.size(); ++i) {
        const DeviceCopy& c = copies[i];
        if (c.bytes == 0) continue;
        const std::string what = "the gather/scatter kernel's copy " + std::to_string(i);
        KVB_RETURN_IF_ERROR(kernel_reaches(s->device, c.src, c.bytes, what + " (source)"));
        KVB_RETURN_IF_ERROR(kernel_reaches(s->device, c.dst, c.bytes, what + " (destination)"));
        gather::cut(reinterpret_cast<uint64_t>(c.dst), reinterpret_cast<uint64_t>(c.src), c.bytes, &pieces);
      }
      kernel_copies_.fetch_add(1);
      s->push([pieces = std::move(pieces)](const std::atomic<bool>&) {
        for (const gather::Piece& p : pieces) {
          for (unsigned lane = 0; lane < gather::kWarpLanes; ++lane) gather::copy_piece(p, lane, gather::kWarpLanes);
        }
      });
      return Status();
    }
    std::vector<DeviceCopy> batch(copies.begin(), copies.end());
    s->push([batch = std::move(batch)](const std::atomic<bool>&) {
      for (const DeviceCopy& c : batch) std::memcpy(c.dst, c.src, c.bytes);
    });
    return Status();
  }

  Status register_host(void* p, uint64_t bytes) override {
    if (bytes == 0) return Status::invalid_argument("fake device: cudaHostRegister: 0 bytes");
    const auto at = reinterpret_cast<uintptr_t>(p);
    std::lock_guard<std::mutex> lock(mu_);
    auto next = pinned_.lower_bound(at);
    const bool overlaps_next = next != pinned_.end() && next->first < at + bytes;
    const bool overlaps_prev = next != pinned_.begin() && std::prev(next)->first + std::prev(next)->second > at;
    if (overlaps_next || overlaps_prev) {
      return Status::already_exists(
          "fake device: cudaHostRegister: the range overlaps host memory already pinned "
          "(CUDA: cudaErrorHostMemoryAlreadyRegistered)");
    }
    pinned_[at] = bytes;
    return Status();
  }

  Status unregister_host(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    if (pinned_.erase(reinterpret_cast<uintptr_t>(p)) == 0) {
      return Status::invalid_argument(
          "fake device: cudaHostUnregister: no pinned range starts there (CUDA: cudaErrorHostMemoryNotRegistered)");
    }
    return Status();
  }

  bool context_on(int device) {
    std::lock_guard<std::mutex> lock(mu_);
    return contexts_.count(device) != 0;
  }

  size_t kernel_copies() const { return kernel_copies_.load(); }

  size_t pinned_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return pinned_.size();
  }

  Status copy_each(Stream stream, std::span<const DeviceCopy> copies) override {
    for (const DeviceCopy& c : copies) {
      static_cast<FakeStream*>(stream)->push([c](const std::atomic<bool>&) { std::memcpy(c.dst, c.src, c.bytes); });
    }
    return Status();
  }

  Result<void*> allocate(int device, uint64_t bytes, bool managed) override {
    KVB_RETURN_IF_ERROR(use_device(device));
    if (bytes == 0) return Status::invalid_argument("fake device: allocate: 0 bytes");
    const uint64_t serial = next_serial_.fetch_add(1);
    const int fd = ::memfd_create(memfd_name(::getpid(), "mem", serial).c_str(), MFD_CLOEXEC);
    if (fd < 0) return Status::io_error(std::string("fake device: memfd_create: ") + std::strerror(errno));
    if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
      ::close(fd);
      return Status::resource_exhausted(std::string("fake device: ftruncate: ") + std::strerror(errno));
    }
    void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
      ::close(fd);
      return Status::resource_exhausted(std::string("fake device: mmap: ") + std::strerror(errno));
    }
    std::lock_guard<std::mutex> lock(mu_);
    allocs_[reinterpret_cast<uintptr_t>(p)] = Alloc{bytes, device, fd, managed, {}, false};
    serial_of_[reinterpret_cast<uintptr_t>(p)] = serial;
    return p;
  }

  Result<void*> allocate_unexportable(int device, uint64_t bytes) override {
    KVB_ASSIGN_OR_RETURN(void* p, allocate(device, bytes, false));
    std::lock_guard<std::mutex> lock(mu_);
    allocs_.at(reinterpret_cast<uintptr_t>(p)).unexportable = true;
    return p;
  }

  Status free(void* p) override {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = allocs_.find(reinterpret_cast<uintptr_t>(p));
    if (it == allocs_.end() || it->second.fd < 0) {
      return Status::invalid_argument("fake device: free: not an allocation of this process");
    }
    ::munmap(p, it->second.bytes);
    ::close(it->second.fd);
    serial_of_.erase(it->first);
    allocs_.erase(it);
    return Status();
  }

  Status fill_after(Stream stream, void* p, uint64_t bytes, uint8_t value, std::chrono::microseconds delay) override {
    auto* s = static_cast<FakeStream*>(stream);
    KVB_RETURN_IF_ERROR(kernel_reaches(s->device, p, bytes, "the fill kernel"));
    s->push([=](const std::atomic<bool>&) {
      std::this_thread::sleep_for(delay);
      std::memset(p, value, bytes);
    });
    return Status();
  }

  Status copy_sync(void* dst, const void* src, uint64_t bytes) override {
    std::memcpy(dst, src, bytes);
    return Status();
  }

  // What the kernel computes, leaf by leaf with the same code, on the host;
  // a range that is not device memory of `device` inside one allocation
  // fails as the kernel's launch would (an illegal address on a real one).
  Status content_hashes(int device, std::span<const DeviceRange> ranges, std::vector<uint64_t>* hashes) override {
    KVB_RETURN_IF_ERROR(use_device(device));
    hashes->clear();
    std::vector<uint64_t> leaves;
    for (size_t i = 0; i < ranges.size(); ++i) {
      const DeviceRange& r = ranges[i];
      KVB_ASSIGN_OR_RETURN(PointerInfo info, pointer_info(r.p));
      const uint64_t at = reinterpret_cast<uint64_t>(r.p);
      if (info.type != MemoryType::kDevice || info.device != device || at + r.bytes > info.base + info.bytes) {
        std::ostringstream m;
        m << "fake device: content_hashes: range " << i << " (" << r.bytes << " bytes at 0x" << std::hex << at
          << ") is not device memory of device " << std::dec << device << " inside one allocation";
        return Status::invalid_argument(m.str());
      }
      leaves.resize(xxh3::content_leaves(r.bytes));
      for (uint64_t l = 0; l < leaves.size(); ++l) leaves[l] = xxh3::content_leaf(r.p, r.bytes, l);
      hashes->push_back(xxh3::content_root(leaves.data(), leaves.size()));
    }
    return Status();
  }

  size_t opened_count() {
    std::lock_guard<std::mutex> lock(mu_);
    return static_cast<size_t>(
        std::count_if(allocs_.begin(), allocs_.end(), [](const auto& a) { return !a.second.opened_from.empty(); }));
  }

 private:
  Status check_device(int device) const {
    if (device < 0 || device >= devices_) {
      return Status::invalid_argument("fake device: no device " + std::to_string(device) + " (there are " +
                                      std::to_string(devices_) + ")");
    }
    return Status();
  }
  // check_device(), and the device has a context from now on.
  Status use_device(int device) {
    KVB_RETURN_IF_ERROR(check_device(device));
    std::lock_guard<std::mutex> lock(mu_);
    contexts_.insert(device);
    return Status();
  }

  // Whether a kernel on `device` may touch [p, p + bytes): an allocation of
  // the device (or of a peer it enabled access to), a mapping opened on the
  // device, or pinned host memory, the range inside one of them. CUDA's
  // illegal address otherwise (sticky: cuda_errors.h).
  Status kernel_reaches(int device, const void* p, uint64_t bytes, const std::string& what) {
    const auto at = reinterpret_cast<uintptr_t>(p);
    std::string why;
    {
      std::lock_guard<std::mutex> lock(mu_);
      auto it = allocs_.upper_bound(at);
      if (it != allocs_.begin() && at < std::prev(it)->first + std::prev(it)->second.bytes) {
        --it;
        const Alloc& a = it->second;
        if (at + bytes > it->first + a.bytes) {
          why = "runs past the end of its allocation";
        } else if (a.device == device) {
          return Status();
        } else if (!a.opened_from.empty()) {
          why = "is a mapping opened on device " + std::to_string(a.device) + ", not on this one";
        } else if (peers_.count({device, a.device}) != 0) {
          return Status();
        } else {
          why = "is memory of device " + std::to_string(a.device) + ", to which this one has no peer access";
        }
      } else {
        auto pin = pinned_.upper_bound(at);
        if (pin != pinned_.begin() && at + bytes <= std::prev(pin)->first + std::prev(pin)->second) return Status();
        why = "is host memory that is not pinned (register_host)";
      }
    }
    std::ostringstream m;
    m << what << " on device " << device << ": " << bytes << " bytes at 0x" << std::hex << at << std::dec << " " << why;
    return cuda_status(700, "cudaErrorIllegalAddress", "an illegal memory access was encountered",
                       "fake device: " + m.str());
  }

  std::atomic<size_t> kernel_copies_{0};
  std::vector<int> physical_;  // ordinal -> physical device
  std::set<int> contexts_;
  std::set<std::pair<int, int>> peers_;   // (device, peer): peer access enabled
  std::map<uintptr_t, uint64_t> pinned_;  // register_host: first byte -> bytes
  int devices_ = 2;
  std::atomic<uint64_t> next_serial_{1};
  std::mutex mu_;
  std::map<uintptr_t, Alloc> allocs_;                      // by first byte: owned and opened allocations
  std::map<uintptr_t, uint64_t> serial_of_;                // owned allocations' serials
  std::map<uint64_t, std::weak_ptr<PageMapping>> events_;  // this process's events, by serial
};

}  // namespace

namespace {
FakeDevice& the_fake() {
  static FakeDevice* device = new FakeDevice();  // never destroyed: streams may outlive static teardown
  return *device;
}
}  // namespace

Device& fake() { return the_fake(); }

size_t fake_opened_count() { return the_fake().opened_count(); }

bool fake_context_on(int device) { return the_fake().context_on(device); }

size_t fake_pinned_count() { return the_fake().pinned_count(); }

size_t fake_kernel_copies() { return the_fake().kernel_copies(); }

}  // namespace kvbridge::device
