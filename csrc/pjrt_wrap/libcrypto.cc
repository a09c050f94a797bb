// libcrypto through dlopen; see libcrypto.h. Only functions that OpenSSL 1.1,
// OpenSSL 3 and BoringSSL all export are used.
#include "pjrt_wrap/libcrypto.h"

#include <dlfcn.h>

#include <cstddef>
#include <type_traits>

namespace xlakit {
namespace pjrt_wrap {

class Libcrypto {
 public:
  void* (*EVP_MD_CTX_new)();
  void (*EVP_MD_CTX_free)(void*);
  const void* (*EVP_sha256)();
  int (*EVP_DigestInit_ex)(void*, const void*, void*);
  int (*EVP_DigestUpdate)(void*, const void*, size_t);
  int (*EVP_DigestFinal_ex)(void*, unsigned char*, unsigned int*);
  void* (*HMAC_CTX_new)();
  void (*HMAC_CTX_free)(void*);
  int (*HMAC_Init_ex)(void*, const void*, int, const void*, void*);
  int (*HMAC_Update)(void*, const unsigned char*, size_t);
  int (*HMAC_Final)(void*, unsigned char*, unsigned int*);
  int (*CRYPTO_memcmp)(const void*, const void*, size_t);

  bool Resolve(void* handle, std::string* missing) {
    bool ok = true;
    auto get = [&](auto& fn, const char* name) {
      fn = reinterpret_cast<std::remove_reference_t<decltype(fn)>>(
          dlsym(handle, name));
      if (fn == nullptr) {
        ok = false;
        *missing += std::string(missing->empty() ? "" : ", ") + name;
      }
    };
    get(EVP_MD_CTX_new, "EVP_MD_CTX_new");
    get(EVP_MD_CTX_free, "EVP_MD_CTX_free");
    get(EVP_sha256, "EVP_sha256");
    get(EVP_DigestInit_ex, "EVP_DigestInit_ex");
    get(EVP_DigestUpdate, "EVP_DigestUpdate");
    get(EVP_DigestFinal_ex, "EVP_DigestFinal_ex");
    get(HMAC_CTX_new, "HMAC_CTX_new");
    get(HMAC_CTX_free, "HMAC_CTX_free");
    get(HMAC_Init_ex, "HMAC_Init_ex");
    get(HMAC_Update, "HMAC_Update");
    get(HMAC_Final, "HMAC_Final");
    get(CRYPTO_memcmp, "CRYPTO_memcmp");
    return ok;
  }
};

namespace {

constexpr int kMaxDigestBytes = 64;

std::string ToHex(const unsigned char* bytes, unsigned int n) {
  static const char kDigits[] = "0123456789abcdef";
  std::string out;
  out.reserve(2 * n);
  for (unsigned int i = 0; i < n; ++i) {
    out += kDigits[bytes[i] >> 4];
    out += kDigits[bytes[i] & 15];
  }
  return out;
}

class LibcryptoMac : public EntryMac {
 public:
  LibcryptoMac(const Libcrypto& lib, std::string_view key)
      : lib_(lib), ctx_(lib.HMAC_CTX_new()) {
    ok_ = ctx_ != nullptr &&
          lib_.HMAC_Init_ex(ctx_, key.data(), static_cast<int>(key.size()),
                            lib_.EVP_sha256(), nullptr) == 1;
  }
  ~LibcryptoMac() override {
    if (ctx_) lib_.HMAC_CTX_free(ctx_);
  }
  LibcryptoMac(const LibcryptoMac&) = delete;
  LibcryptoMac& operator=(const LibcryptoMac&) = delete;

  void Update(std::string_view data) override {
    ok_ = ok_ && lib_.HMAC_Update(
                     ctx_, reinterpret_cast<const unsigned char*>(data.data()),
                     data.size()) == 1;
  }

  std::string Tag() override {
    unsigned char out[kMaxDigestBytes];
    unsigned int n = 0;
    if (!ok_ || lib_.HMAC_Final(ctx_, out, &n) != 1) return "";
    ok_ = false;  // a context finishes once
    return std::string(reinterpret_cast<const char*>(out), n);
  }

  bool Matches(std::string_view tag) override {
    std::string mine = Tag();
    return !mine.empty() && mine.size() == tag.size() &&
           lib_.CRYPTO_memcmp(mine.data(), tag.data(), mine.size()) == 0;
  }

 private:
  const Libcrypto& lib_;
  void* ctx_;
  bool ok_;
};

}  // namespace

const Libcrypto* LoadLibcrypto(std::string* why) {
  static const Libcrypto* loaded = nullptr;
  static std::string failure;
  static bool tried = false;
  // Called once, from GetPjrtApi's one-time activation.
  if (!tried) {
    tried = true;
    const char* names[] = {"libcrypto.so.3", "libcrypto.so.1.1",
                           "libcrypto.so"};
    for (const char* name : names) {
      void* handle = dlopen(name, RTLD_NOW | RTLD_LOCAL);
      if (handle == nullptr) continue;
      static Libcrypto lib;
      std::string missing;
      if (lib.Resolve(handle, &missing)) {
        loaded = &lib;
        break;
      }
      failure += std::string(name) + " lacks " + missing + "; ";
    }
    if (loaded == nullptr) {
      failure += "no usable OpenSSL libcrypto (tried libcrypto.so.3, "
                 "libcrypto.so.1.1, libcrypto.so): install OpenSSL "
                 "(e.g. apt-get install libssl3)";
    }
  }
  if (loaded == nullptr && why) *why = failure;
  return loaded;
}

Sha256::Sha256(const Libcrypto& lib) : lib_(lib), ctx_(lib.EVP_MD_CTX_new()) {
  ok_ = ctx_ != nullptr &&
        lib_.EVP_DigestInit_ex(ctx_, lib_.EVP_sha256(), nullptr) == 1;
}

Sha256::~Sha256() {
  if (ctx_) lib_.EVP_MD_CTX_free(ctx_);
}

void Sha256::Update(std::string_view data) {
  ok_ = ok_ && lib_.EVP_DigestUpdate(ctx_, data.data(), data.size()) == 1;
}

std::string Sha256::Hex() {
  unsigned char out[kMaxDigestBytes];
  unsigned int n = 0;
  if (!ok_ || lib_.EVP_DigestFinal_ex(ctx_, out, &n) != 1) return "";
  ok_ = false;
  return ToHex(out, n);
}

std::unique_ptr<EntryMac> NewLibcryptoMac(const Libcrypto& lib,
                                          std::string_view key) {
  return std::make_unique<LibcryptoMac>(lib, key);
}

std::string HmacHex(const Libcrypto& lib, std::string_view key,
                    std::string_view data) {
  LibcryptoMac mac(lib, key);
  mac.Update(data);
  std::string tag = mac.Tag();
  return ToHex(reinterpret_cast<const unsigned char*>(tag.data()),
               static_cast<unsigned int>(tag.size()));
}

}  // namespace pjrt_wrap
}  // namespace xlakit
