// The refused-entry verdict; see entry_fate.h.
#include "entry_fate.h"

namespace xlakit {
namespace {

thread_local EntryFate noted = EntryFate::kErase;

}  // namespace

const char* EntryFateName(EntryFate fate) {
  switch (fate) {
    case EntryFate::kErase:
      return "erase";
    case EntryFate::kKeep:
      return "keep";
  }
  return "unknown";
}

void NoteEntryFate(EntryFate fate) { noted = fate; }

EntryFate TakeEntryFate() {
  EntryFate fate = noted;
  noted = EntryFate::kErase;
  return fate;
}

}  // namespace xlakit
