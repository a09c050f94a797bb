// Cache entry envelope encode/decode; see envelope.h for the layout.
#include "envelope.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <cstring>

namespace xlakit {
namespace {

constexpr size_t kFixedPrefix = 8;  // magic + version + kind + reserved
constexpr size_t kStringCount = 4;
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
        &header.torch_xla_revision, &header.patch_series_id}) {
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
                                       &h.patch_series_id};
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
                              const RuntimeIdentity* self, EntryMac* mac) {
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  if (!StartsWith(data, kAuthMagic)) {
    if (mac != nullptr && StartsWith(data, kEnvelopeMagic)) {
      return Unauthenticated();
    }
    return self != nullptr ? VerifyEntry(data, *self) : DecodeEntry(data);
  }
  std::string_view tag;
  DecodeResult prefix = ParseAuthPrefix(data, data.size(), &tag);
  if (prefix.status != EntryStatus::kOk) return Authenticated(prefix, false);
  std::string_view inner = data.substr(kAuthPrefixBytes);
  if (mac != nullptr) {
    mac->Update(inner);
    if (!mac->Matches(tag)) return Authenticated(BadTag(), true);
  }
  return Authenticated(
      self != nullptr ? VerifyEntry(inner, *self) : DecodeEntry(inner),
      mac != nullptr);
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
                             size_t chunk_bytes, std::string* io_error) {
  auto fail_io = [&](const char* what) {
    *io_error = std::string(what) + " " + path + ": " + std::strerror(errno);
    return DecodeResult{};
  };
  if (mac != nullptr && !mac->Refusal().empty()) {
    return Fail(EntryStatus::kKeyRefused, mac->Refusal());
  }
  // Never follow a link: the cache writer makes none, and a tool must judge
  // the file in the folder, not whatever it points at.
  Fd file{::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NOFOLLOW)};
  if (file.fd < 0) return fail_io("cannot open");
  struct stat st;
  if (::fstat(file.fd, &st) != 0) return fail_io("cannot stat");
  uint64_t size = static_cast<uint64_t>(st.st_size);
  std::string prefix;
  if (!ReadUpTo(file.fd,
                std::min<uint64_t>(size, kAuthPrefixBytes + kMaxHeaderBytes),
                &prefix)) {
    return fail_io("cannot read");
  }
  std::string_view head(prefix);
  bool keyed = StartsWith(head, kAuthMagic);
  std::string_view tag;
  if (keyed) {
    DecodeResult p = ParseAuthPrefix(head, size, &tag);
    if (p.status != EntryStatus::kOk) return Authenticated(p, false);
  } else if (mac != nullptr && StartsWith(head, kEnvelopeMagic)) {
    return Unauthenticated();
  }
  EntryMac* tag_mac = keyed ? mac : nullptr;
  uint64_t skip = keyed ? kAuthPrefixBytes : 0;
  auto done = [&](DecodeResult r) {
    return keyed ? Authenticated(std::move(r), tag_mac != nullptr) : r;
  };
  std::string_view inner = head.substr(skip);
  DecodeResult r = DecodeHeader(inner, size - skip);
  // A header that does not decode ends the check, unless a tag must still be
  // judged first (over every byte, as VerifyCacheEntry does).
  bool hashing = r.status == EntryStatus::kOk;
  if (!hashing && tag_mac == nullptr) return done(r);
  if (tag_mac != nullptr) tag_mac->Update(inner);
  uint64_t hash = 0;
  if (hashing) {
    uint64_t offset = r.header.payload_offset;
    hash = Fnv1a64(inner.substr(offset), Fnv1a64(inner.substr(0, offset - 8)));
  }
  uint64_t left = size - prefix.size();
  std::string chunk;
  while (left > 0) {
    if (!ReadUpTo(file.fd, std::min<uint64_t>(left, chunk_bytes), &chunk)) {
      return fail_io("cannot read");
    }
    if (chunk.empty()) break;  // the file shrank while it was read
    if (tag_mac != nullptr) tag_mac->Update(chunk);
    if (hashing) hash = Fnv1a64(chunk, hash);
    left -= chunk.size();
  }
  if (tag_mac != nullptr && !tag_mac->Matches(tag)) return done(BadTag());
  if (!hashing) return done(r);
  if (left > 0) {
    return done(Fail(EntryStatus::kTruncated,
                     "entry shrank while it was read (" +
                         std::to_string(left) +
                         " bytes fewer than its size said)"));
  }
  if (hash != r.header.checksum) {
    return done(ChecksumMismatch(r.header.checksum, hash));
  }
  if (self != nullptr) {
    // VerifyEntry's identity rules, applied to the header alone (re-encoded
    // with an empty payload) so they live in one place.
    DecodeResult judged = VerifyEntry(EncodeEntry(r.header, ""), *self);
    r.status = judged.status;
    r.message = judged.message;
  }
  return done(r);
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
