// The local disk tier: see disk_tier.h.
#include "store/disk_tier.h"

#include <dirent.h>
#include <fcntl.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <utility>
#include <vector>

#include "common/text.h"

namespace kvbridge::store_internal {

namespace {

constexpr std::string_view kTmp = ".tmp.";

int hex_digit(char c) {
  if (c >= '0' && c <= '9') return c - '0';
  if (c >= 'a' && c <= 'f') return c - 'a' + 10;
  return -1;
}

// "<32 hex>.<group>" back into a key; false for any other name.
bool parse_name(std::string_view name, ObjectKey* key) {
  if (name.size() < 34 || name.size() > 43 || name[32] != '.') return false;
  uint64_t part[2] = {0, 0};  // hi, lo
  for (size_t i = 0; i < 32; ++i) {
    const int d = hex_digit(name[i]);
    if (d < 0) return false;
    part[i / 16] = part[i / 16] << 4 | static_cast<uint64_t>(d);
  }
  uint64_t group = 0;
  for (size_t i = 33; i < name.size(); ++i) {
    if (name[i] < '0' || name[i] > '9' || (i == 33 && name[i] == '0' && name.size() > 34)) return false;
    group = group * 10 + static_cast<uint64_t>(name[i] - '0');
  }
  if (group > UINT32_MAX) return false;
  key->hash.hi = part[0];
  key->hash.lo = part[1];
  key->group = static_cast<uint32_t>(group);
  return true;
}

std::string file_name(const ObjectKey& key) { return key.text(""); }

Status write_all(int fd, const uint8_t* p, uint64_t n, const std::string& path) {
  while (n > 0) {
    const ssize_t w = ::write(fd, p, std::min<uint64_t>(n, uint64_t{1} << 30));
    if (w < 0) {
      if (errno == EINTR) continue;
      return Status::io_error("disk tier: writing " + q(path) + ": " + errno_text(errno));
    }
    p += w;
    n -= static_cast<uint64_t>(w);
  }
  return Status();
}

// The tier's directory must be the store's alone: a directory (not a link
// to one), of this process's user, that no other user can write into (who
// could would swap objects, plant links, or take the lock).
Status check_own_directory(const std::string& dir) {
  struct stat st;
  if (::lstat(dir.c_str(), &st) != 0) {
    return Status::io_error("disk tier: directory " + q(dir) + ": " + errno_text(errno));
  }
  if (S_ISLNK(st.st_mode)) {
    return Status::permission_denied("disk tier: " + q(dir) +
                                     " is a symbolic link; give the store the directory itself");
  }
  if (!S_ISDIR(st.st_mode)) return Status::invalid_argument("disk tier: " + q(dir) + " is not a directory");
  if (st.st_uid != ::geteuid()) {
    return Status::permission_denied("disk tier: directory " + q(dir) + " belongs to uid " + std::to_string(st.st_uid) +
                                     ", not this process's (" + std::to_string(::geteuid()) +
                                     "): its owner could change the objects");
  }
  if ((st.st_mode & (S_IWGRP | S_IWOTH)) != 0) {
    char mode[8];
    std::snprintf(mode, sizeof(mode), "%04o", static_cast<unsigned>(st.st_mode & 07777));
    return Status::permission_denied("disk tier: directory " + q(dir) + " has mode " + mode +
                                     ": other users can write into it (chmod 700)");
  }
  return Status();
}

}  // namespace

DiskTier::DiskTier(DiskOptions options, int lock_fd) : options_(std::move(options)), lock_fd_(lock_fd) {
  counters_.capacity = options_.capacity_bytes;
}

DiskTier::~DiskTier() {
  if (lock_fd_ >= 0) ::close(lock_fd_);  // releases the flock
}

Result<std::unique_ptr<DiskTier>> DiskTier::open(const DiskOptions& options) {
  if (options.directory.empty()) return Status::invalid_argument("disk tier: the directory is empty");
  if (options.capacity_bytes == 0) return Status::invalid_argument("disk tier: capacity_bytes must be positive");
  if (options.io_bytes == 0) return Status::invalid_argument("disk tier: io_bytes must be positive");
  const std::string& dir = options.directory;
  if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
    return Status::io_error("disk tier: creating directory " + q(dir) + ": " + errno_text(errno));
  }
  KVB_RETURN_IF_ERROR(check_own_directory(dir));
  const std::string lock_path = dir + "/LOCK";
  // Never through a link: a LOCK planted as one would have the store
  // truncate and write whatever it points at.
  const int fd = ::open(lock_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0) {
    return Status::io_error("disk tier: opening " + q(lock_path) + ": " + errno_text(errno) +
                            (errno == ELOOP ? " (it is a symbolic link)" : ""));
  }
  struct stat lock_st;
  if (::fstat(fd, &lock_st) != 0 || !S_ISREG(lock_st.st_mode) || lock_st.st_uid != ::geteuid()) {
    ::close(fd);
    return Status::permission_denied("disk tier: " + q(lock_path) +
                                     " is not a regular file of this process's user; remove it");
  }
  if (::flock(fd, LOCK_EX | LOCK_NB) != 0) {
    const int err = errno;
    char holder[32] = {0};
    (void)!::pread(fd, holder, sizeof(holder) - 1, 0);
    ::close(fd);
    if (err == EWOULDBLOCK) {
      return Status::unavailable("disk tier: directory " + q(dir) + " is in use by another store (pid " +
                                 printable(std::string(holder, ::strnlen(holder, sizeof(holder))), 20) +
                                 "); give each store its own directory");
    }
    return Status::io_error("disk tier: locking " + q(lock_path) + ": " + errno_text(err));
  }
  const std::string pid = std::to_string(::getpid());
  if (::ftruncate(fd, 0) != 0 || ::pwrite(fd, pid.data(), pid.size(), 0) != static_cast<ssize_t>(pid.size())) {
    // The pid is only for the message above; the lock is what counts.
  }
  std::unique_ptr<DiskTier> tier(new DiskTier(options, fd));
  KVB_RETURN_IF_ERROR(tier->scan());
  return tier;
}

Status DiskTier::scan() {
  struct Found {
    ObjectKey key;
    uint64_t bytes;
    int64_t mtime_ns;
  };
  std::vector<Found> found;
  for (int sub = 0; sub < 256; ++sub) {
    char name[3];
    std::snprintf(name, sizeof(name), "%02x", sub);
    const std::string d = options_.directory + "/" + name;
    // A shard that is a link (or anything but a directory) is not ours: its
    // target's files are neither read nor deleted.
    const int dfd = ::open(d.c_str(), O_RDONLY | O_DIRECTORY | O_NOFOLLOW | O_CLOEXEC);
    if (dfd < 0) {
      if (errno == ENOENT || errno == ELOOP || errno == ENOTDIR) continue;
      return Status::io_error("disk tier: reading directory " + q(d) + ": " + errno_text(errno));
    }
    DIR* dp = ::fdopendir(dfd);
    if (dp == nullptr) {
      ::close(dfd);
      return Status::io_error("disk tier: reading directory " + q(d) + ": " + errno_text(errno));
    }
    while (const dirent* e = ::readdir(dp)) {
      const std::string_view n(e->d_name);
      if (n == "." || n == "..") continue;
      if (n.find(kTmp) != std::string_view::npos) {
        if (::unlinkat(dfd, e->d_name, 0) == 0) ++counters_.removed_temporary;
        continue;
      }
      ObjectKey key;
      struct stat st;
      if (!parse_name(n, &key) || n.substr(0, 2) != name || ::fstatat(dfd, e->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
          !S_ISREG(st.st_mode)) {
        continue;  // not ours: left alone
      }
      found.push_back(
          {key, static_cast<uint64_t>(st.st_size), int64_t{st.st_mtim.tv_sec} * 1000000000 + st.st_mtim.tv_nsec});
    }
    ::closedir(dp);
  }
  // Most recent first; then everything past the capacity goes, oldest first.
  std::sort(found.begin(), found.end(), [](const Found& a, const Found& b) { return a.mtime_ns > b.mtime_ns; });
  std::lock_guard<std::mutex> lock(mu_);
  for (const Found& f : found) {
    if (used_ + f.bytes > options_.capacity_bytes) {
      if (::unlink(path(f.key).c_str()) == 0) ++counters_.evictions;
      continue;
    }
    lru_.push_back(f.key);
    index_[f.key] = Entry{f.bytes, std::prev(lru_.end())};
    used_ += f.bytes;
    indexed_bytes_ += f.bytes;
  }
  return Status();
}

std::string DiskTier::path(const ObjectKey& key) const {
  const std::string name = file_name(key);
  return options_.directory + "/" + name.substr(0, 2) + "/" + name;
}

bool DiskTier::contains(const ObjectKey& key) const {
  std::lock_guard<std::mutex> lock(mu_);
  return index_.count(key) != 0;
}

void DiskTier::erase_locked(const ObjectKey& key, bool count_eviction) {
  auto it = index_.find(key);
  if (it == index_.end()) return;
  ::unlink(path(key).c_str());
  used_ -= it->second.bytes;
  indexed_bytes_ -= it->second.bytes;
  lru_.erase(it->second.lru);
  index_.erase(it);
  if (count_eviction) ++counters_.evictions;
}

void DiskTier::make_room_locked(uint64_t bytes) {
  while (used_ + bytes > options_.capacity_bytes && !lru_.empty()) erase_locked(lru_.back(), true);
}

bool DiskTier::put(const ObjectKey& key, std::span<const uint8_t> object) {
  const uint64_t bytes = object.size();
  uint64_t seq = 0;
  {
    std::lock_guard<std::mutex> lock(mu_);
    if (auto it = index_.find(key); it != index_.end()) {
      lru_.splice(lru_.begin(), lru_, it->second.lru);
      return true;
    }
    if (bytes > options_.capacity_bytes) {
      ++counters_.rejected;
      return false;
    }
    make_room_locked(bytes);
    if (used_ + bytes > options_.capacity_bytes) {  // the rest is reserved by writes in progress
      ++counters_.rejected;
      return false;
    }
    used_ += bytes;  // reserved
    seq = next_tmp_++;
  }
  const std::string final_path = path(key);
  const std::string dir = final_path.substr(0, final_path.rfind('/'));
  const std::string tmp = final_path + std::string(kTmp) + std::to_string(seq);
  Status st;
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
  if (fd < 0 && errno == ENOENT) {
    if (::mkdir(dir.c_str(), 0700) != 0 && errno != EEXIST) {
      st = Status::io_error("disk tier: creating directory " + q(dir) + ": " + errno_text(errno));
    } else {
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC | O_NOFOLLOW, 0600);
    }
  }
  if (st.ok() && fd < 0) st = Status::io_error("disk tier: creating " + q(tmp) + ": " + errno_text(errno));
  if (st.ok()) st = write_all(fd, object.data(), bytes, tmp);
  if (st.ok() && options_.sync && ::fdatasync(fd) != 0) {
    st = Status::io_error("disk tier: fdatasync " + q(tmp) + ": " + errno_text(errno));
  }
  if (fd >= 0) ::close(fd);
  if (st.ok() && ::rename(tmp.c_str(), final_path.c_str()) != 0) {
    st = Status::io_error("disk tier: renaming " + q(tmp) + ": " + errno_text(errno));
  }
  if (!st.ok()) ::unlink(tmp.c_str());
  std::lock_guard<std::mutex> lock(mu_);
  if (!st.ok()) {
    used_ -= bytes;
    ++counters_.errors;
    return false;
  }
  if (auto it = index_.find(key); it != index_.end()) {
    // Another writer of the same object finished first; one file holds it.
    used_ -= bytes;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
    return true;
  }
  lru_.push_front(key);
  index_[key] = Entry{bytes, lru_.begin()};
  indexed_bytes_ += bytes;
  ++counters_.writes;
  return true;
}

int DiskTier::open_for_read(const ObjectKey& key, uint64_t* bytes) {
  {
    std::lock_guard<std::mutex> lock(mu_);
    auto it = index_.find(key);
    if (it == index_.end()) return -1;
    *bytes = it->second.bytes;
    lru_.splice(lru_.begin(), lru_, it->second.lru);
  }
  const int fd = ::open(path(key).c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW);
  if (fd < 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (errno != ENOENT) ++counters_.errors;  // ENOENT: evicted since
    return -1;
  }
  struct stat st;
  if (::fstat(fd, &st) != 0 || static_cast<uint64_t>(st.st_size) != *bytes) {
    ::close(fd);
    drop_bad(key);  // changed behind the index
    return -1;
  }
  // The whole file is read next: read ahead (asynchronously) all of it.
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_SEQUENTIAL);
  ::posix_fadvise(fd, 0, 0, POSIX_FADV_WILLNEED);
  return fd;
}

void DiskTier::get(std::span<const ObjectKey> keys, GetSink& sink) {
  const uint64_t io = options_.io_bytes;
  // The next file is opened (its read-ahead started) while this one is read,
  // so the device always has a request queued.
  uint64_t next_bytes = 0;
  int next = keys.empty() ? -1 : open_for_read(keys[0], &next_bytes);
  for (size_t i = 0; i < keys.size(); ++i) {
    const int fd = next;
    const uint64_t bytes = next_bytes;
    next = i + 1 < keys.size() ? open_for_read(keys[i + 1], &next_bytes) : -1;
    if (fd < 0) continue;
    uint8_t* buf = sink.buffer(i, bytes);
    if (buf == nullptr) {
      ::close(fd);
      continue;
    }
    bool ok = true;
    for (uint64_t off = 0; off < bytes;) {
      const uint64_t want = std::min(io - off % io, bytes - off);
      const ssize_t r = ::pread(fd, buf + off, want, static_cast<off_t>(off));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        ok = false;
        break;
      }
      sink.received(i, off, static_cast<uint64_t>(r));
      off += static_cast<uint64_t>(r);
    }
    ::close(fd);
    if (!ok) {
      std::lock_guard<std::mutex> lock(mu_);
      ++counters_.errors;
      continue;  // the sink gives the buffer back: no done()
    }
    sink.done(i);
  }
}

void DiskTier::drop_bad(const ObjectKey& key) {
  std::lock_guard<std::mutex> lock(mu_);
  ++counters_.bad;
  erase_locked(key, false);
}

DiskCounters DiskTier::counters() const {
  std::lock_guard<std::mutex> lock(mu_);
  DiskCounters c = counters_;
  c.objects = index_.size();
  c.bytes = indexed_bytes_;
  return c;
}

}  // namespace kvbridge::store_internal
