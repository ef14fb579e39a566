// The local disk tier, between the memory tier and the shared tier: whole
// objects (header and checksum included, docs/formats/store-object.md) in
// files under one directory, bounded by a capacity in bytes, evicted least
// recently used first.
//
// Files: <directory>/<xx>/<hash hex>.<group>, where xx is the first two hex
// digits of the hash (256 subdirectories keep directories small), mode 0600.
// A write goes to a temporary name in the same subdirectory (".tmp." and a
// sequence number) and is renamed over the final name once every byte is
// written, so a process killed mid-write never leaves a torn object under an
// object's name; leftover temporary files are deleted when a tier opens the
// directory. A torn file after a power loss (no fsync unless `sync`) or a
// file changed by anybody else fails the object's checksum when read: the
// reader counts it as bad, drops the file and treats it as a miss.
//
// One process owns a directory at a time: open() takes an exclusive flock on
// <directory>/LOCK and refuses a directory another tier holds (naming it),
// because the capacity is enforced by this process's index of the files.
// open() rebuilds that index from the files there (least recently used first
// by modification time), deleting the oldest past the capacity.
//
// Capacity: a write reserves its object's bytes before it writes (evicting
// the least recently used files), so the files never exceed the capacity, even
// with writers racing. An object larger than the capacity is not written.
//
// Reads: get() reads each file into the buffer a GetSink names (the same
// interface as the Redis tier, so promotion into memory is shared), in
// `io_bytes` preads at offsets aligned to it, reporting the bytes as they
// arrive; the next file's read-ahead (POSIX_FADV_WILLNEED) is started while
// one is read, so the device always has work queued. Through the page cache: buffers
// are memory-tier buffers (not block-aligned), and a file read again soon is
// served from memory.
//
// Not a public header. Thread-safety: thread-safe (one mutex guards the
// index; file I/O runs outside it: a file evicted while it is read stays
// readable through its open descriptor).
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <unordered_map>

#include "kvbridge/store.h"
#include "kvbridge/store_key.h"
#include "store/redis_tier.h"

namespace kvbridge::store_internal {

struct DiskCounters {
  uint64_t objects = 0, bytes = 0, capacity = 0;
  uint64_t writes = 0;             // objects written
  uint64_t evictions = 0;          // files deleted to make room
  uint64_t rejected = 0;           // objects larger than the capacity
  uint64_t errors = 0;             // failed writes or reads (I/O errors, a full disk)
  uint64_t bad = 0;                // files dropped: wrong size, or failed the object check
  uint64_t removed_temporary = 0;  // leftovers of killed writers deleted by open()
};

class DiskTier {
 public:
  // Creates the directory (one level) when missing, locks it, deletes
  // leftover temporary files and indexes the objects there. kInvalidArgument
  // for an empty directory or a zero capacity; kUnavailable when another
  // tier holds the directory; kIoError naming the path otherwise.
  static Result<std::unique_ptr<DiskTier>> open(const DiskOptions& options);
  ~DiskTier();
  DiskTier(const DiskTier&) = delete;
  DiskTier& operator=(const DiskTier&) = delete;

  const DiskOptions& options() const { return options_; }
  bool contains(const ObjectKey& key) const;
  // Writes `object` as `key` unless it is there already (then it only
  // becomes most recently used). False when it was not written (too large,
  // or an I/O error, counted).
  bool put(const ObjectKey& key, std::span<const uint8_t> object);
  // Reads keys[i] into sink.buffer(i, file size), in key order. A key whose
  // file is gone, cannot be read, or whose buffer is nullptr is skipped
  // (no done()).
  void get(std::span<const ObjectKey> keys, GetSink& sink);
  // Deletes the file of `key` (a reader found it bad) and counts it.
  void drop_bad(const ObjectKey& key);
  DiskCounters counters() const;

  // The path of the file of `key` (for tests and tools).
  std::string path(const ObjectKey& key) const;

 private:
  struct Entry {
    uint64_t bytes = 0;
    std::list<ObjectKey>::iterator lru;
  };
  DiskTier(DiskOptions options, int lock_fd);
  Status scan();
  // Opens the file of `key` for get() (most recently used now) and starts
  // reading it ahead; -1 when it is gone or bad (counted).
  int open_for_read(const ObjectKey& key, uint64_t* bytes);
  // Requires mu_. Evicts least recently used files until `bytes` more fit.
  void make_room_locked(uint64_t bytes);
  void erase_locked(const ObjectKey& key, bool count_eviction);

  const DiskOptions options_;
  const int lock_fd_;
  mutable std::mutex mu_;
  std::unordered_map<ObjectKey, Entry, ObjectKeyHasher> index_;
  std::list<ObjectKey> lru_;    // most recent first
  uint64_t used_ = 0;           // indexed files + reservations of writes in progress
  uint64_t indexed_bytes_ = 0;  // indexed files
  uint64_t next_tmp_ = 0;
  DiskCounters counters_;
};

}  // namespace kvbridge::store_internal
