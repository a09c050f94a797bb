// A PJRT_Api that refuses to start, with a message saying why and how to fix
// it: what GetPjrtApi returns when the real plugin cannot be wrapped (not set,
// not found, not a PJRT plugin, another major C API version, no memory left
// to start). Every function
// returns an error the framework shows as the runtime's own start-up error
// (torch_xla's RuntimeError, jax's plugin error); nothing aborts.
#ifndef XLAKIT_PJRT_WRAP_REFUSAL_H_
#define XLAKIT_PJRT_WRAP_REFUSAL_H_

#include <string>

#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {

// The refusing table (this header's size and version), made once.
const PJRT_Api* RefusingApi(const std::string& message);

// The same table refusing with "out of memory", made without allocating: for
// a start that had no memory left even for the message.
const PJRT_Api* OutOfMemoryApi() noexcept;

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_REFUSAL_H_
