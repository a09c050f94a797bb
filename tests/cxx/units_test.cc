// Pure-function tests of xlakit's runtime C++ against real XLA types: the
// sharded-assembly plan over real OpSharding protos, allocator-stat sums,
// the fate of refused cache entries, envelope identity checks, the atomic
// writer's temporary names and file modes, reading and removing entry files,
// and the runtime's entry MAC, key refusal and key id.
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cstdlib>
#include <fstream>
#include <memory>
#include <set>
#include <string>
#include <utility>
#include <vector>

#include "absl/status/status.h"
#include "check.h"

#include "torch_xla/csrc/runtime/xlakit/cache_entry.h"
#include "torch_xla/csrc/runtime/xlakit/core/atomic_file.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_fate.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_mac_openssl.h"
#include "torch_xla/csrc/runtime/xlakit/core/envelope.h"
#include "torch_xla/csrc/runtime/xlakit/memory_stats.h"
#include "torch_xla/csrc/runtime/xlakit/shard_layout.h"

namespace xlakit_test {
namespace {

using torch_xla::runtime::xlakit::LocalShard;
using torch_xla::runtime::xlakit::PlanShardAssembly;
using torch_xla::runtime::xlakit::ShardRegion;

xla::OpSharding Tiled(std::vector<int64_t> tiles, std::vector<int64_t> devices,
                      bool replicate_last = false) {
  xla::OpSharding s;
  s.set_type(xla::OpSharding::OTHER);
  for (int64_t t : tiles) s.add_tile_assignment_dimensions(t);
  for (int64_t d : devices) s.add_tile_assignment_devices(d);
  s.set_replicate_on_last_tile_dim(replicate_last);
  return s;
}

std::vector<LocalShard> Shards(std::vector<int64_t> ordinals,
                               std::vector<int64_t> dims) {
  std::vector<LocalShard> out;
  for (int64_t o : ordinals) out.push_back({o, dims});
  return out;
}

// Every element of `dims` is covered by exactly one region, and each region
// fits inside its shard.
bool CoversExactlyOnce(const std::vector<ShardRegion>& regions,
                       const std::vector<int64_t>& dims,
                       const std::vector<LocalShard>& shards) {
  int64_t total = 1;
  for (int64_t d : dims) total *= d;
  std::vector<int> hits(total, 0);
  for (const ShardRegion& r : regions) {
    for (size_t j = 0; j < dims.size(); ++j) {
      if (r.extent[j] > shards[r.shard].dims[j]) return false;
    }
    int64_t count = 1;
    for (int64_t e : r.extent) count *= e;
    for (int64_t k = 0; k < count; ++k) {
      int64_t rest = k, linear = 0, stride = 1;
      std::vector<int64_t> at(dims.size());
      for (size_t j = dims.size(); j-- > 0;) {
        at[j] = r.start[j] + rest % r.extent[j];
        rest /= r.extent[j];
      }
      for (size_t j = dims.size(); j-- > 0;) {
        linear += at[j] * stride;
        stride *= dims[j];
      }
      ++hits[linear];
    }
  }
  for (int h : hits) {
    if (h != 1) return false;
  }
  return true;
}

void TiledTensorWithPaddedEdgeShards() {
  std::vector<int64_t> dims = {5, 8};
  auto shards = Shards({0, 1, 2, 3}, {3, 4});
  auto plan = PlanShardAssembly(Tiled({2, 2}, {0, 1, 2, 3}), dims, shards);
  XLAKIT_CHECK_MSG(plan.ok(), plan.status());
  if (!plan.ok()) return;
  XLAKIT_CHECK(plan->size() == 4);
  XLAKIT_CHECK(CoversExactlyOnce(*plan, dims, shards));
  // The bottom-right tile comes from device 3 and is cut to 2 x 4.
  XLAKIT_CHECK(plan->back().shard == 3);
  XLAKIT_CHECK((plan->back().start == std::vector<int64_t>{3, 4}));
  XLAKIT_CHECK((plan->back().extent == std::vector<int64_t>{2, 4}));
}

void PartialReplicaTakesLowestLocalReplica() {
  // Tiles [2] x 2 replicas: tile 0 on devices 0,1; tile 1 on 2,3. This host
  // has devices 1 and 2 only: replica 0 of tile 0 is remote, replica 1 local.
  std::vector<int64_t> dims = {4, 3};
  auto shards = Shards({2, 1}, {2, 3});
  auto plan =
      PlanShardAssembly(Tiled({2, 1, 2}, {0, 1, 2, 3}, true), dims, shards);
  XLAKIT_CHECK_MSG(plan.ok(), plan.status());
  if (!plan.ok()) return;
  XLAKIT_CHECK(plan->size() == 2);
  XLAKIT_CHECK(CoversExactlyOnce(*plan, dims, shards));
  XLAKIT_CHECK((*plan)[0].shard == 1);  // device 1 for tile 0
  XLAKIT_CHECK((*plan)[1].shard == 0);  // device 2 for tile 1
}

void TileOnNoLocalDeviceIsAnError() {
  // Regression: assembly used to start from at::empty and copy only local
  // shards, returning uninitialised memory for tiles owned by another host.
  auto plan = PlanShardAssembly(Tiled({4}, {0, 1, 2, 3}),
                                std::vector<int64_t>{8}, Shards({0, 1}, {2}));
  XLAKIT_CHECK(absl::IsFailedPrecondition(plan.status()));
  std::string message(plan.status().message());
  XLAKIT_CHECK_MSG(message.find("2 of 4 tiles") != std::string::npos, message);
  XLAKIT_CHECK_MSG(
      message.find("elements [4:6] (devices 2)") != std::string::npos, message);
  XLAKIT_CHECK_MSG(message.find("dcp_save") != std::string::npos, message);
}

void RemotePaddingOnlyTileIsNotNeeded() {
  // 5 elements in 4 tiles of 2: the last tile is all padding.
  std::vector<int64_t> dims = {5};
  auto shards = Shards({0, 1, 2}, {2});
  auto plan = PlanShardAssembly(Tiled({4}, {0, 1, 2, 3}), dims, shards);
  XLAKIT_CHECK_MSG(plan.ok(), plan.status());
  if (plan.ok()) XLAKIT_CHECK(CoversExactlyOnce(*plan, dims, shards));
}

void IotaTileAssignmentMatchesExplicitList() {
  xla::OpSharding iota;
  iota.set_type(xla::OpSharding::OTHER);
  for (int64_t t : {2, 2}) iota.add_tile_assignment_dimensions(t);
  for (int64_t r : {2, 2}) iota.add_iota_reshape_dims(r);
  for (int p : {1, 0}) iota.add_iota_transpose_perm(p);
  auto devices = torch_xla::runtime::xlakit::TileAssignmentDevices(iota);
  XLAKIT_CHECK_MSG(devices.ok(), devices.status());
  if (devices.ok()) {
    XLAKIT_CHECK((*devices == std::vector<int64_t>{0, 2, 1, 3}));
  }
  std::vector<int64_t> dims = {4, 4};
  auto shards = Shards({0, 1, 2, 3}, {2, 2});
  auto a = PlanShardAssembly(iota, dims, shards);
  auto b = PlanShardAssembly(Tiled({2, 2}, {0, 2, 1, 3}), dims, shards);
  XLAKIT_CHECK(a.ok() && b.ok());
  if (a.ok() && b.ok()) {
    for (size_t i = 0; i < a->size() && i < b->size(); ++i) {
      XLAKIT_CHECK((*a)[i].shard == (*b)[i].shard);
      XLAKIT_CHECK((*a)[i].start == (*b)[i].start);
    }
  }
}

void LastTileDimsAreValidatedBeforeUse() {
  // Regression: the shard shape was computed from every tile dimension,
  // reading past the tensor's shape when last_tile_dims added some.
  xla::OpSharding s = Tiled({2, 2, 2}, {0, 1, 2, 3, 4, 5, 6, 7});
  s.add_last_tile_dims(xla::OpSharding::REPLICATED);
  auto bad_rank =
      PlanShardAssembly(s, std::vector<int64_t>{4}, Shards({0}, {2}));
  XLAKIT_CHECK(absl::IsInvalidArgument(bad_rank.status()));
  std::vector<int64_t> dims = {4, 4};
  auto shards = Shards({0, 2, 4, 6}, {2, 2});
  auto ok = PlanShardAssembly(s, dims, shards);
  XLAKIT_CHECK_MSG(ok.ok(), ok.status());
  if (ok.ok()) XLAKIT_CHECK(CoversExactlyOnce(*ok, dims, shards));
  xla::OpSharding manual = Tiled({2, 2}, {0, 1, 2, 3});
  manual.add_last_tile_dims(xla::OpSharding::MANUAL);
  auto m = PlanShardAssembly(manual, std::vector<int64_t>{4},
                             Shards({0, 1, 2, 3}, {2}));
  XLAKIT_CHECK(absl::IsUnimplemented(m.status()));
}

void UnknownShardingIsReplicated() {
  xla::OpSharding s;
  s.set_type(xla::OpSharding::UNKNOWN);
  std::vector<int64_t> dims = {3, 2};
  auto shards = Shards({4, 5}, {3, 2});
  auto plan = PlanShardAssembly(s, dims, shards);
  XLAKIT_CHECK_MSG(plan.ok(), plan.status());
  if (plan.ok()) XLAKIT_CHECK(CoversExactlyOnce(*plan, dims, shards));
}

void ShardDimensionsComeFromTheBuffers() {
  // Buffers of 3 in 2 tiles cannot hold 8 elements, whatever a spec says.
  auto plan = PlanShardAssembly(Tiled({2}, {0, 1}), std::vector<int64_t>{8},
                                Shards({0, 1}, {3}));
  XLAKIT_CHECK(absl::IsInvalidArgument(plan.status()));
  auto stranger = PlanShardAssembly(Tiled({2}, {0, 1}), std::vector<int64_t>{4},
                                    Shards({0, 7}, {2}));
  XLAKIT_CHECK(absl::IsInvalidArgument(stranger.status()));
  xla::OpSharding maximal;
  maximal.set_type(xla::OpSharding::MAXIMAL);
  XLAKIT_CHECK(absl::IsUnimplemented(
      PlanShardAssembly(maximal, std::vector<int64_t>{4}, Shards({0}, {4}))
          .status()));
}

void UnknownPeakIsNotSummed() {
  using torch_xla::runtime::xlakit::SumAllocatorStats;
  tsl::AllocatorStats a, b;
  a.bytes_in_use = 10;
  a.peak_bytes_in_use = 40;
  a.bytes_limit = 100;
  b.bytes_in_use = 5;
  b.peak_bytes_in_use = 7;
  b.bytes_limit = 50;
  auto known = SumAllocatorStats({a, b});
  XLAKIT_CHECK(known.bytes_used == 15);
  XLAKIT_CHECK(known.peak_bytes_used == 47);
  XLAKIT_CHECK(known.bytes_limit == 150);
  // Regression: -1 ("not reported" from a PJRT C API plugin) was summed.
  b.peak_bytes_in_use = -1;
  b.bytes_limit.reset();
  auto partial = SumAllocatorStats({a, b});
  XLAKIT_CHECK(partial.bytes_used == 15);
  XLAKIT_CHECK(!partial.peak_bytes_used.has_value());
  XLAKIT_CHECK(!partial.bytes_limit.has_value());
}

void TransientLoadFailuresKeepTheEntry() {
  using torch_xla::runtime::xlakit::FateOfLoadFailure;
  using ::xlakit::EntryFate;
  XLAKIT_CHECK(FateOfLoadFailure(absl::ResourceExhaustedError("HBM")) ==
               EntryFate::kKeep);
  XLAKIT_CHECK(FateOfLoadFailure(absl::UnavailableError("busy")) ==
               EntryFate::kKeep);
  XLAKIT_CHECK(FateOfLoadFailure(absl::InvalidArgumentError("bad")) ==
               EntryFate::kErase);
  XLAKIT_CHECK(FateOfLoadFailure(absl::InternalError("bad")) ==
               EntryFate::kErase);
  // The channel to cache.h: nothing noted means erase (upstream behaviour).
  XLAKIT_CHECK(::xlakit::TakeEntryFate() == EntryFate::kErase);
  ::xlakit::NoteEntryFate(EntryFate::kKeep);
  XLAKIT_CHECK(::xlakit::TakeEntryFate() == EntryFate::kKeep);
  XLAKIT_CHECK(::xlakit::TakeEntryFate() == EntryFate::kErase);
}

void EnvelopeChecksTheTorchXlaRevision() {
  ::xlakit::EntryHeader h;
  h.platform_name = "cpu";
  h.platform_version = "v";
  h.patch_series_id = "s";
  h.torch_xla_revision = "rev-a";
  std::string entry = ::xlakit::EncodeEntry(h, "payload");
  ::xlakit::RuntimeIdentity self{"cpu", "v", "s", "rev-b"};
  XLAKIT_CHECK(::xlakit::VerifyEntry(entry, self).status ==
               ::xlakit::EntryStatus::kTorchXlaRevisionMismatch);
  self.torch_xla_revision = "rev-a";
  XLAKIT_CHECK(::xlakit::VerifyEntry(entry, self).status ==
               ::xlakit::EntryStatus::kOk);
}

// Regression (issue 24): an entry was loaded under any name it was given, and
// read whole (then copied) before its checksum or tag was checked.
void ReadEntryBindsTheKeyAndCapsTheSize(const std::string& dir) {
  ::xlakit::EntryHeader h;
  h.platform_name = "cpu";
  h.cache_key = "key-a";
  const std::string path = dir + "/read_entry";
  XLAKIT_CHECK(::xlakit::WriteFileAtomic(
                   path, ::xlakit::EncodeEntry(h, "payload")).empty());
  auto read = [&](const std::string& expected, uint64_t cap,
                  ::xlakit::EntryPayload* payload) {
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    struct stat st;
    ::fstat(fd, &st);
    ::xlakit::EntryCheck check;
    check.expected_key = &expected;
    check.max_entry_bytes = cap;
    std::string error;
    ::xlakit::DecodeResult r = ::xlakit::ReadEntry(
        fd, static_cast<uint64_t>(st.st_size), check, 3, payload, &error);
    ::close(fd);
    XLAKIT_CHECK_MSG(error.empty(), error);
    return r.status;
  };
  ::xlakit::EntryPayload payload;
  XLAKIT_CHECK(read("key-a", UINT64_MAX, &payload) ==
               ::xlakit::EntryStatus::kOk);
  XLAKIT_CHECK(payload.view() == "payload");
  XLAKIT_CHECK(read("key-b", UINT64_MAX, &payload) ==
               ::xlakit::EntryStatus::kKeyMismatch);
  XLAKIT_CHECK(payload.size == 0 && payload.data == nullptr);
  XLAKIT_CHECK(read("key-a", 10, &payload) == ::xlakit::EntryStatus::kTooLarge);
  XLAKIT_CHECK(payload.size == 0);
}

void TempNamesCarryHostAndRandomBits() {
  std::string a = ::xlakit::TempPathFor("/cache/dir/key1");
  std::string b = ::xlakit::TempPathFor("/cache/dir/key1");
  XLAKIT_CHECK(a != b);
  std::string prefix =
      std::string("/cache/dir/") + ::xlakit::kTempPrefix + "key1.";
  XLAKIT_CHECK_MSG(a.rfind(prefix, 0) == 0, a);
  char host[256] = {};
  ::gethostname(host, sizeof(host) - 1);
  std::string pid = "." + std::to_string(::getpid()) + ".";
  XLAKIT_CHECK_MSG(a.find(std::string(".") + host + pid) != std::string::npos,
                   a);
  std::string tail = a.substr(a.rfind('.') + 1);
  XLAKIT_CHECK_MSG(
      tail.size() == 16 &&
          tail.find_first_not_of("0123456789abcdef") == std::string::npos,
      a);
  // Same pid and counter in two containers: the random part still differs.
  std::set<std::string> tails;
  for (int i = 0; i < 64; ++i) {
    std::string t = ::xlakit::TempPathFor("k");
    tails.insert(t.substr(t.rfind('.') + 1));
  }
  XLAKIT_CHECK(tails.size() == 64);
}

void TempNamesAreReadBackByTheirTarget() {
  std::string path = ::xlakit::TempPathFor("/cache/dir/12345");
  XLAKIT_CHECK_MSG(
      ::xlakit::TempFileTarget(path.substr(path.rfind('/') + 1)) == "12345",
      path);
  XLAKIT_CHECK(::xlakit::TempFileTarget("12345").empty());
  XLAKIT_CHECK(::xlakit::TempFileTarget(std::string(::xlakit::kTempPrefix) +
                                        "12345.4242.0")
                   .empty());
}

// 0600, or 0640 in a folder its group may read and search, whatever the
// umask: an entry is code the jobs run.
void AtomicWriteModesIgnoreTheUmask(const std::string& dir) {
  struct Case {
    mode_t folder, mask, want;
  };
  for (Case c : {Case{0700, 000, 0600}, Case{0750, 077, 0640},
                 Case{0755, 000, 0640}, Case{0740, 022, 0600}}) {
    std::string folder = dir + "/modes-" + std::to_string(c.folder) + "-" +
                         std::to_string(c.mask);
    XLAKIT_CHECK(::mkdir(folder.c_str(), 0700) == 0);
    XLAKIT_CHECK(::chmod(folder.c_str(), c.folder) == 0);
    mode_t old = ::umask(c.mask);
    std::string error = ::xlakit::WriteFileAtomic(folder + "/entry", "x");
    ::umask(old);
    XLAKIT_CHECK_MSG(error.empty(), error);
    struct stat st{};
    XLAKIT_CHECK(::stat((folder + "/entry").c_str(), &st) == 0);
    XLAKIT_CHECK_MSG((st.st_mode & 0777) == c.want,
                     std::oct << c.folder << " umask " << c.mask << ": "
                              << (st.st_mode & 0777));
  }
}

// Sets kCacheKeyEnv for one scope (unset with nullptr), then puts it back.
class KeyEnv {
 public:
  explicit KeyEnv(const char* value) {
    const char* saved = std::getenv(::xlakit::kCacheKeyEnv);
    had_ = saved != nullptr;
    if (had_) saved_ = saved;
    if (value == nullptr) {
      ::unsetenv(::xlakit::kCacheKeyEnv);
    } else {
      ::setenv(::xlakit::kCacheKeyEnv, value, 1);
    }
  }
  ~KeyEnv() {
    if (had_) {
      ::setenv(::xlakit::kCacheKeyEnv, saved_.c_str(), 1);
    } else {
      ::unsetenv(::xlakit::kCacheKeyEnv);
    }
  }

 private:
  bool had_ = false;
  std::string saved_;
};

std::string Hex(const std::string& bytes) {
  std::string hex;
  for (unsigned char c : bytes) {
    hex += "0123456789abcdef"[c >> 4];
    hex += "0123456789abcdef"[c & 15];
  }
  return hex;
}

// The runtime's MAC (core/entry_mac_openssl.h) over the BoringSSL this
// binary links: RFC 4231 test case 6, with the key from the environment.
void EntryMacIsHmacSha256FromTheEnvironment() {
  {
    KeyEnv unset(nullptr);
    XLAKIT_CHECK(::xlakit::NewEntryMacFromEnv() == nullptr);
  }
  {
    KeyEnv empty("");
    XLAKIT_CHECK(::xlakit::NewEntryMacFromEnv() == nullptr);
  }
  KeyEnv rfc(std::string(131, '\xaa').c_str());
  std::unique_ptr<::xlakit::EntryMac> mac = ::xlakit::NewEntryMacFromEnv();
  XLAKIT_CHECK(mac != nullptr && mac->Refusal().empty());
  if (mac != nullptr) {
    mac->Update("Test Using Larger Than Block-Size ");
    mac->Update("Key - Hash Key First");
    std::string hex = Hex(mac->Tag());
    XLAKIT_CHECK_MSG(hex ==
                         "60e431591ee0b67f0d8a26aacbf5b77f"
                         "8e0bc6213728c5140546040f0ee37f54",
                     hex);
  }
}

// Regression: Python refused a key shorter than 32 bytes, the runtime took
// any non-empty one and wrote and loaded entries under it.
void AShortKeyIsRefusedByTheRuntime() {
  XLAKIT_CHECK(::xlakit::CacheKeyProblem(std::string(31, 'k')).find(
                   "holds 31 bytes, expected a secret of at least 32") !=
               std::string::npos);
  XLAKIT_CHECK(::xlakit::CacheKeyProblem(std::string(32, 'k')).empty());
  XLAKIT_CHECK(::xlakit::CacheKeyProblem("").empty());
  KeyEnv jefe("Jefe");
  std::unique_ptr<::xlakit::EntryMac> mac = ::xlakit::NewEntryMacFromEnv();
  XLAKIT_CHECK(mac != nullptr);
  if (mac == nullptr) return;
  XLAKIT_CHECK_MSG(mac->Refusal().find("holds 4 bytes") != std::string::npos,
                   mac->Refusal());
  XLAKIT_CHECK(mac->Refusal().find("Jefe") == std::string::npos);
  ::xlakit::EntryHeader h;
  h.platform_name = "cpu";
  std::string plain = ::xlakit::EncodeEntry(h, "payload");
  // Nothing loads under it, a plain entry included, and nothing is written.
  XLAKIT_CHECK(::xlakit::VerifyCacheEntry(plain, nullptr, mac.get()).status ==
               ::xlakit::EntryStatus::kKeyRefused);
  XLAKIT_CHECK(::xlakit::EncodeAuthenticatedEntry(h, "payload", *mac).empty());
  XLAKIT_CHECK(::xlakit::JobKeyId(std::move(mac)) == "refused");
}

// Regression: keyed and unkeyed jobs (or two keys) computed the same cache
// keys, met each other's entries in a shared folder and erased them.
void TheKeysIdSaltsTheCacheKey() {
  ::xlakit::RuntimeIdentity self{"cpu", "v", "s", ""};
  std::string plain = ::xlakit::CacheKeyMaterial(self);
  XLAKIT_CHECK(::xlakit::CacheKeyMaterial(self, "") == plain);
  XLAKIT_CHECK(::xlakit::JobKeyId(nullptr).empty());
  KeyEnv key("xlakit-cxx-check-test-key-0123456789abcdef");
  std::string id = ::xlakit::JobKeyId(::xlakit::NewEntryMacFromEnv());
  // Python's compile_cache.key_id: hmac(key, "xlakit-cache-key-id")[:16].
  XLAKIT_CHECK_MSG(id == "7878d9d8b80aecd2", id);
  XLAKIT_CHECK(::xlakit::CacheKeyMaterial(self, id) != plain);
  XLAKIT_CHECK(::xlakit::CacheKeyMaterial(self, id) !=
               ::xlakit::CacheKeyMaterial(self, "refused"));
}

// Regression: Get read an entry through an unchecked ifstream (a read error
// looked like a truncated entry, which was erased) and erased refused entries
// with the throwing std::filesystem::remove (an entry the job may not delete
// failed the step). The cache's hooks use these instead, which report.
void EntryFilesAreReadAndRemovedWithoutThrowing(const std::string& dir) {
  std::string data = "stale";
  std::string error = ::xlakit::ReadWholeFile(dir, &data);  // a folder: EISDIR
  XLAKIT_CHECK_MSG(!error.empty() && data.empty(), error);
  std::string file = dir + "/entry-read";
  XLAKIT_CHECK(::xlakit::WriteFileAtomic(file, std::string(100000, 'e')).empty());
  XLAKIT_CHECK(::xlakit::ReadWholeFile(file, &data).empty());
  XLAKIT_CHECK(data == std::string(100000, 'e'));
  std::string link = dir + "/entry-link";
  XLAKIT_CHECK(::symlink(file.c_str(), link.c_str()) == 0);
  XLAKIT_CHECK(!::xlakit::ReadWholeFile(link, &data).empty());  // never followed
  // A "refused entry" the job cannot remove: a non-empty folder at its name.
  std::string stuck = dir + "/entry-stuck";
  XLAKIT_CHECK(::mkdir(stuck.c_str(), 0700) == 0);
  XLAKIT_CHECK(::xlakit::WriteFileAtomic(stuck + "/x", "x").empty());
  error = ::xlakit::RemoveFile(stuck);
  XLAKIT_CHECK_MSG(error.find("cannot remove") != std::string::npos, error);
  XLAKIT_CHECK(::xlakit::RemoveFile(dir + "/no-such-entry").empty());
  XLAKIT_CHECK(::xlakit::RemoveFile(file).empty());
  XLAKIT_CHECK(::access(file.c_str(), F_OK) != 0);
}

// Regression: a tile assignment with a zero, negative or huge dimension sized
// vectors with a negative count (std::length_error) or divided by zero.
void TileDimensionsMustBePositive() {
  for (std::vector<int64_t> tiles :
       {std::vector<int64_t>{0, 2}, std::vector<int64_t>{2, -1},
        std::vector<int64_t>{int64_t{1} << 40, int64_t{1} << 40}}) {
    auto plan = PlanShardAssembly(Tiled(tiles, {0, 1}), std::vector<int64_t>{4, 4},
                                  Shards({0, 1}, {2, 4}));
    XLAKIT_CHECK_MSG(absl::IsInvalidArgument(plan.status()), plan.status());
  }
  xla::OpSharding iota;
  iota.set_type(xla::OpSharding::OTHER);
  for (int64_t t : {2, 2}) iota.add_tile_assignment_dimensions(t);
  for (int64_t r : {4, 0}) iota.add_iota_reshape_dims(r);
  auto devices = torch_xla::runtime::xlakit::TileAssignmentDevices(iota);
  XLAKIT_CHECK_MSG(absl::IsInvalidArgument(devices.status()), devices.status());
  auto negative = PlanShardAssembly(Tiled({2}, {0, 1}), std::vector<int64_t>{-4},
                                    Shards({0, 1}, {2}));
  XLAKIT_CHECK(absl::IsInvalidArgument(negative.status()));
  // Two negative dimensions pass the device count (their product is 2); an
  // empty tensor passes the cover check; then -2 tiles sized a vector.
  auto thrown = PlanShardAssembly(Tiled({-2, -1}, {0, 1}, true),
                                  std::vector<int64_t>{0}, Shards({0, 1}, {0}));
  XLAKIT_CHECK_MSG(absl::IsInvalidArgument(thrown.status()), thrown.status());
}

}  // namespace

int RunUnits(const std::string& dir) {
  TiledTensorWithPaddedEdgeShards();
  PartialReplicaTakesLowestLocalReplica();
  TileOnNoLocalDeviceIsAnError();
  RemotePaddingOnlyTileIsNotNeeded();
  IotaTileAssignmentMatchesExplicitList();
  LastTileDimsAreValidatedBeforeUse();
  UnknownShardingIsReplicated();
  ShardDimensionsComeFromTheBuffers();
  UnknownPeakIsNotSummed();
  TransientLoadFailuresKeepTheEntry();
  EnvelopeChecksTheTorchXlaRevision();
  ReadEntryBindsTheKeyAndCapsTheSize(dir);
  TempNamesCarryHostAndRandomBits();
  TempNamesAreReadBackByTheirTarget();
  AtomicWriteModesIgnoreTheUmask(dir);
  EntryMacIsHmacSha256FromTheEnvironment();
  AShortKeyIsRefusedByTheRuntime();
  TheKeysIdSaltsTheCacheKey();
  EntryFilesAreReadAndRemovedWithoutThrowing(dir);
  TileDimensionsMustBePositive();
  std::cout << "units: " << (Failures() ? "FAILED" : "ok") << " (" << Failures()
            << " failed checks)\n";
  return Failures() ? 1 : 0;
}

}  // namespace xlakit_test
