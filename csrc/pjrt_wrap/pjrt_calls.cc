// Calls into the real plugin; see pjrt_calls.h.
#include "pjrt_wrap/pjrt_calls.h"

#include <set>

namespace xlakit {
namespace pjrt_wrap {
namespace {

const char* CodeName(PJRT_Error_Code code) {
  switch (code) {
    case PJRT_Error_Code_CANCELLED: return "CANCELLED";
    case PJRT_Error_Code_UNKNOWN: return "UNKNOWN";
    case PJRT_Error_Code_INVALID_ARGUMENT: return "INVALID_ARGUMENT";
    case PJRT_Error_Code_DEADLINE_EXCEEDED: return "DEADLINE_EXCEEDED";
    case PJRT_Error_Code_NOT_FOUND: return "NOT_FOUND";
    case PJRT_Error_Code_ALREADY_EXISTS: return "ALREADY_EXISTS";
    case PJRT_Error_Code_PERMISSION_DENIED: return "PERMISSION_DENIED";
    case PJRT_Error_Code_RESOURCE_EXHAUSTED: return "RESOURCE_EXHAUSTED";
    case PJRT_Error_Code_FAILED_PRECONDITION: return "FAILED_PRECONDITION";
    case PJRT_Error_Code_ABORTED: return "ABORTED";
    case PJRT_Error_Code_OUT_OF_RANGE: return "OUT_OF_RANGE";
    case PJRT_Error_Code_UNIMPLEMENTED: return "UNIMPLEMENTED";
    case PJRT_Error_Code_INTERNAL: return "INTERNAL";
    case PJRT_Error_Code_UNAVAILABLE: return "UNAVAILABLE";
    case PJRT_Error_Code_DATA_LOSS: return "DATA_LOSS";
    case PJRT_Error_Code_UNAUTHENTICATED: return "UNAUTHENTICATED";
    default: return "ERROR";
  }
}

template <typename Args>
Args Make() {
  Args args{};
  args.struct_size = sizeof(Args);
  return args;
}

// Runs `fn(&args)`; on an error, sets `*error` and returns false.
template <typename Args>
bool Call(const PJRT_Api* api, PJRT_Error* (*fn)(Args*), Args* args,
          const char* what, std::string* error) {
  if (fn == nullptr) {
    *error = std::string(what) + " is not implemented by the plugin";
    return false;
  }
  PJRT_Error* e = fn(args);
  if (e == nullptr) return true;
  *error = std::string(what) + ": " + TakeError(api, e);
  return false;
}

}  // namespace

bool HasFunction(const PJRT_Api* api, size_t offset, size_t size) {
  if (api == nullptr || offset + size > api->struct_size) return false;
  void* fn = nullptr;
  __builtin_memcpy(&fn, reinterpret_cast<const char*>(api) + offset,
                   sizeof(fn));
  return fn != nullptr;
}

std::string TakeError(const PJRT_Api* api, PJRT_Error* error) {
  if (error == nullptr) return "";
  std::string out = "(no message)";
  if (XLAKIT_PJRT_HAS(api, PJRT_Error_Message)) {
    auto args = Make<PJRT_Error_Message_Args>();
    args.error = error;
    api->PJRT_Error_Message(&args);
    if (args.message) out.assign(args.message, args.message_size);
  }
  if (XLAKIT_PJRT_HAS(api, PJRT_Error_GetCode)) {
    auto args = Make<PJRT_Error_GetCode_Args>();
    args.error = error;
    PJRT_Error* inner = api->PJRT_Error_GetCode(&args);
    if (inner == nullptr) {
      out = std::string(CodeName(args.code)) + ": " + out;
    } else if (XLAKIT_PJRT_HAS(api, PJRT_Error_Destroy)) {
      auto destroy = Make<PJRT_Error_Destroy_Args>();
      destroy.error = inner;
      api->PJRT_Error_Destroy(&destroy);
    }
  }
  if (XLAKIT_PJRT_HAS(api, PJRT_Error_Destroy)) {
    auto args = Make<PJRT_Error_Destroy_Args>();
    args.error = error;
    api->PJRT_Error_Destroy(&args);
  }
  return out;
}

bool PlatformName(const PJRT_Api* api, PJRT_Client* client, std::string* out,
                  std::string* error) {
  auto args = Make<PJRT_Client_PlatformName_Args>();
  args.client = client;
  if (!Call(api, api->PJRT_Client_PlatformName, &args, "PlatformName", error)) {
    return false;
  }
  out->assign(args.platform_name ? args.platform_name : "",
              args.platform_name ? args.platform_name_size : 0);
  return true;
}

bool PlatformVersion(const PJRT_Api* api, PJRT_Client* client,
                     std::string* out, std::string* error) {
  auto args = Make<PJRT_Client_PlatformVersion_Args>();
  args.client = client;
  if (!Call(api, api->PJRT_Client_PlatformVersion, &args, "PlatformVersion",
            error)) {
    return false;
  }
  out->assign(args.platform_version ? args.platform_version : "",
              args.platform_version ? args.platform_version_size : 0);
  return true;
}

namespace {

// The serialized topology of the client, or "" where the plugin has none (an
// older plugin, or one that does not implement it): the device list alone
// keys those.
std::string SerializedTopology(const PJRT_Api* api, PJRT_Client* client) {
  if (!XLAKIT_PJRT_HAS(api, PJRT_Client_TopologyDescription) ||
      !XLAKIT_PJRT_HAS(api, PJRT_TopologyDescription_Serialize)) {
    return "";
  }
  std::string ignored;
  auto topo = Make<PJRT_Client_TopologyDescription_Args>();
  topo.client = client;
  if (!Call(api, api->PJRT_Client_TopologyDescription, &topo,
            "Client_TopologyDescription", &ignored) ||
      topo.topology == nullptr) {
    return "";
  }
  auto ser = Make<PJRT_TopologyDescription_Serialize_Args>();
  ser.topology = topo.topology;
  if (!Call(api, api->PJRT_TopologyDescription_Serialize, &ser,
            "TopologyDescription_Serialize", &ignored)) {
    return "";
  }
  std::string out(ser.serialized_bytes ? ser.serialized_bytes : "",
                  ser.serialized_bytes ? ser.serialized_bytes_size : 0);
  if (ser.serialized_topology_deleter && ser.serialized_topology) {
    ser.serialized_topology_deleter(ser.serialized_topology);
  }
  return out;
}

}  // namespace

bool DescribeTopology(const PJRT_Api* api, PJRT_Client* client,
                      std::string* out, std::string* source,
                      std::string* error) {
  auto devices = Make<PJRT_Client_Devices_Args>();
  devices.client = client;
  if (!Call(api, api->PJRT_Client_Devices, &devices, "Client_Devices",
            error)) {
    return false;
  }
  std::string kinds;
  std::set<int> processes;
  for (size_t i = 0; i < devices.num_devices; ++i) {
    auto desc = Make<PJRT_Device_GetDescription_Args>();
    desc.device = devices.devices[i];
    if (!Call(api, api->PJRT_Device_GetDescription, &desc,
              "Device_GetDescription", error)) {
      return false;
    }
    auto process = Make<PJRT_DeviceDescription_ProcessIndex_Args>();
    process.device_description = desc.device_description;
    auto kind = Make<PJRT_DeviceDescription_Kind_Args>();
    kind.device_description = desc.device_description;
    if (!Call(api, api->PJRT_DeviceDescription_ProcessIndex, &process,
              "DeviceDescription_ProcessIndex", error) ||
        !Call(api, api->PJRT_DeviceDescription_Kind, &kind,
              "DeviceDescription_Kind", error)) {
      return false;
    }
    processes.insert(process.process_index);
    kinds += std::string(kind.device_kind, kind.device_kind_size) + "\n";
  }
  std::string topology = SerializedTopology(api, client);
  *source = topology.empty() ? "devices" : "topology+devices";
  // Length-prefixed: the serialized topology is binary.
  *out = "topology " + std::to_string(topology.size()) + "\n" + topology +
         "\ndevices " + std::to_string(devices.num_devices) + " processes " +
         std::to_string(processes.size()) + "\n" + kinds;
  return true;
}

bool SerializeExecutable(const PJRT_Api* api, PJRT_LoadedExecutable* loaded,
                         std::string* out, std::string* error) {
  auto get = Make<PJRT_LoadedExecutable_GetExecutable_Args>();
  get.loaded_executable = loaded;
  if (!Call(api, api->PJRT_LoadedExecutable_GetExecutable, &get,
            "LoadedExecutable_GetExecutable", error)) {
    return false;
  }
  auto ser = Make<PJRT_Executable_Serialize_Args>();
  ser.executable = get.executable;
  bool ok = Call(api, api->PJRT_Executable_Serialize, &ser,
                 "Executable_Serialize", error);
  if (ok) {
    out->assign(ser.serialized_bytes ? ser.serialized_bytes : "",
                ser.serialized_bytes ? ser.serialized_bytes_size : 0);
    if (ser.serialized_executable_deleter && ser.serialized_executable) {
      ser.serialized_executable_deleter(ser.serialized_executable);
    }
  }
  auto destroy = Make<PJRT_Executable_Destroy_Args>();
  destroy.executable = get.executable;
  std::string ignored;
  Call(api, api->PJRT_Executable_Destroy, &destroy, "Executable_Destroy",
       &ignored);
  return ok;
}

bool DeserializeAndLoad(const PJRT_Api* api, PJRT_Client* client,
                        std::string_view serialized,
                        PJRT_LoadedExecutable** out, std::string* error) {
  auto args = Make<PJRT_Executable_DeserializeAndLoad_Args>();
  args.client = client;
  args.serialized_executable = serialized.data();
  args.serialized_executable_size = serialized.size();
  if (!Call(api, api->PJRT_Executable_DeserializeAndLoad, &args,
            "Executable_DeserializeAndLoad", error)) {
    return false;
  }
  *out = args.loaded_executable;
  return *out != nullptr;
}

}  // namespace pjrt_wrap
}  // namespace xlakit
