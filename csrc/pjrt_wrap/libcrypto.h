// SHA-256 and HMAC-SHA256 from the system's OpenSSL libcrypto, loaded with
// dlopen. xlakit implements no cryptography itself; the wrapping plugin is
// loaded into processes (torch_xla, jax) that link no crypto library it could
// name at build time, and a wheel must not depend on one distribution's
// libcrypto soname. Python's hashlib has normally mapped libcrypto already, so
// dlopen finds it by soname. Without one the compile cache is off (reported),
// never a failed compile.
#ifndef XLAKIT_PJRT_WRAP_LIBCRYPTO_H_
#define XLAKIT_PJRT_WRAP_LIBCRYPTO_H_

#include <memory>
#include <string>
#include <string_view>

#include "core/envelope.h"

namespace xlakit {
namespace pjrt_wrap {

class Libcrypto;

// The process's libcrypto (libcrypto.so.3, .so.1.1, then .so), or nullptr
// with `*why` saying what was tried.
const Libcrypto* LoadLibcrypto(std::string* why);

// Incremental SHA-256; Hex() finishes it. Empty when the library failed.
class Sha256 {
 public:
  explicit Sha256(const Libcrypto& lib);
  ~Sha256();
  Sha256(const Sha256&) = delete;
  Sha256& operator=(const Sha256&) = delete;
  void Update(std::string_view data);
  std::string Hex();

 private:
  const Libcrypto& lib_;
  void* ctx_;
  bool ok_;
};

// EntryMac (core/envelope.h) over libcrypto's HMAC-SHA256.
std::unique_ptr<EntryMac> NewLibcryptoMac(const Libcrypto& lib,
                                          std::string_view key);

// HMAC-SHA256 of `data` under `key`, in hex ("" if the library failed).
std::string HmacHex(const Libcrypto& lib, std::string_view key,
                    std::string_view data);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_LIBCRYPTO_H_
