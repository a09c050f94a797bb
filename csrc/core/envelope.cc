// The cache entry envelope's format; see envelope.h for the layout: entry
// status and kind names, the checksum, and a plain entry encoded, decoded
// and checked against a runtime's identity. Authenticated entries and cache
// keys are envelope_mac.cc, reading entries from files envelope_read.cc.
#include "envelope.h"

#include <cstdio>
#include <cstring>

#include "envelope_internal.h"

namespace xlakit {
namespace envelope_internal {

DecodeResult ChecksumMismatch(uint64_t expected, uint64_t actual) {
  char buf[96];
  std::snprintf(buf, sizeof(buf),
                "checksum mismatch: header says %016llx, content hashes to "
                "%016llx",
                static_cast<unsigned long long>(expected),
                static_cast<unsigned long long>(actual));
  return Fail(EntryStatus::kChecksumMismatch, buf);
}

}  // namespace envelope_internal

using envelope_internal::kFixedPrefix;
using envelope_internal::kStringCount;
using envelope_internal::kMaxString;
using envelope_internal::PutU16;
using envelope_internal::PutU64;
using envelope_internal::GetU64;
using envelope_internal::GetU16;
using envelope_internal::Fail;
using envelope_internal::Quote;
using envelope_internal::ChecksumMismatch;

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

}  // namespace xlakit
