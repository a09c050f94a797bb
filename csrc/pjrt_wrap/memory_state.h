// The state memory accounting shares across its files (internal to
// pjrt_wrap): per device slots with their tallies (the device's own memory,
// its other memories by kind, views), the live buffers' records in shards,
// and the helpers that read the plugin. memory_devices.cc learns devices,
// memory_accounting.cc counts buffers, memory_report.cc writes the report.
#ifndef XLAKIT_PJRT_WRAP_MEMORY_STATE_H_
#define XLAKIT_PJRT_WRAP_MEMORY_STATE_H_

#include <atomic>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <shared_mutex>
#include <string>

#include "pjrt_wrap/pjrt_calls.h"
#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {
namespace memory {

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

// Made by InstallMemoryAccounting, never destroyed (the table outlives it).
extern State* state;

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

inline size_t Hash(const void* p) {
  uint64_t x = reinterpret_cast<uintptr_t>(p);
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  return static_cast<size_t>(x);
}

template <typename Args>
Args Make() {
  Args args{};
  args.struct_size = sizeof(Args);
  return args;
}

inline void Drop(PJRT_Error* error) { TakeError(state->real, error); }

// The slot of a device, or -1 (memory_devices.cc).
int FindSlot(PJRT_Device* device);

// Learns a new client's addressable devices and their memories.
void RegisterClient(PJRT_Client* client);

// Where the buffer's bytes count on its device's slot `s`, and that tally.
int MemoryBucket(PJRT_Buffer* buffer, const Slot& s);
Tally* TallyOf(Slot& s, int bucket);

}  // namespace memory
}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_MEMORY_STATE_H_
