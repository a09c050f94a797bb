// xlakit's cache-entry code against a real PJRT CPU client, in two
// processes. `write DIR` compiles a real computation (timed: the cold
// compile), checks its result, and writes it as a cache entry with xlakit's
// atomic writer, plus entries that must be refused: corrupt, truncated, for
// another platform, another patch series, another torch_xla revision, a
// foreign file and an envelope whose payload the client refuses. `load DIR`,
// a fresh process, loads the good entry through LoadExecutableEntry (timed:
// the warm load), executes it with the values checked, and counts every bad
// entry as a miss with the expected reason and fate.
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

namespace xlakit_test {
namespace {

using torch_xla::runtime::xlakit::EncodeExecutableEntry;
using torch_xla::runtime::xlakit::IdentityOf;
using torch_xla::runtime::xlakit::LoadedEntry;
using torch_xla::runtime::xlakit::LoadExecutableEntry;

constexpr int64_t kN = 32;
constexpr int kLayers = 12;
constexpr char kSeries[] = "xlakit-test:series-a";
constexpr char kRevision[] = "0123456789abcdef0123456789abcdef01234567";

double Seconds(std::chrono::steady_clock::time_point since) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - since)
      .count();
}

int32_t MatrixValue(int64_t i, int64_t j) {
  return static_cast<int32_t>((i * 7 + j * 3) % 5) - 2;
}

// y = x; kLayers times: y = (y . M + y) rem 1009, in s32. Exact, so the
// host computes the same numbers.
absl::StatusOr<xla::XlaComputation> BuildComputation() {
  xla::XlaBuilder b("xlakit_cache_test");
  xla::XlaOp x =
      xla::Parameter(&b, 0, xla::ShapeUtil::MakeShape(xla::S32, {kN, kN}), "x");
  xla::Array2D<int32_t> m(kN, kN);
  for (int64_t i = 0; i < kN; ++i) {
    for (int64_t j = 0; j < kN; ++j) m(i, j) = MatrixValue(i, j);
  }
  xla::XlaOp mat = xla::ConstantR2FromArray2D<int32_t>(&b, m);
  xla::XlaOp y = x;
  for (int l = 0; l < kLayers; ++l) {
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

std::vector<int32_t> Expected() {
  std::vector<int32_t> x = Input();
  std::vector<int64_t> y(x.begin(), x.end());
  for (int l = 0; l < kLayers; ++l) {
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
                 const char* what) {
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
  bool same = got == Expected();
  std::cout << what << ": executed, " << got.size() << " values "
            << (same ? "match" : "DIFFER from") << " the host computation\n";
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

int WriteEntries(const std::string& dir) {
  auto client = CpuClient();
  if (!client.ok()) {
    std::cerr << "no CPU client: " << client.status() << "\n";
    return 1;
  }
  auto computation = BuildComputation();
  XLAKIT_CHECK_MSG(computation.ok(), computation.status());
  if (!computation.ok()) return 1;
  auto start = std::chrono::steady_clock::now();
  auto exe = (*client)->CompileAndLoad(*computation, xla::CompileOptions());
  double compile_s = Seconds(start);
  XLAKIT_CHECK_MSG(exe.ok(), exe.status());
  if (!exe.ok()) return 1;
  XLAKIT_CHECK(RunAndCheck(**client, **exe, "process 1 (compiled)"));

  ::xlakit::RuntimeIdentity self = IdentityOf(**client, kSeries, kRevision);
  auto entry = EncodeExecutableEntry(**exe, self);
  XLAKIT_CHECK_MSG(entry.ok(), entry.status());
  if (!entry.ok()) return 1;
  XLAKIT_CHECK(Write(dir, "good", *entry));

  std::string corrupt = *entry;
  corrupt[corrupt.size() / 2] ^= 0x10;
  XLAKIT_CHECK(Write(dir, "corrupt", corrupt));
  XLAKIT_CHECK(Write(dir, "truncated", entry->substr(0, entry->size() - 100)));
  auto other = [&](::xlakit::RuntimeIdentity id) {
    return EncodeExecutableEntry(**exe, id).value();
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
  return Failures() ? 1 : 0;
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
  LoadedEntry loaded = LoadExecutableEntry(**client, good, self);
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
  int misses = 0;
  for (const auto& [name, reason] : refusals) {
    LoadedEntry r = LoadExecutableEntry(**client, Read(dir + "/" + name), self);
    bool miss = r.executable == nullptr;
    misses += miss;
    XLAKIT_CHECK_MSG(miss && r.reason == reason,
                     name << ": got '" << r.reason << "' " << r.detail);
    XLAKIT_CHECK_MSG(r.fate == ::xlakit::EntryFate::kErase,
                     name << ": fate " << ::xlakit::EntryFateName(r.fate));
    std::cout << "process 2: " << name << " -> miss (" << r.reason << ", "
              << ::xlakit::EntryFateName(r.fate) << ")\n";
  }
  double compile_s = 0;
  std::ifstream(dir + "/compile_seconds") >> compile_s;
  std::cout << "process 2: " << misses << " of " << refusals.size()
            << " bad entries counted as misses; warm load " << load_s
            << " s vs cold compile " << compile_s << " s ("
            << (load_s > 0 ? compile_s / load_s : 0) << "x)\n";
  return Failures() ? 1 : 0;
}

}  // namespace

int RunPjrtCache(const std::string& mode, const std::string& dir) {
  return mode == "write" ? WriteEntries(dir) : LoadEntries(dir);
}

}  // namespace xlakit_test
