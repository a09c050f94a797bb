// The devices memory accounting counts for (memory_accounting.h): learned
// when a client is created, each in a slot published once and never reused,
// found again by an open-addressing index without a lock; each device's
// memories by kind, and where a buffer's bytes count among them.
#include <atomic>
#include <cstdint>
#include <mutex>
#include <string>

#include "pjrt_wrap/counters.h"
#include "pjrt_wrap/memory_state.h"
#include "pjrt_wrap/pjrt_calls.h"

namespace xlakit {
namespace pjrt_wrap {
namespace memory {
namespace {

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

}  // namespace

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

}  // namespace memory
}  // namespace pjrt_wrap
}  // namespace xlakit
