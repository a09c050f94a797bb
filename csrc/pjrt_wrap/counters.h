// What the wrapping plugin did in this process, for `xlakit doctor`, the
// manifest and the tests: read through the exported xlakit_pjrt_wrap_status()
// as one JSON object. Counters only grow; reasons are envelope status names
// (core/envelope.h) or the wrapper's own ("load_failed", "unreadable").
#ifndef XLAKIT_PJRT_WRAP_COUNTERS_H_
#define XLAKIT_PJRT_WRAP_COUNTERS_H_

#include <atomic>
#include <chrono>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>

namespace xlakit {
namespace pjrt_wrap {

struct Counters {
  // Every PJRT_Client_Compile the framework made through the wrapper.
  std::atomic<uint64_t> compiles{0};
  // Served from the cache: the real compile was not called.
  std::atomic<uint64_t> hits{0};
  // Looked up and compiled: no entry, or one refused (see `refused`).
  std::atomic<uint64_t> misses{0};
  // Passed straight to the real compile: the cache is off, or the program's
  // key could not be made.
  std::atomic<uint64_t> bypassed{0};
  std::atomic<uint64_t> writes{0};
  std::atomic<uint64_t> write_failures{0};
  std::atomic<uint64_t> serialize_failures{0};
  // PJRT_ExecuteOptions of an older framework padded to this header's size.
  std::atomic<uint64_t> execute_options_padded{0};
  // Compiles that waited for another thread compiling the same key (single
  // flight), then looked the entry up again.
  std::atomic<uint64_t> flight_waits{0};
  // Entries removed to keep the folder under XLAKIT_PJRT_CACHE_MAX_BYTES.
  std::atomic<uint64_t> evictions{0};
  // Programs not written: they compiled faster than
  // XLAKIT_PJRT_CACHE_MIN_COMPILE_S.
  std::atomic<uint64_t> skipped_fast{0};
  // Microseconds spent in real compiles (misses) and in loading hits.
  std::atomic<uint64_t> compile_us{0};
  std::atomic<uint64_t> load_us{0};

  // Never throws: without memory for the reason, refusals_unrecorded grows.
  void Refused(const std::string& reason) noexcept;
  std::atomic<uint64_t> refusals_unrecorded{0};
  // Failures inside the wrapper (no memory) that a compile survived as a
  // miss or a pass-through, and buffers memory accounting could not record.
  std::atomic<uint64_t> internal_errors{0};
  std::map<std::string, uint64_t> RefusedByReason();

 private:
  std::mutex mu_;
  std::map<std::string, uint64_t> refused_;
};

Counters& GlobalCounters();

// Microseconds from `start` to now, for compile_us and load_us.
inline uint64_t MicrosSince(std::chrono::steady_clock::time_point start) {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::microseconds>(
          std::chrono::steady_clock::now() - start)
          .count());
}

// Writes `message` to stderr once per `kind` per process ("xlakit-pjrt: ...",
// control bytes, format controls such as U+202E and bytes that are not UTF-8
// escaped). Never throws: without memory the line says it was lost.
void LogOnce(const std::string& kind, const std::string& message) noexcept;
void Log(const std::string& message) noexcept;

// `s` as a JSON string literal.
std::string JsonString(const std::string& s);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_COUNTERS_H_
