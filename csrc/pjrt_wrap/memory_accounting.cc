// Memory per device; see memory_accounting.h.
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
#include "pjrt_wrap/pjrt_calls.h"

namespace xlakit {
namespace pjrt_wrap {
namespace {

// std::map, not unordered_map: its bucket arrays would need a libstdc++
// newer than a TPU VM's (tests/runtime/test_pjrt_wrap.py checks the symbols).
// Slots are never reused or freed: a slot's description is written before it
// is published (slot_count, release) and never changes, so readers need no
// lock. A pod host has at most a few dozen devices per client.
constexpr int kMaxSlots = 4096;
constexpr int kIndexSize = 2 * kMaxSlots;  // open addressing, power of two
constexpr int kShards = 64;

struct Slot {
  PJRT_Device* device = nullptr;
  PJRT_Client* client = nullptr;
  int client_index = 0;
  int64_t id = 0;
  int process = 0;
  int local_hardware_id = -1;
  std::string kind;
  std::string platform;
  std::atomic<bool> live{false};  // false once its client is destroyed
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> buffers{0};
  std::atomic<int64_t> peak{0};
  std::atomic<uint64_t> created{0};
};

struct Record {
  int slot;
  int64_t bytes;
  bool deleted;  // its memory freed; the handle lives until destroyed
};

struct Shard {
  std::mutex mu;
  std::map<PJRT_Buffer*, Record> live;
};

struct State {
  const PJRT_Api* real = nullptr;
  std::unique_ptr<char[]> inner_table;  // what the table held before
  const PJRT_Api* inner = nullptr;
  bool accounting = true;
  Slot slots[kMaxSlots];
  std::atomic<int> slot_count{0};
  std::atomic<PJRT_Device*> index_key[kIndexSize];
  std::atomic<int> index_slot[kIndexSize];
  std::mutex register_mu;
  int clients = 0;
  // Held shared while the plugin is asked for statistics, exclusive while a
  // client is destroyed: no device is asked after its client is gone.
  std::shared_mutex clients_mu;
  Shard shards[kShards];
  std::mutex outputs_mu;
  std::map<PJRT_LoadedExecutable*, size_t> num_outputs;
  std::atomic<uint64_t> unattributed{0};  // buffers whose device or size the plugin would not say
  std::atomic<uint64_t> slots_full{0};
  // Time spent accounting (not in the plugin): what the accounting costs a
  // step, measured where it is spent rather than against a noisy step time.
  std::atomic<uint64_t> accounting_ns{0};
};

State* state = nullptr;

// Adds the time from its construction to its end to accounting_ns.
class Timed {
 public:
  Timed() : start_(Now()) {}
  ~Timed() {
    state->accounting_ns.fetch_add(Now() - start_, std::memory_order_relaxed);
  }

 private:
  static uint64_t Now() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(
               std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }
  uint64_t start_;
};

size_t Hash(const void* p) {
  uint64_t x = reinterpret_cast<uintptr_t>(p);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<size_t>(x);
}

int FindSlot(PJRT_Device* device) {
  size_t i = Hash(device) & (kIndexSize - 1);
  for (int probe = 0; probe < kIndexSize; ++probe) {
    PJRT_Device* key = state->index_key[i].load(std::memory_order_acquire);
    if (key == nullptr) return -1;
    if (key == device) return state->index_slot[i].load(std::memory_order_acquire);
    i = (i + 1) & (kIndexSize - 1);
  }
  return -1;
}

// Under register_mu. A device pointer a destroyed client left behind and a
// new client reused points at the new slot.
void IndexSlot(PJRT_Device* device, int slot) {
  size_t i = Hash(device) & (kIndexSize - 1);
  for (int probe = 0; probe < kIndexSize; ++probe) {
    PJRT_Device* key = state->index_key[i].load(std::memory_order_relaxed);
    if (key == nullptr || key == device) {
      state->index_slot[i].store(slot, std::memory_order_release);
      state->index_key[i].store(device, std::memory_order_release);
      return;
    }
    i = (i + 1) & (kIndexSize - 1);
  }
}

template <typename Args>
Args Make() {
  Args args{};
  args.struct_size = sizeof(Args);
  return args;
}

void Drop(PJRT_Error* error) { TakeError(state->real, error); }

void RegisterClient(PJRT_Client* client) {
  const PJRT_Api* api = state->real;
  if (!XLAKIT_PJRT_HAS(api, PJRT_Client_AddressableDevices)) return;
  auto devices = Make<PJRT_Client_AddressableDevices_Args>();
  devices.client = client;
  if (PJRT_Error* e = api->PJRT_Client_AddressableDevices(&devices)) {
    LogOnce("memory-devices", "memory accounting: the plugin would not list "
                              "its devices: " + TakeError(api, e));
    return;
  }
  std::string platform, ignored;
  PlatformName(api, client, &platform, &ignored);
  std::lock_guard<std::mutex> lock(state->register_mu);
  const int client_index = state->clients++;
  for (size_t d = 0; d < devices.num_addressable_devices; ++d) {
    PJRT_Device* device = devices.addressable_devices[d];
    const int n = state->slot_count.load(std::memory_order_relaxed);
    if (n >= kMaxSlots) {
      ++state->slots_full;
      continue;
    }
    Slot& s = state->slots[n];
    s.device = device;
    s.client = client;
    s.client_index = client_index;
    s.platform = platform;
    auto desc = Make<PJRT_Device_GetDescription_Args>();
    desc.device = device;
    if (PJRT_Error* e = api->PJRT_Device_GetDescription(&desc)) {
      Drop(e);
    } else {
      auto id = Make<PJRT_DeviceDescription_Id_Args>();
      id.device_description = desc.device_description;
      if (PJRT_Error* e = api->PJRT_DeviceDescription_Id(&id)) Drop(e);
      else s.id = id.id;
      auto process = Make<PJRT_DeviceDescription_ProcessIndex_Args>();
      process.device_description = desc.device_description;
      if (PJRT_Error* e = api->PJRT_DeviceDescription_ProcessIndex(&process)) {
        Drop(e);
      } else {
        s.process = process.process_index;
      }
      auto kind = Make<PJRT_DeviceDescription_Kind_Args>();
      kind.device_description = desc.device_description;
      if (PJRT_Error* e = api->PJRT_DeviceDescription_Kind(&kind)) Drop(e);
      else if (kind.device_kind) s.kind.assign(kind.device_kind, kind.device_kind_size);
    }
    auto hw = Make<PJRT_Device_LocalHardwareId_Args>();
    hw.device = device;
    if (PJRT_Error* e = api->PJRT_Device_LocalHardwareId(&hw)) Drop(e);
    else s.local_hardware_id = hw.local_hardware_id;
    s.live.store(true, std::memory_order_release);
    state->slot_count.store(n + 1, std::memory_order_release);
    IndexSlot(device, n);
  }
}

void Raise(Slot& s, int64_t bytes) {
  const int64_t now = s.bytes.fetch_add(bytes, std::memory_order_relaxed) + bytes;
  s.buffers.fetch_add(1, std::memory_order_relaxed);
  s.created.fetch_add(1, std::memory_order_relaxed);
  int64_t peak = s.peak.load(std::memory_order_relaxed);
  while (now > peak &&
         !s.peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

// A buffer the C API just handed out.
void Account(PJRT_Buffer* buffer) {
  if (buffer == nullptr) return;
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
  Shard& shard = state->shards[Hash(buffer) % kShards];
  {
    std::lock_guard<std::mutex> lock(shard.mu);
    if (!shard.live.try_emplace(buffer, Record{slot, bytes, false}).second) {
      return;  // counted already (a handle handed out twice)
    }
  }
  Raise(state->slots[slot], bytes);
}

// A buffer deleted (`destroy` false: its memory freed, the handle kept) or
// destroyed; a deleted buffer stops counting then, and its destroy only
// forgets it.
void Release(PJRT_Buffer* buffer, bool destroy) {
  Timed timed;
  Shard& shard = state->shards[Hash(buffer) % kShards];
  Record record{-1, 0, true};
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
  Slot& s = state->slots[record.slot];
  s.bytes.fetch_sub(record.bytes, std::memory_order_relaxed);
  s.buffers.fetch_sub(1, std::memory_order_relaxed);
}

// Reads an out field only where the caller's struct holds it.
#define XLAKIT_HOLDS(args, field) \
  ((args)->struct_size >= offsetof(std::remove_reference_t<decltype(*(args))>, field) + sizeof((args)->field))

PJRT_Error* Client_Create(PJRT_Client_Create_Args* args) {
  PJRT_Error* e = state->inner->PJRT_Client_Create(args);
  if (e == nullptr && XLAKIT_HOLDS(args, client)) RegisterClient(args->client);
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
XLAKIT_ACCOUNTED(Client_CreateViewOfDeviceBuffer, buffer)
XLAKIT_ACCOUNTED(Client_CreateAliasBuffer, alias_buffer)
XLAKIT_ACCOUNTED(Buffer_CopyToDevice, dst_buffer)
XLAKIT_ACCOUNTED(Buffer_CopyToMemory, dst_buffer)
XLAKIT_ACCOUNTED(AsyncHostToDeviceTransferManager_RetrieveBuffer, buffer_out)
#undef XLAKIT_ACCOUNTED

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
  bool known;
  {
    Timed timed;
    known = NumOutputs(args->executable, &outputs);
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

template <typename Fn>
void Replace(PJRT_Api* table, Fn PJRT_Api::*field, size_t offset, Fn fn) {
  if (HasFunction(state->inner, offset, sizeof(Fn))) table->*field = fn;
}

}  // namespace

void InstallMemoryAccounting(const PJRT_Api* real, PJRT_Api* table,
                             bool accounting) {
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

std::string MemoryJson(bool plugin_stats, bool reset_peaks) {
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
    const int64_t bytes = s.bytes.load(std::memory_order_relaxed);
    out += std::string(first ? "" : ", ") + "{\"platform\": " +
           JsonString(s.platform) + ", \"client\": " +
           std::to_string(s.client_index) + ", \"id\": " + std::to_string(s.id) +
           ", \"process\": " + std::to_string(s.process) +
           ", \"local_hardware_id\": " + std::to_string(s.local_hardware_id) +
           ", \"kind\": " + JsonString(s.kind) +
           ", \"live_bytes\": " + std::to_string(bytes) +
           ", \"live_buffers\": " + std::to_string(s.buffers.load()) +
           ", \"peak_bytes\": " + std::to_string(s.peak.load()) +
           ", \"created_buffers\": " + std::to_string(s.created.load());
    if (plugin_stats) out += ", " + PluginStats(s.device);
    out += "}";
    if (reset_peaks) s.peak.store(bytes, std::memory_order_relaxed);
    first = false;
  }
  return out + "]}";
}

}  // namespace pjrt_wrap
}  // namespace xlakit
