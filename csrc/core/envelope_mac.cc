// Authenticated cache entries (envelope.h): the HMAC tag before a plain
// entry, written and verified under the job's key, the stored key checked,
// and the rules for a key (its length, its id, the key material).
#include <string>
#include <string_view>

#include "envelope.h"
#include "envelope_internal.h"

namespace xlakit {
namespace envelope_internal {
namespace {

std::string Clipped(std::string_view s) {
  constexpr size_t kShown = 80;
  return Quote(s.size() <= kShown ? s : s.substr(0, kShown)) +
         (s.size() <= kShown ? "" : "...");
}

}  // namespace

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

DecodeResult Authenticated(DecodeResult r, bool tag_checked) {
  r.header.payload_offset += kAuthPrefixBytes;
  r.authenticated = true;
  r.tag_checked = tag_checked;
  return r;
}

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

DecodeResult Judge(std::string_view inner, const RuntimeIdentity* self,
                   const std::string* expected_key) {
  DecodeResult r = self != nullptr ? VerifyEntry(inner, *self)
                                   : DecodeEntry(inner);
  CheckStoredKey(&r, expected_key);
  return r;
}

}  // namespace envelope_internal

using envelope_internal::PutU16;
using envelope_internal::Fail;
using envelope_internal::StartsWith;
using envelope_internal::ParseAuthPrefix;
using envelope_internal::Unauthenticated;
using envelope_internal::BadTag;
using envelope_internal::Authenticated;
using envelope_internal::Judge;

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
