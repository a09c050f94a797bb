// Typed calls into the real plugin's PJRT_Api for what the wrapper itself
// asks of it: names, devices, serialize, deserialize, destroy. Each returns
// false with the plugin's error message (the PJRT_Error destroyed here) so
// the cache can count it and fall back; nothing throws.
//
// Argument structs are this header's (the pinned pjrt_c_api.h): a plugin of
// an older minor reads the fields it knows, a newer one accepts them as long
// as the struct did not grow (the structs used here have not since C API
// 0.80; a plugin that refuses one is a counted cache failure, never a failed
// compile).
#ifndef XLAKIT_PJRT_WRAP_PJRT_CALLS_H_
#define XLAKIT_PJRT_WRAP_PJRT_CALLS_H_

#include <cstddef>
#include <string>
#include <string_view>

#include "xla/pjrt/c/pjrt_c_api.h"

namespace xlakit {
namespace pjrt_wrap {

// Whether the plugin's table has the function at `offset` (its struct_size
// reaches it and it is set).
bool HasFunction(const PJRT_Api* api, size_t offset, size_t size);
#define XLAKIT_PJRT_HAS(api, field)                         \
  ::xlakit::pjrt_wrap::HasFunction(api, offsetof(PJRT_Api, field), \
                                   sizeof(((PJRT_Api*)0)->field))

// The error's message and code, "" for nullptr; destroys the error.
std::string TakeError(const PJRT_Api* api, PJRT_Error* error);

bool PlatformName(const PJRT_Api* api, PJRT_Client* client, std::string* out,
                  std::string* error);
bool PlatformVersion(const PJRT_Api* api, PJRT_Client* client,
                     std::string* out, std::string* error);

// What an executable is compiled for beyond its program and options, as the
// same text on every host of a pod: the plugin's topology description
// (PJRT_TopologyDescription_Serialize of the client's topology, as JAX keys
// it) where the plugin has one, then the number of devices and processes and
// every device's kind, in the client's order. Nothing host-specific (the
// client's process index, a device's process index, id, coordinates or
// description string) is in it: an entry one host writes is the one every
// host looks up. `*source` says which parts were found ("topology+devices" or
// "devices").
bool DescribeTopology(const PJRT_Api* api, PJRT_Client* client,
                      std::string* out, std::string* source,
                      std::string* error);

// The executable's serialized form (PJRT_Executable_Serialize of its
// PJRT_Executable), copied out.
bool SerializeExecutable(const PJRT_Api* api, PJRT_LoadedExecutable* loaded,
                         std::string* out, std::string* error);

bool DeserializeAndLoad(const PJRT_Api* api, PJRT_Client* client,
                        std::string_view serialized,
                        PJRT_LoadedExecutable** out, std::string* error);

}  // namespace pjrt_wrap
}  // namespace xlakit

#endif  // XLAKIT_PJRT_WRAP_PJRT_CALLS_H_
