// What the envelope's files share (internal to core): the wire helpers and
// the results the format (envelope.cc), the authenticated layer
// (envelope_mac.cc) and the streamed reader (envelope_read.cc) all build.
#ifndef XLAKIT_CORE_ENVELOPE_INTERNAL_H_
#define XLAKIT_CORE_ENVELOPE_INTERNAL_H_

#include <cstdint>
#include <cstring>
#include <string>
#include <string_view>
#include <utility>

#include "envelope.h"

namespace xlakit {
namespace envelope_internal {

constexpr size_t kFixedPrefix = 8;  // magic + version + kind + reserved
constexpr size_t kStringCount = 5;
constexpr size_t kMaxString = 0xffff;


inline void PutU16(std::string* out, uint16_t v) {
  out->push_back(static_cast<char>(v & 0xff));
  out->push_back(static_cast<char>(v >> 8));
}

inline void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

inline uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

inline uint16_t GetU16(const char* p) {
  return static_cast<uint16_t>(static_cast<uint8_t>(p[0]) |
                               (static_cast<uint8_t>(p[1]) << 8));
}

inline DecodeResult Fail(EntryStatus status, std::string message) {
  DecodeResult r;
  r.status = status;
  r.message = std::move(message);
  return r;
}

inline std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

inline bool StartsWith(std::string_view data, const char (&magic)[4]) {
  return data.size() >= sizeof(magic) &&
         std::memcmp(data.data(), magic, sizeof(magic)) == 0;
}

DecodeResult ChecksumMismatch(uint64_t expected, uint64_t actual);

// The tag of an authenticated entry starting with `data` (`total_size` bytes
// in all), or why there is none.
DecodeResult ParseAuthPrefix(std::string_view data, uint64_t total_size,
                             std::string_view* tag);
DecodeResult Unauthenticated();
DecodeResult BadTag();
// A result for the plain entry inside an authenticated one, as a result for
// the whole entry.
DecodeResult Authenticated(DecodeResult r, bool tag_checked);
// `r` (accepted so far) refused unless the entry's stored key is `expected`.
void CheckStoredKey(DecodeResult* r, const std::string* expected);
// The plain entry `inner`, judged as the caller asked.
DecodeResult Judge(std::string_view inner, const RuntimeIdentity* self,
                   const std::string* expected_key);

}  // namespace envelope_internal
}  // namespace xlakit

#endif  // XLAKIT_CORE_ENVELOPE_INTERNAL_H_
