// Memory per device for every client the wrapper wraps, on any plugin.
//
// Two answers, read through the exported xlakit_pjrt_wrap_memory() as one
// JSON object (python/xlakit/runtime/wrap_memory.py):
//   * the real plugin's PJRT_Device_MemoryStats, every field it sets (its
//     `_is_set` flags honoured), or why it gave none (CPU plugins answer
//     UNIMPLEMENTED);
//   * the wrapper's own accounting of live buffers: bytes and count of the
//     buffers the C API hands out on each device (BufferFromHostBuffer,
//     Execute outputs, CopyToDevice/CopyToMemory, CreateUninitializedBuffer,
//     CreateViewOfDeviceBuffer, CreateAliasBuffer, async host-to-device
//     buffers), less those deleted or destroyed, with the peak since the last
//     reset. A buffer's size is the plugin's PJRT_Buffer_OnDeviceSizeInBytes.
//     A donated input counts until the framework deletes or destroys it.
//     Only buffers in the device's default memory count as the device's: one
//     in another of its memories (pinned_host, unpinned_host; where the
//     plugin names them) counts apart by kind, and a view made with
//     CreateViewOfDeviceBuffer (memory the framework owns) apart as a view.
//
// Devices are learned when a client is created (its addressable devices) and
// forgotten when it is destroyed. The per-device figures are atomics; the
// buffer -> (device, bytes) records sit in sharded maps, so two threads
// rarely meet on one lock. The framework's own PJRT_Device_MemoryStats calls
// pass through, with every out field of the caller's struct zeroed first: a
// caller newer than the plugin (a larger struct) never reads its own garbage
// as a set field.
#ifndef XLAKIT_PJRT_WRAP_MEMORY_ACCOUNTING_H_
#define XLAKIT_PJRT_WRAP_MEMORY_ACCOUNTING_H_

#include <string>

#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {

// Replaces in `table` (the wrapper's copy of `real`'s table, holding the
// wrapper's other replacements already) the functions that create and
// destroy clients, buffers and loaded executables, and
// PJRT_Device_MemoryStats, with ones that account and then call what `table`
// held before. `accounting` false (XLAKIT_PJRT_MEMORY_ACCOUNTING=0) counts no
// buffer: devices and the plugin's statistics are still reported.
void InstallMemoryAccounting(const PJRT_Api* real, PJRT_Api* table,
                             bool accounting);

// Every device of every live client as a JSON object: the accounting, and
// the plugin's statistics when `plugin_stats`. `reset_peaks` then sets each
// device's peak to its live bytes.
std::string MemoryJson(bool plugin_stats, bool reset_peaks);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_MEMORY_ACCOUNTING_H_
