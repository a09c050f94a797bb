// xlakit's cache-entry code against a real PJRT CPU client, in two
// processes. `write DIR` compiles a real computation (timed: the cold
// compile), checks its result, and writes it as a cache entry with xlakit's
// atomic writer, plus entries that must be refused: corrupt, truncated, for
// another platform, another patch series, another torch_xla revision, a
// foreign file and an envelope whose payload the client refuses. `load DIR`,
// a fresh process, loads the good entry through LoadExecutableEntry (timed:
// the warm load), executes it with the values checked, and counts every bad
// entry as a miss with the expected reason and fate.
//
// Both processes also run as a job with a key (XLAKIT_CACHE_KEY must be set;
// the MAC is the runtime's, core/entry_mac_openssl.h, over the BoringSSL that
// TensorFlow's framework library carries): process 1 writes a tagged entry,
// one tagged under another key, and a tampered one (its tag, around another
// real executable with the FNV checksum recomputed); process 2, keyed, loads
// the tagged entry and executes it, and refuses the tampered entry (bad_tag),
// which it would load and run without a key, the other key's (bad_tag) and
// the plain entry (unauthenticated).
#include <chrono>
#include <cstdint>
#include <fstream>
#include <iostream>
#include <iterator>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <vector>

#include "check.h"
#include "xla/hlo/builder/xla_builder.h"
#include "xla/literal.h"
#include "xla/literal_util.h"
#include "xla/pjrt/pjrt_client.h"
#include "xla/pjrt/pjrt_executable.h"
#include "xla/pjrt/plugin/xla_cpu/xla_cpu_pjrt_client.h"
#include "xla/shape_util.h"

#include "torch_xla/csrc/runtime/xlakit/cache_entry.h"
#include "torch_xla/csrc/runtime/xlakit/core/atomic_file.h"
#include "torch_xla/csrc/runtime/xlakit/core/entry_mac_openssl.h"
#include "torch_xla/csrc/runtime/xlakit/core/envelope.h"

namespace xlakit_test {
namespace {

using torch_xla::runtime::xlakit::EncodeExecutableEntry;
using torch_xla::runtime::xlakit::IdentityOf;
using torch_xla::runtime::xlakit::LoadedEntry;
using torch_xla::runtime::xlakit::LoadExecutableEntry;

constexpr int64_t kN = 32;
constexpr int kLayers = 12;
// The executable a tampered entry carries instead: real, and different.
constexpr int kOtherLayers = 1;
constexpr char kSeries[] = "xlakit-test:series-a";
constexpr char kRevision[] = "0123456789abcdef0123456789abcdef01234567";

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

int32_t MatrixValue(int64_t i, int64_t j) {
  return static_cast<int32_t>((i * 7 + j * 3) % 5) - 2;
}

// y = x; `layers` times: y = (y . M + y) rem 1009, in s32. Exact, so the
// host computes the same numbers.
absl::StatusOr<xla::XlaComputation> BuildComputation(int layers) {
  xla::XlaBuilder b("xlakit_cache_test");
  xla::XlaOp x =
      xla::Parameter(&b, 0, xla::ShapeUtil::MakeShape(xla::S32, {kN, kN}), "x");
  xla::Array2D<int32_t> m(kN, kN);
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t j = 0; j < kN; ++j) m(i, j) = MatrixValue(i, j);
  }
  xla::XlaOp mat = xla::ConstantR2FromArray2D<int32_t>(&b, m);
  xla::XlaOp y = x;
  for (int l = 0; l < layers; ++l) {
    y = xla::Rem(xla::Add(xla::Dot(y, mat), y),
                 xla::ConstantR0<int32_t>(&b, 1009));
  }
  return b.Build(y);
}

std::vector<int32_t> Input() {
  std::vector<int32_t> x(kN * kN);
  for (int64_t k = 0; k < kN * kN; ++k) x[k] = static_cast<int32_t>(k % 11);
  return x;
}

std::vector<int32_t> Expected(int layers) {
  std::vector<int32_t> x = Input();
  std::vector<int64_t> y(x.begin(), x.end());
  for (int l = 0; l < layers; ++l) {
    std::vector<int64_t> next(kN * kN);
    for (int64_t i = 0; i < kN; ++i) {
      for (int64_t j = 0; j < kN; ++j) {
        int64_t dot = 0;
        for (int64_t k = 0; k < kN; ++k)
          dot += y[i * kN + k] * MatrixValue(k, j);
        next[i * kN + j] = (dot + y[i * kN + j]) % 1009;  // C++ rem, as XLA
      }
    }
    y = next;
  }
  return std::vector<int32_t>(y.begin(), y.end());
}

bool RunAndCheck(xla::PjRtClient& client, xla::PjRtLoadedExecutable& exe,
                 const char* what, int layers = kLayers) {
  xla::Literal input = xla::LiteralUtil::CreateR2FromArray2D<int32_t>([] {
    xla::Array2D<int32_t> a(kN, kN);
    std::vector<int32_t> x = Input();
    for (int64_t i = 0; i < kN; ++i) {
      for (int64_t j = 0; j < kN; ++j) a(i, j) = x[i * kN + j];
    }
    return a;
  }());
  xla::PjRtDevice* device = client.addressable_devices()[0];
  auto memory = device->default_memory_space();
  if (!memory.ok()) {
    std::cerr << what << ": no memory space: " << memory.status() << "\n";
    return false;
  }
  auto buffer = client.BufferFromHostLiteral(input, *memory);
  if (!buffer.ok()) {
    std::cerr << what << ": " << buffer.status() << "\n";
    return false;
  }
  std::vector<std::vector<xla::PjRtBuffer*>> args = {{buffer->get()}};
  auto out = exe.Execute(args, xla::ExecuteOptions());
  if (!out.ok()) {
    std::cerr << what << ": execute: " << out.status() << "\n";
    return false;
  }
  auto literal = (*out)[0][0]->ToLiteralSync();
  if (!literal.ok()) {
    std::cerr << what << ": to literal: " << literal.status() << "\n";
    return false;
  }
  std::vector<int32_t> got((*literal)->data<int32_t>().begin(),
                           (*literal)->data<int32_t>().end());
  bool same = got == Expected(layers);
  std::cout << what << ": executed, " << got.size() << " values "
            << (same ? "match" : "DIFFER from") << " the host computation ("
            << layers << " layers)\n";
  return same;
}

absl::StatusOr<std::unique_ptr<xla::PjRtClient>> CpuClient() {
  xla::CpuClientOptions options;
  options.cpu_device_count = 1;
  return xla::GetXlaPjrtCpuClient(std::move(options));
}

bool Write(const std::string& dir, const std::string& name,
           const std::string& data) {
  std::string error = ::xlakit::WriteFileAtomic(dir + "/" + name, data);
  if (!error.empty()) std::cerr << error << "\n";
  return error.empty();
}

std::string Read(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), {});
}

// The job's MAC, as the runtime makes it: from XLAKIT_CACHE_KEY.
std::unique_ptr<::xlakit::EntryMac> JobMac() {
  std::unique_ptr<::xlakit::EntryMac> mac = ::xlakit::NewEntryMacFromEnv();
  XLAKIT_CHECK_MSG(mac != nullptr,
                   "run with " << ::xlakit::kCacheKeyEnv << " set");
  return mac;
}

// The tagged entries of a job with a key, and a forgery built from them.
bool WriteKeyedEntries(const std::string& dir, xla::PjRtClient& client,
                       xla::PjRtLoadedExecutable& exe,
                       const ::xlakit::RuntimeIdentity& self) {
  std::unique_ptr<::xlakit::EntryMac> mac = JobMac();
  if (mac == nullptr) return false;
  auto tagged = EncodeExecutableEntry(exe, self, mac.get());
  XLAKIT_CHECK_MSG(tagged.ok(), tagged.status());
  if (!tagged.ok()) return false;
  XLAKIT_CHECK(tagged->compare(0, 4, ::xlakit::kAuthMagic, 4) == 0);
  XLAKIT_CHECK(Write(dir, "tagged", *tagged));
  ::xlakit::OpenSslEntryMac another("another job's key");
  XLAKIT_CHECK(Write(dir, "other_key",
                     EncodeExecutableEntry(exe, self, &another).value()));
  // Tampered: the tag stays, the plain entry inside becomes another real
  // executable with its checksum recomputed, as anyone who can write the
  // folder could do.
  auto computation = BuildComputation(kOtherLayers);
  if (!computation.ok()) return false;
  auto other = client.CompileAndLoad(*computation, xla::CompileOptions());
  XLAKIT_CHECK_MSG(other.ok(), other.status());
  if (!other.ok()) return false;
  auto inner = EncodeExecutableEntry(**other, self, nullptr);
  if (!inner.ok()) return false;
  XLAKIT_CHECK(Write(dir, "tampered",
                     tagged->substr(0, ::xlakit::kAuthPrefixBytes) + *inner));
  ::xlakit::RefusedEntryMac refused(::xlakit::CacheKeyProblem("short"));
  auto none = EncodeExecutableEntry(exe, self, &refused);
  XLAKIT_CHECK_MSG(absl::IsFailedPrecondition(none.status()), none.status());
  std::cout << "process 1: with " << ::xlakit::kCacheKeyEnv << ": tagged entry "
            << tagged->size() << " bytes, tampered and other-key entries\n";
  return true;
}

int WriteEntries(const std::string& dir) {
  auto client = CpuClient();
  if (!client.ok()) {
    std::cerr << "no CPU client: " << client.status() << "\n";
    return 1;
  }
  auto computation = BuildComputation(kLayers);
  XLAKIT_CHECK_MSG(computation.ok(), computation.status());
  if (!computation.ok()) return 1;
  auto start = std::chrono::steady_clock::now();
  auto exe = (*client)->CompileAndLoad(*computation, xla::CompileOptions());
  double compile_s = Seconds(start);
  XLAKIT_CHECK_MSG(exe.ok(), exe.status());
  if (!exe.ok()) return 1;
  XLAKIT_CHECK(RunAndCheck(**client, **exe, "process 1 (compiled)"));

  ::xlakit::RuntimeIdentity self = IdentityOf(**client, kSeries, kRevision);
  // A job without a key: plain entries.
  auto entry = EncodeExecutableEntry(**exe, self, nullptr);
  XLAKIT_CHECK_MSG(entry.ok(), entry.status());
  if (!entry.ok()) return 1;
  XLAKIT_CHECK(Write(dir, "good", *entry));

  std::string corrupt = *entry;
  corrupt[corrupt.size() / 2] ^= 0x10;
  XLAKIT_CHECK(Write(dir, "corrupt", corrupt));
  XLAKIT_CHECK(Write(dir, "truncated", entry->substr(0, entry->size() - 100)));
  auto other = [&](::xlakit::RuntimeIdentity id) {
    return EncodeExecutableEntry(**exe, id, nullptr).value();
  };
  ::xlakit::RuntimeIdentity tpu = self;
  tpu.platform_name = "tpu";
  XLAKIT_CHECK(Write(dir, "other_platform", other(tpu)));
  ::xlakit::RuntimeIdentity series = self;
  series.patch_series_id = "xlakit-test:series-b";
  XLAKIT_CHECK(Write(dir, "other_series", other(series)));
  ::xlakit::RuntimeIdentity revision = self;
  revision.torch_xla_revision = "fedcba9876543210fedcba9876543210fedcba98";
  XLAKIT_CHECK(Write(dir, "other_revision", other(revision)));
  // What a stock torch_xla writes: the bare serialized executable.
  XLAKIT_CHECK(Write(dir, "foreign", (*exe)->SerializeExecutable().value()));
  // A sound envelope around bytes the client cannot load.
  ::xlakit::EntryHeader h;
  h.platform_name = self.platform_name;
  h.platform_version = self.platform_version;
  h.patch_series_id = self.patch_series_id;
  h.torch_xla_revision = self.torch_xla_revision;
  XLAKIT_CHECK(Write(dir, "refused_payload",
                     ::xlakit::EncodeEntry(h, "not an executable")));
  std::cout << "process 1: platform " << self.platform_name << " '"
            << self.platform_version << "', cold compile " << compile_s
            << " s, entry " << entry->size() << " bytes\n";
  std::ofstream(dir + "/compile_seconds") << compile_s << "\n";
  XLAKIT_CHECK(WriteKeyedEntries(dir, **client, **exe, self));
  return Failures() ? 1 : 0;
}

// Each entry in `refusals` (file name -> reason) must be a miss with that
// reason, erased. A job with a key (`keyed`) makes one MAC per lookup, as the
// runtime does. Returns the number of misses.
int ExpectMisses(xla::PjRtClient& client, const std::string& dir,
                 const ::xlakit::RuntimeIdentity& self, bool keyed,
                 const std::map<std::string, std::string>& refusals) {
  int misses = 0;
  for (const auto& [name, reason] : refusals) {
    std::unique_ptr<::xlakit::EntryMac> mac = keyed ? JobMac() : nullptr;
    LoadedEntry r =
        LoadExecutableEntry(client, Read(dir + "/" + name), self, mac.get());
    bool miss = r.executable == nullptr;
    misses += miss;
    XLAKIT_CHECK_MSG(miss && r.reason == reason,
                     name << ": got '" << r.reason << "' " << r.detail);
    XLAKIT_CHECK_MSG(r.fate == ::xlakit::EntryFate::kErase,
                     name << ": fate " << ::xlakit::EntryFateName(r.fate));
    std::cout << "process 2: " << (keyed ? "keyed, " : "") << name
              << " -> miss (" << r.reason << ", "
              << ::xlakit::EntryFateName(r.fate) << ")\n";
  }
  return misses;
}

// Process 2 as a job with a key: only entries tagged under it load.
void LoadKeyedEntries(const std::string& dir, xla::PjRtClient& client,
                      const ::xlakit::RuntimeIdentity& self, double compile_s) {
  std::string tagged = Read(dir + "/tagged");
  std::unique_ptr<::xlakit::EntryMac> mac = JobMac();
  if (mac == nullptr) return;
  auto start = std::chrono::steady_clock::now();
  LoadedEntry loaded = LoadExecutableEntry(client, tagged, self, mac.get());
  double load_s = Seconds(start);
  XLAKIT_CHECK_MSG(loaded.executable != nullptr,
                   loaded.reason << ": " << loaded.detail);
  if (loaded.executable == nullptr) return;
  XLAKIT_CHECK(
      RunAndCheck(client, *loaded.executable, "process 2 (keyed, loaded)"));
  std::cout << "process 2: keyed warm load (tag checked) " << load_s
            << " s vs cold compile " << compile_s << " s\n";

  // The forgery is a sound entry around a real executable: without a key
  // it loads and runs the other computation, so only the tag stops it.
  std::string tampered = Read(dir + "/tampered");
  LoadedEntry unkeyed = LoadExecutableEntry(client, tampered, self, nullptr);
  XLAKIT_CHECK_MSG(unkeyed.executable != nullptr,
                   unkeyed.reason << ": " << unkeyed.detail);
  if (unkeyed.executable != nullptr) {
    XLAKIT_CHECK(RunAndCheck(client, *unkeyed.executable,
                             "process 2 (no key, tampered entry loaded)",
                             kOtherLayers));
  }
  const std::map<std::string, std::string> refusals = {
      {"tampered", "bad_tag"},
      {"other_key", "bad_tag"},
      {"good", "unauthenticated"},
  };
  int misses = ExpectMisses(client, dir, self, /*keyed=*/true, refusals);
  std::cout << "process 2: keyed, " << misses << " of " << refusals.size()
            << " entries without a valid tag counted as misses\n";

  // A job whose key is too short loads nothing (its own tagged entry neither)
  // and keeps every entry for the jobs that can use it; it writes none.
  ::xlakit::RefusedEntryMac refused(::xlakit::CacheKeyProblem("short"));
  for (const char* name : {"good", "tagged"}) {
    LoadedEntry r = LoadExecutableEntry(client, Read(dir + "/" + name), self,
                                        &refused);
    XLAKIT_CHECK_MSG(r.executable == nullptr && r.reason == "key_refused" &&
                         r.fate == ::xlakit::EntryFate::kKeep,
                     name << ": " << r.reason << " " << r.detail);
  }
  std::cout << "process 2: a refused key loads nothing and keeps every entry\n";
}

int LoadEntries(const std::string& dir) {
  auto client = CpuClient();
  if (!client.ok()) {
    std::cerr << "no CPU client: " << client.status() << "\n";
    return 1;
  }
  ::xlakit::RuntimeIdentity self = IdentityOf(**client, kSeries, kRevision);
  std::string good = Read(dir + "/good");
  auto start = std::chrono::steady_clock::now();
  LoadedEntry loaded = LoadExecutableEntry(**client, good, self, nullptr);
  double load_s = Seconds(start);
  XLAKIT_CHECK_MSG(loaded.executable != nullptr,
                   loaded.reason << ": " << loaded.detail);
  if (loaded.executable == nullptr) return 1;
  XLAKIT_CHECK(loaded.module.computations_size() > 0);
  XLAKIT_CHECK(RunAndCheck(**client, *loaded.executable, "process 2 (loaded)"));

  const std::map<std::string, std::string> refusals = {
      {"corrupt", "checksum_mismatch"},
      {"truncated", "truncated"},
      {"other_platform", "platform_mismatch"},
      {"other_series", "patch_series_mismatch"},
      {"other_revision", "torch_xla_revision_mismatch"},
      {"foreign", "bad_magic"},
      {"refused_payload", "load_failed"},
  };
  int misses = ExpectMisses(**client, dir, self, /*keyed=*/false, refusals);
  double compile_s = 0;
  std::ifstream(dir + "/compile_seconds") >> compile_s;
  std::cout << "process 2: " << misses << " of " << refusals.size()
            << " bad entries counted as misses; warm load " << load_s
            << " s vs cold compile " << compile_s << " s ("
            << (load_s > 0 ? compile_s / load_s : 0) << "x)\n";
  LoadKeyedEntries(dir, **client, self, compile_s);
  return Failures() ? 1 : 0;
}

}  // namespace

int RunPjrtCache(const std::string& mode, const std::string& dir) {
  return mode == "write" ? WriteEntries(dir) : LoadEntries(dir);
}

}  // namespace xlakit_test
