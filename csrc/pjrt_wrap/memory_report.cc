// Memory accounting's report (memory_accounting.h MemoryJson): every live
// device's tallies, and the plugin's own PJRT_Device_MemoryStats where it
// keeps them, as one JSON object.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/memory_accounting.h"
#include "pjrt_wrap/memory_state.h"
#include "pjrt_wrap/pjrt_calls.h"

namespace xlakit {
namespace pjrt_wrap {
namespace memory {
namespace {

void AppendStat(std::string* out, const char* name, int64_t value) {
  *out += std::string(out->back() == '{' ? "" : ", ") + "\"" + name + "\": " +
          std::to_string(value);
}

// The plugin's statistics of one device as JSON fields, or why there are none.
std::string PluginStats(PJRT_Device* device) {
  const PJRT_Api* api = state->real;
  if (!XLAKIT_PJRT_HAS(api, PJRT_Device_MemoryStats)) {
    return "\"plugin\": null, \"plugin_unavailable\": " +
           JsonString("the plugin has no PJRT_Device_MemoryStats");
  }
  auto args = Make<PJRT_Device_MemoryStats_Args>();
  args.device = device;
  if (PJRT_Error* e = api->PJRT_Device_MemoryStats(&args)) {
    return "\"plugin\": null, \"plugin_unavailable\": " +
           JsonString("PJRT_Device_MemoryStats: " + TakeError(api, e));
  }
  std::string out = "{";
  AppendStat(&out, "bytes_in_use", args.bytes_in_use);
#define XLAKIT_STAT(f) \
  if (args.f##_is_set) AppendStat(&out, #f, args.f);
  XLAKIT_STAT(peak_bytes_in_use)
  XLAKIT_STAT(num_allocs)
  XLAKIT_STAT(largest_alloc_size)
  XLAKIT_STAT(bytes_limit)
  XLAKIT_STAT(bytes_reserved)
  XLAKIT_STAT(peak_bytes_reserved)
  XLAKIT_STAT(bytes_reservable_limit)
  XLAKIT_STAT(largest_free_block_bytes)
  XLAKIT_STAT(pool_bytes)
  XLAKIT_STAT(peak_pool_bytes)
#undef XLAKIT_STAT
  return "\"plugin\": " + out + "}, \"plugin_unavailable\": null";
}

// A tally's fields; `reset_peak` then sets its peak to its live bytes.
std::string TallyJson(Tally& t, bool reset_peak) {
  const int64_t bytes = t.bytes.load(std::memory_order_relaxed);
  std::string out = "\"live_bytes\": " + std::to_string(bytes) +
                    ", \"live_buffers\": " + std::to_string(t.buffers.load()) +
                    ", \"peak_bytes\": " + std::to_string(t.peak.load()) +
                    ", \"created_buffers\": " + std::to_string(t.created.load());
  if (reset_peak) t.peak.store(bytes, std::memory_order_relaxed);
  return out;
}

}  // namespace
}  // namespace memory

std::string MemoryJson(bool plugin_stats, bool reset_peaks) {
  using memory::PluginStats;
  using memory::Slot;
  using memory::state;
  using memory::TallyJson;
  std::string out = "{\"installed\": ";
  if (state == nullptr) return out + "false, \"devices\": []}";
  out += std::string("true, \"accounting\": ") +
         (state->accounting ? "true" : "false") +
         ", \"unattributed_buffers\": " + std::to_string(state->unattributed) +
         ", \"devices_over_limit\": " + std::to_string(state->slots_full) +
         ", \"accounting_s\": " + std::to_string(state->accounting_ns / 1e9) +
         ", \"devices\": [";
  std::shared_lock<std::shared_mutex> lock(state->clients_mu);
  const int n = state->slot_count.load(std::memory_order_acquire);
  bool first = true;
  for (int i = 0; i < n; ++i) {
    Slot& s = state->slots[i];
    if (!s.live.load(std::memory_order_acquire)) continue;
    out += std::string(first ? "" : ", ") + "{\"platform\": " +
           JsonString(s.platform) + ", \"client\": " +
           std::to_string(s.client_index) + ", \"id\": " + std::to_string(s.id) +
           ", \"process\": " + std::to_string(s.process) +
           ", \"local_hardware_id\": " + std::to_string(s.local_hardware_id) +
           ", \"kind\": " + JsonString(s.kind) + ", " +
           TallyJson(s.device_memory, reset_peaks);
    // Counted apart: the device's other memories (host memory), by kind, and
    // views of memory the framework owns.
    out += ", \"other_memories\": {";
    for (int m = 0; m < s.num_memories; ++m) {
      out += std::string(m ? ", " : "") + JsonString(s.memory_kinds[m]) +
             ": {" + TallyJson(s.other_memory[m], reset_peaks) + "}";
    }
    out += "}, \"views\": {" + TallyJson(s.views, reset_peaks) + "}";
    if (plugin_stats) out += ", " + PluginStats(s.device);
    out += "}";
    first = false;
  }
  return out + "]}";
}

}  // namespace pjrt_wrap
}  // namespace xlakit
