// Memory per device, counted: the replacements of the C API functions that
// make and free clients, buffers and executables (see memory_accounting.h),
// and their installation. Devices are learned in memory_devices.cc, the
// report written in memory_report.cc.
#include "pjrt_wrap/memory_accounting.h"

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>
#include <type_traits>

#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/memory_state.h"
#include "pjrt_wrap/pjrt_calls.h"

namespace xlakit {
namespace pjrt_wrap {
namespace memory {

State* state = nullptr;

namespace {

void Raise(Tally& t, int64_t bytes) {
  const int64_t now = t.bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  t.buffers.fetch_add(1, std::memory_order_relaxed);
  t.created.fetch_add(1, std::memory_order_relaxed);
  int64_t peak = t.peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !t.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void AccountOrCount(PJRT_Buffer* buffer, bool view);

// A buffer the C API just handed out (`view`: one made with
// CreateViewOfDeviceBuffer, over memory the framework owns); never throws.
void Account(PJRT_Buffer* buffer, bool view = false) noexcept {
  if (buffer == nullptr) return;
  try {
    AccountOrCount(buffer, view);
  } catch (...) {
    ++state->unattributed;  // no memory to record it: it goes uncounted
  }
}

void AccountOrCount(PJRT_Buffer* buffer, bool view) {
  Timed timed;
  const PJRT_Api* api = state->real;
  auto device = Make<PJRT_Buffer_Device_Args>();
  device.buffer = buffer;
  auto size = Make<PJRT_Buffer_OnDeviceSizeInBytes_Args>();
  size.buffer = buffer;
  PJRT_Error* e = api->PJRT_Buffer_Device(&device);
  if (e == nullptr) e = api->PJRT_Buffer_OnDeviceSizeInBytes(&size);
  const int slot = e == nullptr ? FindSlot(device.device) : -1;
  if (slot < 0) {
    if (e != nullptr) Drop(e);
    ++state->unattributed;
    return;
  }
  const int64_t bytes = static_cast<int64_t>(size.on_device_size_in_bytes);
  Slot& s = state->slots[slot];
  const int bucket = view ? kViews : MemoryBucket(buffer, s);
  Tally* tally = TallyOf(s, bucket);
  if (tally == nullptr) {
    ++state->unattributed;  // a memory its device did not list
    return;
  }
  Shard& shard = state->shards[Hash(buffer) % kShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    if (!shard.live.try_emplace(buffer, Record{slot, bytes, false, bucket})
             .second) {
      return;  // counted already (a handle handed out twice)
    }
  }
  Raise(*tally, bytes);
}

// A buffer deleted (`destroy` false: its memory freed, the handle kept) or
// destroyed; a deleted buffer stops counting then, and its destroy only
// forgets it.
void Release(PJRT_Buffer* buffer, bool destroy) {
  Timed timed;
  Shard& shard = state->shards[Hash(buffer) % kShards];
  Record record{-1, 0, true, kDeviceMemory};
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    auto it = shard.live.find(buffer);
    if (it == shard.live.end()) return;
    record = it->second;
    if (destroy) {
      shard.live.erase(it);
    } else {
      it->second.deleted = true;
    }
  }
  if (record.deleted) return;
  Tally* tally = TallyOf(state->slots[record.slot], record.bucket);
  tally->bytes.fetch_sub(record.bytes, std::memory_order_relaxed);
  tally->buffers.fetch_sub(1, std::memory_order_relaxed);
}

// Reads an out field only where the caller's struct holds it.
#define XLAKIT_HOLDS(args, field) \
  ((args)->struct_size >= offsetof(std::remove_reference_t<decltype(*(args))>, field) + sizeof((args)->field))

// The replacements below run after the plugin's own call succeeded: what
// they record may fail (no memory), and then the client or buffer goes
// unaccounted (counted), never the call failed or the process aborted.
PJRT_Error* Client_Create(PJRT_Client_Create_Args* args) {
  PJRT_Error* e = state->inner->PJRT_Client_Create(args);
  if (e == nullptr && XLAKIT_HOLDS(args, client)) {
    try {
      RegisterClient(args->client);
    } catch (...) {
      ++state->unattributed;  // its devices (some, or all) go unlisted
    }
  }
  return e;
}

PJRT_Error* Client_Destroy(PJRT_Client_Destroy_Args* args) {
  {
    std::unique_lock<std::shared_mutex> lock(state->clients_mu);
    const int n = state->slot_count.load(std::memory_order_acquire);
    for (int i = 0; i < n; ++i) {
      if (state->slots[i].client == args->client) {
        state->slots[i].live.store(false, std::memory_order_release);
      }
    }
  }
  return state->inner->PJRT_Client_Destroy(args);
}

PJRT_Error* Device_MemoryStats(PJRT_Device_MemoryStats_Args* args) {
  const size_t first = offsetof(PJRT_Device_MemoryStats_Args, bytes_in_use);
  if (args != nullptr && args->struct_size > first) {
    std::memset(reinterpret_cast<char*>(args) + first, 0, args->struct_size - first);
  }
  return state->inner->PJRT_Device_MemoryStats(args);
}

#define XLAKIT_ACCOUNTED(Name, field)                              \
  PJRT_Error* Name(PJRT_##Name##_Args* args) {                     \
    PJRT_Error* e = state->inner->PJRT_##Name(args);               \
    if (e == nullptr && XLAKIT_HOLDS(args, field)) Account(args->field); \
    return e;                                                      \
  }
XLAKIT_ACCOUNTED(Client_BufferFromHostBuffer, buffer)
XLAKIT_ACCOUNTED(Client_CreateUninitializedBuffer, buffer)
XLAKIT_ACCOUNTED(Client_CreateAliasBuffer, alias_buffer)
XLAKIT_ACCOUNTED(Buffer_CopyToDevice, dst_buffer)
XLAKIT_ACCOUNTED(Buffer_CopyToMemory, dst_buffer)
XLAKIT_ACCOUNTED(AsyncHostToDeviceTransferManager_RetrieveBuffer, buffer_out)
#undef XLAKIT_ACCOUNTED

PJRT_Error* Client_CreateViewOfDeviceBuffer(
    PJRT_Client_CreateViewOfDeviceBuffer_Args* args) {
  PJRT_Error* e = state->inner->PJRT_Client_CreateViewOfDeviceBuffer(args);
  if (e == nullptr && XLAKIT_HOLDS(args, buffer)) Account(args->buffer, true);
  return e;
}

PJRT_Error* Buffer_Delete(PJRT_Buffer_Delete_Args* args) {
  if (args != nullptr) Release(args->buffer, false);
  return state->inner->PJRT_Buffer_Delete(args);
}

PJRT_Error* Buffer_Destroy(PJRT_Buffer_Destroy_Args* args) {
  // Forgotten first: once the plugin frees it, another buffer may get its address.
  if (args != nullptr) Release(args->buffer, true);
  return state->inner->PJRT_Buffer_Destroy(args);
}

// The executable's output count, asked once per loaded executable.
bool NumOutputs(PJRT_LoadedExecutable* loaded, size_t* out) {
  {
    std::lock_guard<std::mutex> lock(state->outputs_mu);
    auto it = state->num_outputs.find(loaded);
    if (it != state->num_outputs.end()) {
      *out = it->second;
      return true;
    }
  }
  const PJRT_Api* api = state->real;
  auto get = Make<PJRT_LoadedExecutable_GetExecutable_Args>();
  get.loaded_executable = loaded;
  if (PJRT_Error* e = api->PJRT_LoadedExecutable_GetExecutable(&get)) {
    Drop(e);
    return false;
  }
  auto n = Make<PJRT_Executable_NumOutputs_Args>();
  n.executable = get.executable;
  PJRT_Error* e = api->PJRT_Executable_NumOutputs(&n);
  auto destroy = Make<PJRT_Executable_Destroy_Args>();
  destroy.executable = get.executable;
  Drop(api->PJRT_Executable_Destroy(&destroy));
  if (e != nullptr) {
    Drop(e);
    return false;
  }
  std::lock_guard<std::mutex> lock(state->outputs_mu);
  state->num_outputs[loaded] = n.num_outputs;
  *out = n.num_outputs;
  return true;
}

PJRT_Error* LoadedExecutable_Execute(PJRT_LoadedExecutable_Execute_Args* args) {
  PJRT_Error* e = state->inner->PJRT_LoadedExecutable_Execute(args);
  if (e != nullptr || args == nullptr || args->output_lists == nullptr) return e;
  size_t outputs = 0;
  bool known = false;
  try {
    Timed timed;
    known = NumOutputs(args->executable, &outputs);
  } catch (...) {  // no memory to remember the count: asked again next time
  }
  if (!known) {
    state->unattributed += args->num_devices;
    return e;
  }
  for (size_t d = 0; d < args->num_devices; ++d) {
    PJRT_Buffer** list = args->output_lists[d];
    if (list == nullptr) continue;
    for (size_t o = 0; o < outputs; ++o) Account(list[o]);
  }
  return e;
}

PJRT_Error* LoadedExecutable_Destroy(PJRT_LoadedExecutable_Destroy_Args* args) {
  if (args != nullptr) {
    std::lock_guard<std::mutex> lock(state->outputs_mu);
    state->num_outputs.erase(args->executable);
  }
  return state->inner->PJRT_LoadedExecutable_Destroy(args);
}

template <typename Fn>
void Replace(PJRT_Api* table, Fn PJRT_Api::*field, size_t offset, Fn fn) {
  if (HasFunction(state->inner, offset, sizeof(Fn))) table->*field = fn;
}

void Install(const PJRT_Api* real, PJRT_Api* table, bool accounting) {
  state = new State();  // lives as long as the process, like the table
  for (int i = 0; i < kIndexSize; ++i) {
    state->index_key[i].store(nullptr, std::memory_order_relaxed);
    state->index_slot[i].store(-1, std::memory_order_relaxed);
  }
  state->real = real;
  state->accounting = accounting;
  state->inner_table.reset(new char[table->struct_size]);
  std::memcpy(state->inner_table.get(), table, table->struct_size);
  state->inner = reinterpret_cast<const PJRT_Api*>(state->inner_table.get());
  // Everything the accounting itself asks of the plugin.
  const bool can_ask =
      XLAKIT_PJRT_HAS(real, PJRT_Client_AddressableDevices) &&
      XLAKIT_PJRT_HAS(real, PJRT_Device_GetDescription) &&
      XLAKIT_PJRT_HAS(real, PJRT_DeviceDescription_Id) &&
      XLAKIT_PJRT_HAS(real, PJRT_DeviceDescription_ProcessIndex) &&
      XLAKIT_PJRT_HAS(real, PJRT_DeviceDescription_Kind) &&
      XLAKIT_PJRT_HAS(real, PJRT_Device_LocalHardwareId) &&
      XLAKIT_PJRT_HAS(real, PJRT_Buffer_Device) &&
      XLAKIT_PJRT_HAS(real, PJRT_Buffer_OnDeviceSizeInBytes) &&
      XLAKIT_PJRT_HAS(real, PJRT_LoadedExecutable_GetExecutable) &&
      XLAKIT_PJRT_HAS(real, PJRT_Executable_NumOutputs) &&
      XLAKIT_PJRT_HAS(real, PJRT_Executable_Destroy);
  if (!can_ask) {
    state->accounting = false;
    Log("memory accounting off: the plugin lacks a function it needs");
    return;
  }
#define XLAKIT_REPLACE(Name)                                           \
  Replace<PJRT_##Name*>(table, &PJRT_Api::PJRT_##Name,                 \
                        offsetof(PJRT_Api, PJRT_##Name), &Name)
  XLAKIT_REPLACE(Client_Create);
  XLAKIT_REPLACE(Client_Destroy);
  XLAKIT_REPLACE(Device_MemoryStats);
  if (!state->accounting) return;
  XLAKIT_REPLACE(Client_BufferFromHostBuffer);
  XLAKIT_REPLACE(Client_CreateUninitializedBuffer);
  XLAKIT_REPLACE(Client_CreateViewOfDeviceBuffer);
  XLAKIT_REPLACE(Client_CreateAliasBuffer);
  XLAKIT_REPLACE(Buffer_CopyToDevice);
  XLAKIT_REPLACE(Buffer_CopyToMemory);
  XLAKIT_REPLACE(AsyncHostToDeviceTransferManager_RetrieveBuffer);
  XLAKIT_REPLACE(Buffer_Delete);
  XLAKIT_REPLACE(Buffer_Destroy);
  XLAKIT_REPLACE(LoadedExecutable_Execute);
  XLAKIT_REPLACE(LoadedExecutable_Destroy);
#undef XLAKIT_REPLACE
}

}  // namespace
}  // namespace memory

void InstallMemoryAccounting(const PJRT_Api* real, PJRT_Api* table,
                             bool accounting) {
  memory::Install(real, table, accounting);
}

}  // namespace pjrt_wrap
}  // namespace xlakit
