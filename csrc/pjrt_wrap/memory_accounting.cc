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

// Live bytes and buffers of one kind of memory, with their peak.
struct Tally {
  std::atomic<int64_t> bytes{0};
  std::atomic<int64_t> buffers{0};
  std::atomic<int64_t> peak{0};
  std::atomic<uint64_t> created{0};
};

// A device's memories other than its default one (pinned_host,
// unpinned_host, ...), each counted apart from the device's own bytes.
constexpr int kMaxMemories = 4;

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
  Tally device_memory;            // the device's default memory
  PJRT_Memory* default_memory = nullptr;
  int num_memories = 0;
  PJRT_Memory* memories[kMaxMemories] = {};
  std::string memory_kinds[kMaxMemories];
  Tally other_memory[kMaxMemories];
  Tally views;  // CreateViewOfDeviceBuffer: memory the framework owns
};

// Where a buffer's bytes count.
constexpr int kDeviceMemory = -1;
constexpr int kViews = -2;
constexpr int kUnknownMemory = -3;  // a memory the device did not list

struct Record {
  int slot;
  int64_t bytes;
  bool deleted;  // its memory freed; the handle lives until destroyed
  int bucket;    // kDeviceMemory, kViews, or an index into other_memory
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

// The device's memories (kinds by name) and which is its default, where the
// plugin says; without them every buffer counts as the device's.
void RegisterMemories(PJRT_Device* device, Slot* s) {
  const PJRT_Api* api = state->real;
  s->num_memories = 0;
  s->default_memory = nullptr;
  if (!XLAKIT_PJRT_HAS(api, PJRT_Device_DefaultMemory) ||
      !XLAKIT_PJRT_HAS(api, PJRT_Device_AddressableMemories) ||
      !XLAKIT_PJRT_HAS(api, PJRT_Memory_Kind) ||
      !XLAKIT_PJRT_HAS(api, PJRT_Buffer_Memory)) {
    return;
  }
  auto def = Make<PJRT_Device_DefaultMemory_Args>();
  def.device = device;
  auto all = Make<PJRT_Device_AddressableMemories_Args>();
  all.device = device;
  if (PJRT_Error* e = api->PJRT_Device_DefaultMemory(&def)) return Drop(e);
  if (PJRT_Error* e = api->PJRT_Device_AddressableMemories(&all)) return Drop(e);
  for (size_t m = 0; m < all.num_memories && s->num_memories < kMaxMemories;
       ++m) {
    if (all.memories[m] == def.memory) continue;
    auto kind = Make<PJRT_Memory_Kind_Args>();
    kind.memory = all.memories[m];
    if (PJRT_Error* e = api->PJRT_Memory_Kind(&kind)) {
      Drop(e);
      continue;
    }
    const int i = s->num_memories++;
    s->memories[i] = all.memories[m];
    s->memory_kinds[i].assign(kind.kind, kind.kind_size);
  }
  s->default_memory = def.memory;
}

// Where the buffer's bytes count: the device's default memory, or one of its
// others (a buffer put in pinned_host memory is host memory).
int MemoryBucket(PJRT_Buffer* buffer, const Slot& s) {
  if (s.default_memory == nullptr) return kDeviceMemory;
  auto memory = Make<PJRT_Buffer_Memory_Args>();
  memory.buffer = buffer;
  if (PJRT_Error* e = state->real->PJRT_Buffer_Memory(&memory)) {
    Drop(e);
    return kDeviceMemory;
  }
  if (memory.memory == s.default_memory) return kDeviceMemory;
  for (int i = 0; i < s.num_memories; ++i) {
    if (s.memories[i] == memory.memory) return i;
  }
  return kUnknownMemory;
}

Tally* TallyOf(Slot& s, int bucket) {
  if (bucket == kDeviceMemory) return &s.device_memory;
  if (bucket == kViews) return &s.views;
  if (bucket >= 0 && bucket < s.num_memories) return &s.other_memory[bucket];
  return nullptr;
}

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
    RegisterMemories(device, &s);
    s.live.store(true, std::memory_order_release);
    state->slot_count.store(n + 1, std::memory_order_release);
    IndexSlot(device, n);
  }
}

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
