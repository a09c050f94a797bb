// EntryMac (core/envelope.h) over the HMAC of OpenSSL's API, which BoringSSL
// shares: the runtime's cache hook (runtime/xlakit/pjrt_access.cc) uses it to
// write and check authenticated entries. BoringSSL is already in the
// torch_xla tree through XLA; :xlakit_core depends on "@boringssl//:crypto".
// Header-only, so xlakit._C (which uses Python's hmac instead) links no crypto
// library. `make cxx-check` compiles it against the BoringSSL headers of the
// TensorFlow wheels and runs it over the BoringSSL their framework library
// exports (tests/cxx); tests/cpp/entry_mac_check.cc, against the system
// OpenSSL.
#ifndef XLAKIT_CORE_ENTRY_MAC_OPENSSL_H_
#define XLAKIT_CORE_ENTRY_MAC_OPENSSL_H_

// OpenSSL 3 deprecates HMAC_CTX in favour of EVP_MAC, which BoringSSL lacks;
// HMAC_CTX is the API both have.
#ifndef OPENSSL_SUPPRESS_DEPRECATED
#define OPENSSL_SUPPRESS_DEPRECATED
#endif
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/hmac.h>

#include <cstdlib>
#include <memory>
#include <string>
#include <string_view>

#include "envelope.h"

namespace xlakit {

class OpenSslEntryMac : public EntryMac {
 public:
  explicit OpenSslEntryMac(std::string_view key) : ctx_(HMAC_CTX_new()) {
    ok_ = ctx_ != nullptr &&
          HMAC_Init_ex(ctx_, key.data(), static_cast<int>(key.size()),
                       EVP_sha256(), nullptr) == 1;
  }
  ~OpenSslEntryMac() override { HMAC_CTX_free(ctx_); }
  OpenSslEntryMac(const OpenSslEntryMac&) = delete;
  OpenSslEntryMac& operator=(const OpenSslEntryMac&) = delete;

  void Update(std::string_view data) override {
    const auto* bytes = reinterpret_cast<const unsigned char*>(data.data());
    ok_ = ok_ && HMAC_Update(ctx_, bytes, data.size()) == 1;
  }

  std::string Tag() override {
    unsigned char out[EVP_MAX_MD_SIZE];
    unsigned int n = 0;
    if (!ok_ || HMAC_Final(ctx_, out, &n) != 1) return "";
    ok_ = false;  // a context finishes once
    return std::string(reinterpret_cast<const char*>(out), n);
  }

  bool Matches(std::string_view tag) override {
    std::string mine = Tag();
    return !mine.empty() && mine.size() == tag.size() &&
           CRYPTO_memcmp(mine.data(), tag.data(), mine.size()) == 0;
  }

 private:
  HMAC_CTX* ctx_;
  bool ok_;
};

// A MAC under the job's key (kCacheKeyEnv), one per entry; nullptr when the
// variable is unset or empty, and the cache then reads and writes plain
// entries. A key shorter than kMinCacheKeyBytes, which xlakit's Python side
// refuses too, gives a RefusedEntryMac: no entry is written or loaded.
inline std::unique_ptr<EntryMac> NewEntryMacFromEnv() {
  const char* key = std::getenv(kCacheKeyEnv);
  if (key == nullptr || *key == '\0') return nullptr;
  std::string problem = CacheKeyProblem(key);
  if (!problem.empty()) return std::make_unique<RefusedEntryMac>(problem);
  return std::make_unique<OpenSslEntryMac>(key);
}

// What the cache keys of a job with `mac` (NewEntryMacFromEnv) are salted
// with: "" without a key, the key's CacheKeyId with one, "refused" for a
// refused key (a namespace no usable key shares).
inline std::string JobKeyId(std::unique_ptr<EntryMac> mac) {
  if (mac == nullptr) return "";
  if (!mac->Refusal().empty()) return "refused";
  return CacheKeyId(*mac);
}

}  // namespace xlakit

#endif  // XLAKIT_CORE_ENTRY_MAC_OPENSSL_H_
