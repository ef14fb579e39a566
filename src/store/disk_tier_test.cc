// The disk tier: byte-exact round trips across reopening, one owner per
// directory, the capacity under concurrent churn with LRU order, writers
// killed mid-write (no torn object visible), and, through a Store, hits from
// disk after memory is gone, corrupted files as misses, and promotion.
#include <dirent.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>
#include <thread>

#include <gtest/gtest.h>

#include "store/disk_tier.h"
#include "store/object.h"
#include "store/test_support.h"

namespace kvbridge {
namespace {

using store_internal::DiskTier;
using testing::Instance;
using testing::tokens;

namespace fs = std::filesystem;

// A fresh directory under the test's temporary directory, removed after.
struct TempDir {
  std::string path;
  TempDir() {
    char tmpl[] = "/tmp/kvb-disk-XXXXXX";
    path = ::mkdtemp(tmpl);
  }
  ~TempDir() { fs::remove_all(path); }
};

DiskOptions options(const std::string& dir, uint64_t capacity) {
  DiskOptions o;
  o.directory = dir;
  o.capacity_bytes = capacity;
  o.io_bytes = 4096;  // several reads per object
  return o;
}

ObjectKey key_of(uint64_t i) {
  return ObjectKey{BlockHash{i * 0x9e3779b97f4a7c15ULL, ~i}, static_cast<uint32_t>(i % 3)};
}

// A valid object (header with checksum) of `bytes` whose payload depends on
// `seed`.
std::vector<uint8_t> object_of(const ObjectKey& key, uint64_t bytes, uint64_t seed) {
  std::vector<uint8_t> o(bytes);
  std::mt19937_64 rng(seed);
  for (uint64_t i = store_internal::kHeaderBytes; i < bytes; ++i) o[i] = static_cast<uint8_t>(rng());
  store_internal::write_header(o.data(), key, bytes, 16, true);
  return o;
}

// Collects what DiskTier::get delivers, checking the sink's call order.
struct CollectSink final : store_internal::GetSink {
  std::vector<std::vector<uint8_t>> got;
  std::vector<uint64_t> next;
  std::vector<bool> done_flags;
  explicit CollectSink(size_t n) : got(n), next(n, 0), done_flags(n, false) {}
  uint8_t* buffer(size_t i, uint64_t bytes) override {
    got[i].assign(bytes, 0);
    return got[i].data();
  }
  void received(size_t i, uint64_t offset, uint64_t n) override {
    EXPECT_EQ(offset, next[i]);
    next[i] = offset + n;
  }
  void done(size_t i) override {
    EXPECT_EQ(next[i], got[i].size());
    done_flags[i] = true;
  }
};

// Bytes of the object files under `dir` (and their count, and how many are
// temporary), tolerating files that come and go meanwhile.
uint64_t bytes_in(const std::string& dir, uint64_t* files = nullptr, uint64_t* temporary = nullptr) {
  uint64_t total = 0;
  std::error_code ec;
  for (auto it = fs::recursive_directory_iterator(dir, ec); !ec && it != fs::recursive_directory_iterator();
       it.increment(ec)) {
    std::error_code fe;
    if (!it->is_regular_file(fe) || it->path().filename() == "LOCK") continue;
    const uintmax_t n = it->file_size(fe);
    if (fe) continue;  // gone since it was listed
    total += n;
    if (files) ++*files;
    if (temporary && it->path().filename().string().find(".tmp.") != std::string::npos) ++*temporary;
  }
  return total;
}

TEST(DiskTierTest, ObjectsReadBackByteExactAfterReopening) {
  TempDir d;
  std::vector<std::vector<uint8_t>> objects;
  std::vector<ObjectKey> keys;
  {
    auto tier = DiskTier::open(options(d.path, 1 << 20));
    ASSERT_TRUE(tier.ok()) << tier.status().to_string();
    for (uint64_t i = 0; i < 8; ++i) {
      keys.push_back(key_of(i));
      objects.push_back(object_of(keys.back(), 10000 + 777 * i, i));
      ASSERT_TRUE((*tier)->put(keys.back(), objects.back()));
    }
    EXPECT_EQ((*tier)->counters().writes, 8u);
  }
  auto tier = DiskTier::open(options(d.path, 1 << 20));
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  EXPECT_EQ((*tier)->counters().objects, 8u);
  CollectSink sink(keys.size());
  (*tier)->get(keys, sink);
  for (size_t i = 0; i < keys.size(); ++i) {
    EXPECT_TRUE(sink.done_flags[i]) << i;
    EXPECT_EQ(sink.got[i], objects[i]) << i;
  }
  struct stat st;
  ASSERT_EQ(::stat((*tier)->path(keys[0]).c_str(), &st), 0);
  EXPECT_EQ(st.st_mode & 0777, 0600u) << "objects are the user's only";
}

TEST(DiskTierTest, ADirectoryHasOneOwnerAtATime) {
  TempDir d;
  auto first = DiskTier::open(options(d.path, 1 << 20));
  ASSERT_TRUE(first.ok());
  auto second = DiskTier::open(options(d.path, 1 << 20));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), Code::kUnavailable);
  EXPECT_NE(second.status().message().find("in use by another store (pid " + std::to_string(::getpid())),
            std::string::npos)
      << second.status().to_string();
  first->reset();
  EXPECT_TRUE(DiskTier::open(options(d.path, 1 << 20)).ok()) << "the lock goes with its owner";
}

// The attacks of a local user who can write where the directory lives: a
// directory others can write into, one of another user, a link instead of
// the directory, a LOCK planted as a link to a victim file, a shard that is
// a link to another directory. Each is refused by name or left alone, and
// no file outside the directory is written or deleted.
TEST(DiskTierTest, ADirectoryOthersCanWriteOrLinksIntoItAreRefusedAndNothingOutsideIsTouched) {
  TempDir d;
  const std::string store = d.path + "/store";
  ASSERT_EQ(::mkdir(store.c_str(), 0777), 0);
  ASSERT_EQ(::chmod(store.c_str(), 0777), 0);  // past the umask
  auto open_writable = DiskTier::open(options(store, 1 << 20));
  ASSERT_FALSE(open_writable.ok());
  EXPECT_EQ(open_writable.status().code(), Code::kPermissionDenied);
  EXPECT_NE(open_writable.status().message().find("has mode 0777: other users can write into it"), std::string::npos)
      << open_writable.status().to_string();
  ASSERT_EQ(::chmod(store.c_str(), 0700), 0);
  ASSERT_EQ(::chown(store.c_str(), 65534, 65534), 0);  // the tests run as root
  auto foreign = DiskTier::open(options(store, 1 << 20));
  ASSERT_FALSE(foreign.ok());
  EXPECT_NE(foreign.status().message().find("belongs to uid 65534"), std::string::npos) << foreign.status().to_string();
  ASSERT_EQ(::chown(store.c_str(), ::geteuid(), ::getegid()), 0);

  const std::string link = d.path + "/link";
  ASSERT_EQ(::symlink(store.c_str(), link.c_str()), 0);
  auto linked = DiskTier::open(options(link, 1 << 20));
  ASSERT_FALSE(linked.ok());
  EXPECT_NE(linked.status().message().find("is a symbolic link"), std::string::npos) << linked.status().to_string();

  // A LOCK planted as a link to a victim: refused, the victim unchanged.
  const std::string victim = d.path + "/victim";
  { std::ofstream(victim) << "precious"; }
  ASSERT_EQ(::symlink(victim.c_str(), (store + "/LOCK").c_str()), 0);
  auto planted = DiskTier::open(options(store, 1 << 20));
  ASSERT_FALSE(planted.ok());
  EXPECT_NE(planted.status().message().find("symbolic link"), std::string::npos) << planted.status().to_string();
  std::ifstream in(victim);
  std::string text((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(text, "precious");
  ASSERT_EQ(::unlink((store + "/LOCK").c_str()), 0);

  // A shard that links elsewhere: its target's files are neither served nor
  // deleted (temporaries included).
  const std::string elsewhere = d.path + "/elsewhere";
  ASSERT_EQ(::mkdir(elsewhere.c_str(), 0700), 0);
  const ObjectKey k = key_of(1);
  const std::string name = k.text("");
  const std::vector<uint8_t> obj = object_of(k, 1000, 1);
  {
    std::ofstream(elsewhere + "/" + name, std::ios::binary)
        .write(reinterpret_cast<const char*>(obj.data()), obj.size());
  }
  { std::ofstream(elsewhere + "/" + name + ".tmp.7") << "someone's"; }
  ASSERT_EQ(::symlink(elsewhere.c_str(), (store + "/" + name.substr(0, 2)).c_str()), 0);
  auto tier = DiskTier::open(options(store, 1 << 20));
  ASSERT_TRUE(tier.ok()) << tier.status().to_string();
  EXPECT_FALSE((*tier)->contains(k)) << "an object behind a linked shard is not served";
  EXPECT_EQ((*tier)->counters().removed_temporary, 0u);
  EXPECT_TRUE(fs::exists(elsewhere + "/" + name + ".tmp.7"));
  EXPECT_TRUE(fs::exists(elsewhere + "/" + name));
}

TEST(DiskTierTest, BadOptionsAreRefusedByName) {
  TempDir d;
  auto empty = DiskTier::open(options("", 1));
  EXPECT_NE(empty.status().message().find("directory is empty"), std::string::npos);
  auto zero = DiskTier::open(options(d.path, 0));
  EXPECT_NE(zero.status().message().find("capacity_bytes"), std::string::npos);
  auto missing_parent = DiskTier::open(options(d.path + "/no/such", 1));
  EXPECT_EQ(missing_parent.status().code(), Code::kIoError);
  EXPECT_NE(missing_parent.status().message().find(d.path + "/no/such"), std::string::npos);
}

TEST(DiskTierTest, TheCapacityHoldsUnderConcurrentChurnAndEvictsLeastRecentlyUsed) {
  TempDir d;
  const uint64_t capacity = 64 * 1024;
  auto tier = DiskTier::open(options(d.path, capacity));
  ASSERT_TRUE(tier.ok());
  DiskTier& t = **tier;
  // A hot object, touched by every writer before each put: never the least
  // recently used for long.
  const ObjectKey hot = key_of(100000);
  ASSERT_TRUE(t.put(hot, object_of(hot, 3000, 1)));
  std::atomic<uint64_t> over{0};
  auto churn = [&](uint64_t base) {
    std::mt19937_64 rng(base);
    for (uint64_t i = 0; i < 150; ++i) {
      const ObjectKey k = key_of(base + i);
      t.put(k, object_of(k, 1000 + rng() % 9000, i));
      t.put(hot, object_of(hot, 3000, 1));  // present: only touched
      if (t.counters().bytes > capacity) ++over;
    }
  };
  std::thread a(churn, 1000), b(churn, 2000);
  a.join();
  b.join();
  uint64_t files = 0, temporary = 0;
  const uint64_t on_disk = bytes_in(d.path, &files, &temporary);
  EXPECT_EQ(over.load(), 0u);
  EXPECT_LE(on_disk, capacity);
  EXPECT_EQ(temporary, 0u);
  const store_internal::DiskCounters c = t.counters();
  EXPECT_EQ(c.bytes, on_disk);
  EXPECT_EQ(c.objects, files);
  EXPECT_GT(c.evictions, 200u);
  EXPECT_TRUE(t.contains(hot));
  EXPECT_FALSE(t.contains(key_of(1000))) << "the oldest went first";
  const ObjectKey huge = key_of(5);
  EXPECT_FALSE(t.put(huge, object_of(huge, capacity + 1, 1)));
  EXPECT_EQ(t.counters().rejected, 1u);
}

TEST(DiskTierTest, AWriterKilledMidWriteLeavesNoTornObject) {
  TempDir d;
  bool killed_mid_write = false;
  for (int round = 0; round < 4; ++round) {
    const pid_t child = ::fork();
    ASSERT_GE(child, 0);
    if (child == 0) {
      auto tier = DiskTier::open(options(d.path, uint64_t{1} << 30));
      if (!tier.ok()) ::_exit(3);
      std::vector<uint8_t> object = object_of(key_of(0), 4 << 20, 1);  // one payload, many keys
      for (uint64_t i = 0;; ++i) {
        const ObjectKey k = key_of(round * 100000 + i);
        store_internal::write_header(object.data(), k, object.size(), 16, true);
        (*tier)->put(k, object);
      }
    }
    // Kill it as soon as a write is under way (a temporary file exists),
    // after a few objects in later rounds.
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (int seen = 0; seen <= round && std::chrono::steady_clock::now() < deadline;) {
      uint64_t temporary = 0;
      bytes_in(d.path, nullptr, &temporary);
      if (temporary > 0) {
        ++seen;
        if (seen <= round) std::this_thread::sleep_for(std::chrono::milliseconds(3));
      }
    }
    ::kill(child, SIGKILL);
    int status = 0;
    ::waitpid(child, &status, 0);
    ASSERT_TRUE(WIFSIGNALED(status)) << "the writer did not run: exit " << WEXITSTATUS(status);
    uint64_t temporary = 0;
    bytes_in(d.path, nullptr, &temporary);
    killed_mid_write |= temporary > 0;
    auto tier = DiskTier::open(options(d.path, uint64_t{1} << 30));
    ASSERT_TRUE(tier.ok()) << tier.status().to_string();
    EXPECT_EQ((*tier)->counters().removed_temporary, temporary);
    uint64_t left = 0;
    bytes_in(d.path, nullptr, &left);
    EXPECT_EQ(left, 0u) << "leftover temporary files are deleted";
    // Every visible object is whole.
    std::vector<ObjectKey> keys;
    for (uint64_t i = 0; i < 1000; ++i) {
      if ((*tier)->contains(key_of(round * 100000 + i))) keys.push_back(key_of(round * 100000 + i));
    }
    CollectSink sink(keys.size());
    (*tier)->get(keys, sink);
    for (size_t i = 0; i < keys.size(); ++i) {
      ASSERT_TRUE(sink.done_flags[i]);
      EXPECT_TRUE(store_internal::check_object(sink.got[i], keys[i], 4 << 20, 16).ok()) << i;
    }
  }
  EXPECT_TRUE(killed_mid_write) << "no kill landed during a write: the test tested nothing";
}

// Through a Store: every rank of a TP 2 instance puts; a later Store (a new
// process) with an empty memory tier reads the prefix from disk, byte-exact.
std::shared_ptr<Store> disk_store(const std::string& dir, uint64_t disk_bytes) {
  StoreOptions o;
  o.hash_block_tokens = 16;
  o.disk = options(dir, disk_bytes);
  Result<std::shared_ptr<Store>> s = Store::create(o);
  EXPECT_TRUE(s.ok()) << s.status().to_string();
  return s.ok() ? *s : nullptr;
}

TEST(DiskStoreTest, AStoreOpenedLaterServesThePrefixFromDiskByteExact) {
  TempDir d;
  const std::vector<uint32_t> t = tokens(3, 128);
  {
    auto store = disk_store(d.path, uint64_t{1} << 30);
    Instance writer(store, "qwen3-next", {2, 64}, 128);
    writer.fill(128, 11);
    writer.put(t, 128);
    const StoreStats s = store->stats();
    EXPECT_TRUE(s.disk_configured);
    EXPECT_EQ(s.disk_writes, s.published);
    EXPECT_GT(s.disk_objects, 0u);
  }
  auto store = disk_store(d.path, uint64_t{1} << 30);
  Instance reader(store, "qwen3-next", {1, 128}, 128);
  Result<LookupResult> l = reader.stores[0].lookup(t);
  ASSERT_TRUE(l.ok());
  EXPECT_EQ(l->hit_tokens, 128u);
  EXPECT_EQ(l->memory_objects, 0u);
  EXPECT_GT(l->disk_objects, 0u);
  reader.get_and_check(t, 128, 11, 128);
  const StoreStats s = store->stats();
  EXPECT_EQ(s.disk_hits, l->disk_objects);
  EXPECT_EQ(s.memory_objects, l->disk_objects) << "promoted into memory";
  // Again: from memory now.
  reader.get_and_check(t, 128, 11, 128);
  EXPECT_EQ(store->stats().disk_hits, l->disk_objects);
  EXPECT_EQ(store->stats().memory_hits, l->disk_objects);
}

// Device memory into the disk tier and, from a Store opened later (its
// memory empty), out of it.
TEST(DiskStoreTest, DeviceMemoryIsStoredOnDiskAndReadBackIntoDeviceMemory) {
  TempDir d;
  testing::device_put(disk_store(d.path, uint64_t{1} << 30), "llama3-8b", {2, 32}, 128, 8);
  auto reader = disk_store(d.path, uint64_t{1} << 30);
  ASSERT_NE(reader, nullptr);
  EXPECT_EQ(testing::device_get(reader, "llama3-8b", {1, 16}, 128, 8), 128u);
  EXPECT_GT(reader->stats().disk_hits, 0u);
  EXPECT_EQ(reader->stats().memory_hits + reader->stats().redis_hits, 0u) << "the reader's objects came from disk";
}

TEST(DiskStoreTest, ACorruptedFileIsAMissAndIsDropped) {
  TempDir d;
  const std::vector<uint32_t> t = tokens(4, 128);
  auto store = disk_store(d.path, uint64_t{1} << 30);
  Instance inst(store, "llama3-8b", {1, 16}, 128);
  inst.fill(128, 5);
  inst.put(t, 128);
  store->clear_memory();
  // Flip one payload byte of the object of hash block 4 (files are
  // <directory>/<first two hex digits>/<hash hex>.<group>).
  const std::vector<BlockHash> h = inst.stores[0].hashes(t);
  const std::string name = ObjectKey{h[4], 0}.text("");
  const std::string p = d.path + "/" + name.substr(0, 2) + "/" + name;
  {
    std::fstream f(p, std::ios::in | std::ios::out | std::ios::binary);
    ASSERT_TRUE(f.good()) << p;
    f.seekg(store_internal::kHeaderBytes + 100);
    const char c = static_cast<char>(f.get());
    f.seekp(store_internal::kHeaderBytes + 100);
    f.put(static_cast<char>(c ^ 0xff));
  }
  // The hit stops before block 4: blocks 0-3 from disk, then a miss.
  inst.get_and_check(t, 128, 5, 64);
  const StoreStats s = store->stats();
  EXPECT_EQ(s.disk_bad_objects, 1u);
  EXPECT_FALSE(fs::exists(p)) << "a bad file is deleted";
  Result<LookupResult> again = inst.stores[0].lookup(t);
  EXPECT_EQ(again->hit_tokens, 64u);
}

}  // namespace
}  // namespace kvbridge
