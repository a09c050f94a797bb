// Cache entry envelope: the header xlakit wraps around every persistent
// compilation-cache payload (encode, decode, verify against this runtime).
//
// Layout (all integers little-endian):
//   magic "XLKC" | u16 format_version | u8 kind | u8 reserved (0)
//   5 x (u16 length + bytes): platform_name, platform_version,
//       torch_xla_revision, patch_series_id, cache_key
//   u64 payload_length | u64 checksum | payload
// The checksum (FNV-1a 64) covers every byte before it and the payload, so a
// flipped bit anywhere is detected. It guards against torn and corrupt files,
// not against an adversary. `cache_key` is the name the entry was written
// under (the PJRT wrapper's SHA-256 of everything the executable depends on);
// a reader that knows the key it looked up compares them, so an entry renamed,
// copied or swapped to another name is refused, and under XLAKIT_CACHE_KEY
// the tag covers it (format 1 had no cache_key: such entries are refused as
// old_format). No XLA, torch or absl headers: this file is also compiled into
// xlakit._C and tested there.
#ifndef XLAKIT_CORE_ENVELOPE_H_
#define XLAKIT_CORE_ENVELOPE_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>

namespace xlakit {

inline constexpr char kEnvelopeMagic[4] = {'X', 'L', 'K', 'C'};
inline constexpr uint16_t kEnvelopeFormatVersion = 2;

enum class EntryKind : uint8_t {
  // A PjRtExecutable::SerializeExecutable() blob.
  kExecutable = 1,
  // An HloModuleProto, for clients that cannot serialize executables.
  kHloModule = 2,
};

// Why an entry was rejected; kOk when it may be used. Every value but kOk is a
// counted cache miss followed by a recompile.
enum class EntryStatus : uint8_t {
  kOk = 0,
  kBadMagic,
  kUnsupportedVersion,
  kBadKind,
  kTruncated,
  kTrailingBytes,
  kChecksumMismatch,
  kPlatformMismatch,
  kPlatformVersionMismatch,
  kPatchSeriesMismatch,
  // A runtime with a key (XLAKIT_CACHE_KEY) found an entry without a tag.
  kUnauthenticated,
  // The entry's tag does not verify under the runtime's key.
  kBadTag,
  // Appended, so the values above keep their numbers.
  kTorchXlaRevisionMismatch,
  // The runtime's key is refused (too short, CacheKeyProblem): nothing is
  // loaded under it, and the entry stays for the jobs that can use it.
  kKeyRefused,
  // An entry of an older envelope format (format 1 stored no cache key).
  kOldFormat,
  // The cache key stored in the entry is not the key it was looked up under:
  // it was renamed, copied or swapped (never loaded as another program).
  kKeyMismatch,
  // The entry is larger than the reader's cap (XLAKIT_PJRT_CACHE_MAX_ENTRY_
  // BYTES for the wrapper): refused before its payload is read.
  kTooLarge,
};

struct EntryHeader {
  uint16_t format_version = kEnvelopeFormatVersion;
  EntryKind kind = EntryKind::kExecutable;
  std::string platform_name;
  std::string platform_version;
  std::string torch_xla_revision;
  std::string patch_series_id;
  // The key the entry was written under; "" from a writer that does not know
  // it (the patched torch_xla's cache hooks are not given the key).
  std::string cache_key;
  uint64_t payload_length = 0;
  uint64_t checksum = 0;
  // Offset of the payload in the encoded entry.
  uint64_t payload_offset = 0;
};

struct DecodeResult {
  EntryStatus status = EntryStatus::kOk;
  // Says what was expected and what was found; empty when status is kOk.
  std::string message;
  EntryHeader header;
  // The entry carries a tag (see "Authenticated entries"), and whether it
  // was checked against a key.
  bool authenticated = false;
  bool tag_checked = false;
};

// What the running process is; an entry must match it to be used. An empty
// torch_xla_revision is not compared (tools that inspect a cache folder may
// not know it); the runtime always sets it.
struct RuntimeIdentity {
  std::string platform_name;
  std::string platform_version;
  std::string patch_series_id;
  std::string torch_xla_revision;
};

const char* EntryStatusName(EntryStatus status);
const char* EntryKindName(EntryKind kind);

// 64-bit FNV-1a, continued from `seed` (pass the result of a previous call to
// hash data that arrives in pieces).
uint64_t Fnv1a64(std::string_view data, uint64_t seed = 14695981039346656037u);

// Returns header + payload. `header.payload_length`, `checksum` and
// `payload_offset` are computed, not read.
std::string EncodeEntry(const EntryHeader& header, std::string_view payload);

// Parses the header only. `total_size` is the size of the whole entry (which
// `data` may be a prefix of) so truncation is detected without the payload.
DecodeResult DecodeHeader(std::string_view data, uint64_t total_size);

// Parses the header and checks length and checksum over the whole entry.
DecodeResult DecodeEntry(std::string_view data);

// DecodeEntry, then compares the header with the running process. Platform
// name is checked first, then platform version, then the patch series, then
// the torch_xla revision, so the status names the most fundamental
// difference.
DecodeResult VerifyEntry(std::string_view data, const RuntimeIdentity& self);

// The longest header an entry can have: the fixed prefix, five strings at
// their maximum length, payload length and checksum. Reading this many bytes
// is always enough to decode a header.
inline constexpr size_t kMaxHeaderBytes = 8 + 5 * (2 + 0xffff) + 16;

// Authenticated entries. A checksum proves an entry intact, not who wrote
// it. A job given a secret key (XLAKIT_CACHE_KEY) writes
//   magic "XLKA" | u16 auth_format_version | 32-byte tag | plain entry
// where the plain entry is the layout above, complete, and the tag is
// HMAC-SHA256 under the key over all of it (header and payload). Only a holder
// of the key can make an entry a keyed runtime loads; the inner checksum
// still lets tools without the key find corruption.
inline constexpr char kAuthMagic[4] = {'X', 'L', 'K', 'A'};
inline constexpr uint16_t kAuthFormatVersion = 1;
inline constexpr size_t kAuthTagBytes = 32;
inline constexpr size_t kAuthPrefixBytes = 4 + 2 + kAuthTagBytes;
// Where a job's key comes from, and the shortest key accepted: anything shorter
// is no secret. The one place of both facts (xlakit._C exports them to
// python/xlakit/_knobs.py).
inline constexpr char kCacheKeyEnv[] = "XLAKIT_CACHE_KEY";
inline constexpr size_t kMinCacheKeyBytes = 32;

// "" when `key` may serve as the job's key, else why not: its length, the
// minimum and how to make one (never the key itself). An empty key is no key.
std::string CacheKeyProblem(std::string_view key);

// HMAC-SHA256 under the job's key, from a crypto library: BoringSSL in the
// runtime (core/entry_mac_openssl.h), Python's hmac in xlakit._C. xlakit
// implements no cryptography itself. One object per entry.
class EntryMac {
 public:
  virtual ~EntryMac() = default;
  virtual void Update(std::string_view data) = 0;
  // The tag of everything passed to Update (kAuthTagBytes bytes; empty if
  // the library failed).
  virtual std::string Tag() = 0;
  // Whether `tag` is that tag, compared in constant time.
  virtual bool Matches(std::string_view tag) = 0;
  // Why this MAC stands for a key that may not be used (RefusedEntryMac);
  // "" for a usable one.
  virtual std::string Refusal() const { return ""; }
};

// Stands for a job key that may not be used (CacheKeyProblem says why): it
// makes no tag and verifies none, and VerifyCacheEntry answers kKeyRefused,
// so a caller that does not ask still never writes or loads an entry under it.
class RefusedEntryMac : public EntryMac {
 public:
  explicit RefusedEntryMac(std::string problem) : problem_(std::move(problem)) {}
  void Update(std::string_view) override {}
  std::string Tag() override { return ""; }
  bool Matches(std::string_view) override { return false; }
  std::string Refusal() const override { return problem_; }

 private:
  std::string problem_;
};

// EncodeEntry wrapped with its tag; "" (do not cache) if the MAC failed.
std::string EncodeAuthenticatedEntry(const EntryHeader& header,
                                     std::string_view payload, EntryMac& mac);

// The check before an entry is loaded. With `mac` (the job has a key) the
// entry must carry a tag that verifies, else kUnauthenticated or kBadTag (a
// counted miss; the tag is checked before anything else is parsed); a refused
// key (RefusedEntryMac) gives kKeyRefused whatever the entry. Without
// `mac`, an authenticated entry is judged by its plain entry alone. Then
// VerifyEntry's checks against `self` (DecodeEntry's when `self` is null).
// Last, with `expected_key`, the stored cache key must equal it (kKeyMismatch).
// `header.payload_offset` is relative to `data`.
DecodeResult VerifyCacheEntry(std::string_view data,
                              const RuntimeIdentity* self, EntryMac* mac,
                              const std::string* expected_key = nullptr);

// DecodeHeader for a plain or an authenticated entry (the tag unchecked):
// what `xlakit cache ls` shows without reading payloads.
DecodeResult DecodeCacheHeader(std::string_view data, uint64_t total_size);

// VerifyCacheEntry over a file, read in pieces of `chunk_bytes` so memory
// stays bounded whatever the payload's size; the same statuses and messages.
// When the file cannot be opened or read, sets `*io_error` (path and errno
// text) and the result is meaningless.
DecodeResult VerifyEntryFile(const std::string& path,
                             const RuntimeIdentity* self, EntryMac* mac,
                             size_t chunk_bytes, std::string* io_error,
                             const std::string* expected_key = nullptr);

// What ReadEntry checks an entry against.
struct EntryCheck {
  const RuntimeIdentity* self = nullptr;  // null: integrity only
  EntryMac* mac = nullptr;                // the job's key; null: none
  const std::string* expected_key = nullptr;  // null: not compared
  // Entries larger than this are refused (kTooLarge) once their header is
  // read, before any payload byte is.
  uint64_t max_entry_bytes = UINT64_MAX;
};

// The payload of an entry ReadEntry accepted, read once, straight from the
// file into this buffer (never zero-filled first, never copied again).
struct EntryPayload {
  std::unique_ptr<char[]> data;
  uint64_t size = 0;
  std::string_view view() const { return {data.get(), size}; }
};

// VerifyCacheEntry over the open file `fd` (at offset 0, `size` bytes as its
// fstat says), streamed: the header first (one small read; a bad one, or a
// claimed size other than the file's, ends it), then `check.max_entry_bytes`,
// then the rest in pieces of at most `chunk_bytes` through the checksum and
// the tag. With `payload`, the payload's bytes are read into it as they are
// hashed (memory: the payload, at most the cap), and it is emptied unless the
// entry is accepted; without, memory stays at one piece. `*io_error` as for
// VerifyEntryFile.
DecodeResult ReadEntry(int fd, uint64_t size, const EntryCheck& check,
                       size_t chunk_bytes, EntryPayload* payload,
                       std::string* io_error);

// The bytes the cache key is salted with, so an entry for another platform
// version or patch series is never even looked up. `key_id` (CacheKeyId of the
// job's key; empty without one) keeps jobs with different keys, or none, apart:
// each would refuse, and erase, the other's entries.
std::string CacheKeyMaterial(const RuntimeIdentity& self);
std::string CacheKeyMaterial(const RuntimeIdentity& self,
                             std::string_view key_id);

// A name for the job's key that reveals nothing of it: the first 16 hex digits
// of the MAC (under the key) of a constant. `fresh` is a MAC nothing was fed
// to yet; "" if the library failed. xlakit's cache folder names use it too.
std::string CacheKeyId(EntryMac& fresh);

}  // namespace xlakit

#endif  // XLAKIT_CORE_ENVELOPE_H_
