// Cache entry envelope encode/decode; see envelope.h for the layout.
#include "envelope.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <new>

namespace xlakit {
namespace {

constexpr size_t kFixedPrefix = 8;  // magic + version + kind + reserved
constexpr size_t kStringCount = 5;
// The first read of an entry: every real header fits (long strings are read
// on, up to kMaxHeaderBytes).
constexpr size_t kFirstRead = 4096;
constexpr size_t kMaxString = 0xffff;

void PutU16(std::string* out, uint16_t v) {
  out->push_back(static_cast<char>(v & 0xff));
  out->push_back(static_cast<char>(v >> 8));
}

void PutU64(std::string* out, uint64_t v) {
  for (int i = 0; i < 8; ++i) out->push_back(static_cast<char>(v >> (8 * i)));
}

uint64_t GetU64(const char* p) {
  uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<uint8_t>(p[i]);
  return v;
}

uint16_t GetU16(const char* p) {
  return static_cast<uint16_t>(static_cast<uint8_t>(p[0]) |
                               (static_cast<uint8_t>(p[1]) << 8));
}

DecodeResult Fail(EntryStatus status, std::string message) {
  DecodeResult r;
  r.status = status;
  r.message = std::move(message);
  return r;
}

std::string Quote(std::string_view s) { return "'" + std::string(s) + "'"; }

DecodeResult ChecksumMismatch(uint64_t expected, uint64_t actual) {
  char buf[96];
  std::snprintf(buf, sizeof(buf),
                "checksum mismatch: header says %016llx, content hashes to "
                "%016llx",
                static_cast<unsigned long long>(expected),
                static_cast<unsigned long long>(actual));
  return Fail(EntryStatus::kChecksumMismatch, buf);
}

// Reads up to `n` bytes (fewer only at end of file); false on a read error.
bool ReadUpTo(int fd, size_t n, std::string* out) {
  out->resize(n);
  size_t got = 0;
  while (got < n) {
    ssize_t r = ::read(fd, &(*out)[got], n - got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) break;
    got += static_cast<size_t>(r);
  }
  out->resize(got);
  return true;
}

bool StartsWith(std::string_view data, const char (&magic)[4]) {
  return data.size() >= sizeof(magic) &&
         std::memcmp(data.data(), magic, sizeof(magic)) == 0;
}

// The tag of an authenticated entry starting with `data` (`total_size` bytes
// in all), or why there is none.
DecodeResult ParseAuthPrefix(std::string_view data, uint64_t total_size,
                             std::string_view* tag) {
  if (data.size() < kAuthPrefixBytes) {
    return Fail(EntryStatus::kTruncated,
                "authenticated entry is truncated inside its tag (file has " +
                    std::to_string(total_size) + " bytes)");
  }
  uint16_t version = GetU16(data.data() + sizeof(kAuthMagic));
  if (version != kAuthFormatVersion) {
    return Fail(EntryStatus::kUnsupportedVersion,
                "expected authenticated entry format " +
                    std::to_string(kAuthFormatVersion) + ", found " +
                    std::to_string(version));
  }
  *tag = data.substr(sizeof(kAuthMagic) + 2, kAuthTagBytes);
  return DecodeResult{};
}

DecodeResult Unauthenticated() {
  return Fail(EntryStatus::kUnauthenticated,
              std::string("entry carries no tag (written without ") +
                  kCacheKeyEnv +
                  ") and this job has a key: only entries written with the "
                  "same key are loaded");
}

DecodeResult BadTag() {
  return Fail(EntryStatus::kBadTag,
              std::string("the entry's tag does not verify under this job's ") +
                  kCacheKeyEnv +
                  ": it was written with another key, or changed after it "
                  "was written");
}

// A result for the plain entry inside an authenticated one, as a result for
// the whole entry.
DecodeResult Authenticated(DecodeResult r, bool tag_checked) {
  r.header.payload_offset += kAuthPrefixBytes;
  r.authenticated = true;
  r.tag_checked = tag_checked;
  return r;
}

std::string Clipped(std::string_view s) {
  constexpr size_t kShown = 80;
  return Quote(s.size() <= kShown ? s : s.substr(0, kShown)) +
         (s.size() <= kShown ? "" : "...");
}

// `r` (accepted so far) refused unless the entry's stored key is `expected`.
void CheckStoredKey(DecodeResult* r, const std::string* expected) {
  if (expected == nullptr || r->status != EntryStatus::kOk ||
      r->header.cache_key == *expected) {
    return;
  }
  r->status = EntryStatus::kKeyMismatch;
  r->message = "entry was written under cache key " +
               Clipped(r->header.cache_key) + " and is looked up as " +
               Clipped(*expected) +
               ": it was renamed, copied or swapped from another program's "
               "name, and never runs as this one";
}

// The plain entry `inner`, judged as the caller asked.
DecodeResult Judge(std::string_view inner, const RuntimeIdentity* self,
                   const std::string* expected_key) {
  DecodeResult r = self != nullptr ? VerifyEntry(inner, *self)
                                   : DecodeEntry(inner);
  CheckStoredKey(&r, expected_key);
  return r;
}

// Reads up to `n` bytes into `out` (fewer only at end of file); false on a
// read error.
bool ReadInto(int fd, char* out, size_t n, size_t* got) {
  *got = 0;
  while (*got < n) {
    ssize_t r = ::read(fd, out + *got, n - *got);
    if (r < 0 && errno == EINTR) continue;
    if (r < 0) return false;
    if (r == 0) break;
    *got += static_cast<size_t>(r);
  }
  return true;
}

// Closes the descriptor on every return path.
struct Fd {
  int fd;
  ~Fd() {
    if (fd >= 0) ::close(fd);
  }
};

}  // namespace

const char* EntryStatusName(EntryStatus status) {
  switch (status) {
    case EntryStatus::kOk:
      return "ok";
    case EntryStatus::kBadMagic:
      return "bad_magic";
    case EntryStatus::kUnsupportedVersion:
      return "unsupported_version";
    case EntryStatus::kBadKind:
      return "bad_kind";
    case EntryStatus::kTruncated:
      return "truncated";
    case EntryStatus::kTrailingBytes:
      return "trailing_bytes";
    case EntryStatus::kChecksumMismatch:
      return "checksum_mismatch";
    case EntryStatus::kPlatformMismatch:
      return "platform_mismatch";
    case EntryStatus::kPlatformVersionMismatch:
      return "platform_version_mismatch";
    case EntryStatus::kPatchSeriesMismatch:
      return "patch_series_mismatch";
    case EntryStatus::kUnauthenticated:
      return "unauthenticated";
    case EntryStatus::kBadTag:
      return "bad_tag";
    case EntryStatus::kTorchXlaRevisionMismatch:
      return "torch_xla_revision_mismatch";
    case EntryStatus::kKeyRefused:
      return "key_refused";
    case EntryStatus::kOldFormat:
      return "old_format";
    case EntryStatus::kKeyMismatch:
      return "key_mismatch";
    case EntryStatus::kTooLarge:
      return "too_large";
  }
  return "unknown";
}

const char* EntryKindName(EntryKind kind) {
  switch (kind) {
    case EntryKind::kExecutable:
      return "executable";
    case EntryKind::kHloModule:
      return "hlo_module";
  }
  return "unknown";
}

uint64_t Fnv1a64(std::string_view data, uint64_t seed) {
  uint64_t h = seed;
  for (unsigned char c : data) {
    h ^= c;
    h *= 1099511628211u;
  }
  return h;
}

std::string EncodeEntry(const EntryHeader& header, std::string_view payload) {
  std::string out(kEnvelopeMagic, sizeof(kEnvelopeMagic));
  PutU16(&out, kEnvelopeFormatVersion);
  out.push_back(static_cast<char>(header.kind));
  out.push_back('\0');
  for (const std::string* s :
       {&header.platform_name, &header.platform_version,
        &header.torch_xla_revision, &header.patch_series_id,
        &header.cache_key}) {
    // Identity strings are short; clipping keeps the format total rather than
    // failing a cache write over an absurd platform_version.
    size_t n = s->size() < kMaxString ? s->size() : kMaxString;
    PutU16(&out, static_cast<uint16_t>(n));
    out.append(s->data(), n);
  }
  PutU64(&out, payload.size());
  uint64_t checksum = Fnv1a64(payload, Fnv1a64(out));
  PutU64(&out, checksum);
  out.reserve(out.size() + payload.size());
  out.append(payload.data(), payload.size());
  return out;
}

DecodeResult DecodeHeader(std::string_view data, uint64_t total_size) {
  auto truncated = [&](const char* where) {
    return Fail(EntryStatus::kTruncated,
                "entry is truncated inside the " + std::string(where) +
                    " (file has " + std::to_string(total_size) + " bytes)");
  };
  // Magic first, so a short foreign file is reported as foreign.
  size_t magic_len = std::min(data.size(), sizeof(kEnvelopeMagic));
  if (std::memcmp(data.data(), kEnvelopeMagic, magic_len) != 0) {
    return Fail(EntryStatus::kBadMagic,
                "not an xlakit cache entry: expected magic 'XLKC', found " +
                    Quote(data.substr(0, magic_len)) +
                    " (an entry from a stock torch_xla, or another file)");
  }
  if (data.size() < kFixedPrefix) return truncated("fixed header");
  DecodeResult r;
  EntryHeader& h = r.header;
  h.format_version = GetU16(data.data() + 4);
  if (h.format_version >= 1 && h.format_version < kEnvelopeFormatVersion) {
    return Fail(EntryStatus::kOldFormat,
                "entry has envelope format " +
                    std::to_string(h.format_version) + ", this runtime " +
                    "writes and loads format " +
                    std::to_string(kEnvelopeFormatVersion) +
                    " (an older xlakit wrote it, before entries were bound "
                    "to their cache key); it is recompiled and replaced, "
                    "and `xlakit cache prune` removes such entries");
  }
  if (h.format_version != kEnvelopeFormatVersion) {
    return Fail(EntryStatus::kUnsupportedVersion,
                "expected envelope format version " +
                    std::to_string(kEnvelopeFormatVersion) + ", found " +
                    std::to_string(h.format_version));
  }
  uint8_t kind = static_cast<uint8_t>(data[6]);
  if (kind != static_cast<uint8_t>(EntryKind::kExecutable) &&
      kind != static_cast<uint8_t>(EntryKind::kHloModule)) {
    return Fail(EntryStatus::kBadKind,
                "expected entry kind 1 (executable) or 2 (hlo_module), found " +
                    std::to_string(kind));
  }
  h.kind = static_cast<EntryKind>(kind);
  if (data[7] != '\0') {
    return Fail(EntryStatus::kBadKind, "reserved header byte is not zero");
  }
  size_t pos = kFixedPrefix;
  std::string* fields[kStringCount] = {&h.platform_name, &h.platform_version,
                                       &h.torch_xla_revision,
                                       &h.patch_series_id, &h.cache_key};
  for (std::string* field : fields) {
    if (data.size() < pos + 2) return truncated("identity strings");
    uint16_t n = GetU16(data.data() + pos);
    pos += 2;
    if (data.size() < pos + n) return truncated("identity strings");
    field->assign(data.data() + pos, n);
    pos += n;
  }
  if (data.size() < pos + 16) return truncated("length and checksum");
  h.payload_length = GetU64(data.data() + pos);
  h.checksum = GetU64(data.data() + pos + 8);
  h.payload_offset = pos + 16;
  uint64_t expected = h.payload_offset + h.payload_length;
  // A corrupt length can be huge; compare without overflowing.
  if (h.payload_length > total_size || expected > total_size) {
    return Fail(EntryStatus::kTruncated,
                "entry is truncated: header promises " +
                    std::to_string(h.payload_length) +
                    " payload bytes, file has " +
                    std::to_string(total_size - h.payload_offset));
  }
  if (expected < total_size) {
    return Fail(EntryStatus::kTrailingBytes,
                "entry has " + std::to_string(total_size - expected) +
                    " bytes after the payload (expected exactly " +
                    std::to_string(expected) + ")");
  }
  return r;
}

DecodeResult DecodeEntry(std::string_view data) {
  DecodeResult r = DecodeHeader(data, data.size());
  if (r.status != EntryStatus::kOk) return r;
  const EntryHeader& h = r.header;
  uint64_t actual = Fnv1a64(data.substr(h.payload_offset),
                            Fnv1a64(data.substr(0, h.payload_offset - 8)));
  if (actual != h.checksum) return ChecksumMismatch(h.checksum, actual);
  return r;
}

DecodeResult VerifyEntry(std::string_view data, const RuntimeIdentity& self) {
  DecodeResult r = DecodeEntry(data);
  if (r.status != EntryStatus::kOk) return r;
  const EntryHeader& h = r.header;
  if (h.platform_name != self.platform_name) {
    r.status = EntryStatus::kPlatformMismatch;
    r.message = "entry was compiled for platform " + Quote(h.platform_name) +
                ", this runtime is " + Quote(self.platform_name);
  } else if (h.platform_version != self.platform_version) {
    r.status = EntryStatus::kPlatformVersionMismatch;
    r.message = "entry was compiled for platform version " +
                Quote(h.platform_version) + ", this runtime has " +
                Quote(self.platform_version) +
                " (the plugin, e.g. libtpu, changed; it will be recompiled)";
  } else if (h.patch_series_id != self.patch_series_id) {
    r.status = EntryStatus::kPatchSeriesMismatch;
    r.message = "entry was written by patch series " +
                Quote(h.patch_series_id) + ", this runtime has " +
                Quote(self.patch_series_id);
  } else if (!self.torch_xla_revision.empty() &&
             h.torch_xla_revision != self.torch_xla_revision) {
    r.status = EntryStatus::kTorchXlaRevisionMismatch;
    r.message = "entry was written by torch_xla " +
                Quote(h.torch_xla_revision) + ", this runtime is " +
                Quote(self.torch_xla_revision);
  }
  return r;
}

std::string EncodeAuthenticatedEntry(const EntryHeader& header,
                                     std::string_view payload, EntryMac& mac) {
  std::string inner = EncodeEntry(header, payload);
  mac.Update(inner);
  std::string tag = mac.Tag();
  if (tag.size() != kAuthTagBytes) return "";
  std::string out(kAuthMagic, sizeof(kAuthMagic));
  PutU16(&out, kAuthFormatVersion);
  out += tag;
  out.reserve(out.size() + inner.size());
  out += inner;
  return out;
}

DecodeResult VerifyCacheEntry(std::string_view data,
                              const RuntimeIdentity* self, EntryMac* mac,
                              const std::string* expected_key) {
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  if (!StartsWith(data, kAuthMagic)) {
    if (mac != nullptr && StartsWith(data, kEnvelopeMagic)) {
      return Unauthenticated();
    }
    return Judge(data, self, expected_key);
  }
  std::string_view tag;
  DecodeResult prefix = ParseAuthPrefix(data, data.size(), &tag);
  if (prefix.status != EntryStatus::kOk) return Authenticated(prefix, false);
  std::string_view inner = data.substr(kAuthPrefixBytes);
  if (mac != nullptr) {
    mac->Update(inner);
    if (!mac->Matches(tag)) return Authenticated(BadTag(), true);
  }
  return Authenticated(Judge(inner, self, expected_key), mac != nullptr);
}

DecodeResult DecodeCacheHeader(std::string_view data, uint64_t total_size) {
  if (!StartsWith(data, kAuthMagic)) return DecodeHeader(data, total_size);
  std::string_view tag;
  DecodeResult prefix = ParseAuthPrefix(data, total_size, &tag);
  if (prefix.status != EntryStatus::kOk) return Authenticated(prefix, false);
  return Authenticated(DecodeHeader(data.substr(kAuthPrefixBytes),
                                    total_size - kAuthPrefixBytes),
                       false);
}

DecodeResult VerifyEntryFile(const std::string& path,
                             const RuntimeIdentity* self, EntryMac* mac,
                             size_t chunk_bytes, std::string* io_error,
                             const std::string* expected_key) {
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  auto fail_io = [&](const char* what) {
    *io_error = std::string(what) + " " + path + ": " + std::strerror(errno);
    return DecodeResult{};
  };
  // Never follow a link: the cache writer makes none, and a tool must judge
  // the file in the folder, not whatever it points at.
  Fd file{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
  if (file.fd < 0) return fail_io("cannot open");
  struct stat st;
  if (::fstat(file.fd, &st) != 0) return fail_io("cannot stat");
  EntryCheck check;
  check.self = self;
  check.mac = mac;
  check.expected_key = expected_key;
  std::string error;
  DecodeResult r = ReadEntry(file.fd, static_cast<uint64_t>(st.st_size), check,
                             chunk_bytes, nullptr, &error);
  if (!error.empty()) *io_error = "cannot read " + path + ": " + error;
  return r;
}

DecodeResult ReadEntry(int fd, uint64_t size, const EntryCheck& check,
                       size_t chunk_bytes, EntryPayload* payload,
                       std::string* io_error) {
  auto fail_io = [&]() {
    *io_error = std::strerror(errno);
    return DecodeResult{};
  };
  if (payload != nullptr) *payload = EntryPayload{};
  EntryMac* mac = check.mac;
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  if (chunk_bytes == 0) chunk_bytes = 1;
  const uint64_t max_head = kAuthPrefixBytes + kMaxHeaderBytes;
  std::string head;
  if (!ReadUpTo(fd, std::min<uint64_t>(size, kAuthPrefixBytes + kFirstRead),
                &head)) {
    return fail_io();
  }
  bool keyed = StartsWith(head, kAuthMagic);
  std::string tag;
  if (keyed) {
    std::string_view tag_view;
    DecodeResult p = ParseAuthPrefix(head, size, &tag_view);
    if (p.status != EntryStatus::kOk) return Authenticated(p, false);
    tag.assign(tag_view);
  } else if (mac != nullptr && StartsWith(head, kEnvelopeMagic)) {
    return Unauthenticated();
  }
  EntryMac* tag_mac = keyed ? mac : nullptr;
  const uint64_t skip = keyed ? kAuthPrefixBytes : 0;
  auto done = [&](DecodeResult r, bool tag_checked) {
    return keyed ? Authenticated(std::move(r), tag_checked) : r;
  };
  DecodeResult r = DecodeHeader(std::string_view(head).substr(skip), size - skip);
  if (r.status == EntryStatus::kTruncated && head.size() < size &&
      head.size() < max_head) {
    // A header longer than the first read (long identity strings).
    std::string more;
    if (!ReadUpTo(fd, std::min<uint64_t>(size, max_head) - head.size(),
                  &more)) {
      return fail_io();
    }
    head += more;
    r = DecodeHeader(std::string_view(head).substr(skip), size - skip);
  }
  // A header that does not decode ends the check, unless a tag must still be
  // judged first (over every byte, as VerifyCacheEntry does).
  const bool hashing = r.status == EntryStatus::kOk;
  if (!hashing && tag_mac == nullptr) return done(r, false);
  if (size > check.max_entry_bytes) {
    return done(Fail(EntryStatus::kTooLarge,
                     "entry has " + std::to_string(size) +
                         " bytes, more than the " +
                         std::to_string(check.max_entry_bytes) +
                         " an entry may have here; refused unread"),
                false);
  }
  std::string_view inner = std::string_view(head).substr(skip);
  if (tag_mac != nullptr) tag_mac->Update(inner);
  uint64_t hash = 0;
  std::unique_ptr<char[]> buffer;
  uint64_t filled = 0;
  if (hashing) {
    const uint64_t offset = r.header.payload_offset;
    std::string_view first = inner.substr(offset);
    hash = Fnv1a64(first, Fnv1a64(inner.substr(0, offset - 8)));
    if (payload != nullptr) {
      // Not zero-filled: a page is touched only when the file's bytes land
      // in it.
      buffer.reset(new (std::nothrow) char[r.header.payload_length + 1]);
      if (!buffer) {
        *io_error = "cannot allocate " +
                    std::to_string(r.header.payload_length) +
                    " bytes for its payload";
        return DecodeResult{};
      }
      std::memcpy(buffer.get(), first.data(), first.size());
      filled = first.size();
    }
  }
  uint64_t left = size - head.size();
  std::string chunk;
  while (left > 0) {
    const size_t want = static_cast<size_t>(
        std::min<uint64_t>(left, chunk_bytes));
    std::string_view piece;
    if (buffer) {
      // Everything after the header is payload: read it where it will stay.
      size_t got = 0;
      if (!ReadInto(fd, buffer.get() + filled, want, &got)) return fail_io();
      piece = std::string_view(buffer.get() + filled, got);
      filled += got;
    } else {
      if (!ReadUpTo(fd, want, &chunk)) return fail_io();
      piece = chunk;
    }
    if (piece.empty()) break;  // the file shrank while it was read
    if (tag_mac != nullptr) tag_mac->Update(piece);
    if (hashing) hash = Fnv1a64(piece, hash);
    left -= piece.size();
  }
  const bool tag_checked = tag_mac != nullptr;
  if (tag_mac != nullptr && !tag_mac->Matches(tag)) {
    return done(BadTag(), tag_checked);
  }
  if (!hashing) return done(r, tag_checked);
  if (left > 0) {
    return done(Fail(EntryStatus::kTruncated,
                     "entry shrank while it was read (" +
                         std::to_string(left) +
                         " bytes fewer than its size said)"),
                tag_checked);
  }
  if (hash != r.header.checksum) {
    return done(ChecksumMismatch(r.header.checksum, hash), tag_checked);
  }
  if (check.self != nullptr) {
    // VerifyEntry's identity rules, applied to the header alone (re-encoded
    // with an empty payload) so they live in one place.
    DecodeResult judged = VerifyEntry(EncodeEntry(r.header, ""), *check.self);
    r.status = judged.status;
    r.message = judged.message;
  }
  CheckStoredKey(&r, check.expected_key);
  if (r.status == EntryStatus::kOk && payload != nullptr) {
    payload->data = std::move(buffer);
    payload->size = r.header.payload_length;
  }
  return done(r, tag_checked);
}

std::string CacheKeyMaterial(const RuntimeIdentity& self) {
  return CacheKeyMaterial(self, "");
}

std::string CacheKeyMaterial(const RuntimeIdentity& self,
                             std::string_view key_id) {
  // NUL separators keep ("a", "bc") and ("ab", "c") apart.
  std::string out = "xlakit-cache-key-v1";
  for (const std::string* s :
       {&self.platform_name, &self.platform_version, &self.patch_series_id}) {
    out.push_back('\0');
    out.append(*s);
  }
  // Only with a key, so a cache without one keeps its keys (and its entries).
  if (!key_id.empty()) {
    out += std::string("\0key:", 5);
    out.append(key_id);
  }
  return out;
}

std::string CacheKeyProblem(std::string_view key) {
  if (key.empty() || key.size() >= kMinCacheKeyBytes) return "";
  return std::string(kCacheKeyEnv) + " holds " + std::to_string(key.size()) +
         " bytes, expected a secret of at least " +
         std::to_string(kMinCacheKeyBytes) +
         " (e.g. the output of `openssl rand -hex 32`)";
}

std::string CacheKeyId(EntryMac& fresh) {
  fresh.Update("xlakit-cache-key-id");
  std::string tag = fresh.Tag();
  if (tag.size() < 8) return "";
  static constexpr char kHex[] = "0123456789abcdef";
  std::string out;
  for (size_t i = 0; i < 8; ++i) {
    unsigned char c = static_cast<unsigned char>(tag[i]);
    out.push_back(kHex[c >> 4]);
    out.push_back(kHex[c & 0xf]);
  }
  return out;
}

}  // namespace xlakit
