// The refusing PJRT_Api; see refusal.h.
#include "pjrt_wrap/refusal.h"

#include <cstddef>
#include <cstring>

// PJRT_Error is opaque in pjrt_c_api.h: each implementation defines its own.
// This one exists only in the refusing table, whose error functions are the
// only ones that ever see it.
struct PJRT_Error {
  std::string message;
};

namespace xlakit {
namespace pjrt_wrap {
namespace {

std::string* refusal_message = nullptr;
// Handed out when no memory is left for a copy of the message: never freed,
// its message below (nothing allocated when the library loads).
PJRT_Error out_of_memory;
constexpr char kOutOfMemoryMessage[] = "xlakit PJRT wrapper: out of memory";

PJRT_Error* Refuse(void*) {
  if (refusal_message == nullptr) return &out_of_memory;
  try {
    return new PJRT_Error{*refusal_message};
  } catch (...) {
    return &out_of_memory;
  }
}

void ErrorDestroy(PJRT_Error_Destroy_Args* args) {
  if (args->error != &out_of_memory) delete args->error;
}

void ErrorMessage(PJRT_Error_Message_Args* args) {
  if (args->error == &out_of_memory) {
    args->message = kOutOfMemoryMessage;
    args->message_size = sizeof(kOutOfMemoryMessage) - 1;
    return;
  }
  args->message = args->error->message.data();
  args->message_size = args->error->message.size();
}

PJRT_Error* ErrorGetCode(PJRT_Error_GetCode_Args* args) {
  args->code = PJRT_Error_Code_FAILED_PRECONDITION;
  return nullptr;
}

PJRT_Api refusing_api;

const PJRT_Api* FillRefusingApi() noexcept {
  PJRT_Api& api = refusing_api;
  std::memset(&api, 0, sizeof(api));
  api.struct_size = PJRT_Api_STRUCT_SIZE;
  api.pjrt_api_version.struct_size = PJRT_Api_Version_STRUCT_SIZE;
  api.pjrt_api_version.major_version = PJRT_API_MAJOR;
  api.pjrt_api_version.minor_version = PJRT_API_MINOR;
  // Every function slot refuses (each takes one pointer to its arguments);
  // then the three that read an error are made to work.
  auto refuse = reinterpret_cast<void*>(&Refuse);
  for (size_t off = offsetof(PJRT_Api, PJRT_Error_Destroy);
       off + sizeof(void*) <= sizeof(api); off += sizeof(void*)) {
    std::memcpy(reinterpret_cast<char*>(&api) + off, &refuse, sizeof(void*));
  }
  api.PJRT_Error_Destroy = &ErrorDestroy;
  api.PJRT_Error_Message = &ErrorMessage;
  api.PJRT_Error_GetCode = &ErrorGetCode;
  return &api;
}

}  // namespace

const PJRT_Api* RefusingApi(const std::string& message) {
  refusal_message = new std::string("xlakit PJRT wrapper: " + message);
  return FillRefusingApi();
}

const PJRT_Api* OutOfMemoryApi() noexcept {
  refusal_message = nullptr;
  return FillRefusingApi();
}

}  // namespace pjrt_wrap
}  // namespace xlakit
