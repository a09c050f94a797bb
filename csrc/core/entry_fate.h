// What a persistent cache does with an entry its deserializer refused: erase
// it (corrupt, foreign, or refused by this runtime for good) or keep it (the
// failure was this process's, e.g. device memory exhausted while loading, and
// the entry is still good for every other process sharing the folder). The
// deserializer notes its verdict; the cache, which called it on the same
// thread, takes it. No XLA or torch headers.
#ifndef XLAKIT_CORE_ENTRY_FATE_H_
#define XLAKIT_CORE_ENTRY_FATE_H_

#include <cstdint>

namespace xlakit {

enum class EntryFate : uint8_t {
  kErase = 0,
  kKeep = 1,
};

const char* EntryFateName(EntryFate fate);

// Records the verdict on the entry this thread just refused.
void NoteEntryFate(EntryFate fate);

// The verdict noted on this thread since the last call, then forgets it.
// kErase when none was noted: a deserializer that says nothing gets the
// upstream behaviour (every refused entry is erased).
EntryFate TakeEntryFate();

}  // namespace xlakit

#endif  // XLAKIT_CORE_ENTRY_FATE_H_
