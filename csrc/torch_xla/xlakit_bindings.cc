// xlakit's torch_xla._XLAC bindings; see xlakit_bindings.h. Names and return
// shapes are the contract with python/xlakit/runtime/features.py.
#include "torch_xla/csrc/xlakit/xlakit_bindings.h"

#include <pybind11/stl.h>

#include <torch/csrc/utils/pybind.h>

#include "absl/status/status.h"

#include "torch_xla/csrc/runtime/pjrt_computation_client.h"
#include "torch_xla/csrc/runtime/runtime.h"
#include "torch_xla/csrc/runtime/xlakit/build_info.h"
#include "torch_xla/csrc/runtime/xlakit/pjrt_access.h"
#include "torch_xla/csrc/xlakit/host_transfer.h"

namespace py = pybind11;

namespace torch_xla {
namespace xlakit {
namespace {

// Called with the GIL held, never inside a gil_scoped_release (raising
// without the GIL is a fatal interpreter error): maps a status to the
// builtin a Python caller expects (ValueError for a bad device,
// TimeoutError for a deadline, ...).
[[noreturn]] void Raise(const absl::Status& status) {
  PyObject* type = PyExc_RuntimeError;
  switch (status.code()) {
    case absl::StatusCode::kInvalidArgument:
      type = PyExc_ValueError;
      break;
    case absl::StatusCode::kDeadlineExceeded:
      type = PyExc_TimeoutError;
      break;
    case absl::StatusCode::kUnimplemented:
      type = PyExc_NotImplementedError;
      break;
    default:
      break;
  }
  PyErr_SetString(type, std::string(status.message()).c_str());
  throw py::error_already_set();
}

// Call without the GIL: the first call creates the client, which can start
// multi-host coordination and wait for the other hosts.
absl::StatusOr<runtime::PjRtComputationClient*> PjRtClient() {
  absl::StatusOr<runtime::ComputationClient*> client =
      runtime::GetComputationClient();
  if (!client.ok()) return client.status();
  auto* pjrt = dynamic_cast<runtime::PjRtComputationClient*>(*client);
  if (pjrt == nullptr) {
    return absl::UnimplementedError("xlakit bindings need the PJRT client");
  }
  return pjrt;
}

}  // namespace

void AddXlakitBindings(py::module& m) {
  m.def(
      "_xla_runtime_memory_info",
      [](const std::string& device) {
        absl::StatusOr<runtime::xlakit::RuntimeMemoryInfo> info;
        {
          // The client too is fetched without the GIL; Raise() needs it, so
          // errors are raised once it is held again.
          py::gil_scoped_release nogil;
          absl::StatusOr<runtime::PjRtComputationClient*> client = PjRtClient();
          info = client.ok() ? runtime::xlakit::PjRtAccess::GetRuntimeMemoryInfo(
                                   **client, device)
                             : absl::StatusOr<runtime::xlakit::RuntimeMemoryInfo>(
                                   client.status());
        }
        if (!info.ok()) Raise(info.status());
        py::dict d;
        d["bytes_used"] = info->bytes_used;
        d["bytes_limit"] =
            info->bytes_limit ? py::cast(*info->bytes_limit) : py::none();
        d["peak_bytes_used"] = info->peak_bytes_used
                                   ? py::cast(*info->peak_bytes_used)
                                   : py::none();
        return d;
      },
      py::arg("device"));

  m.def(
      "_xla_transfer_to_host",
      [](const std::vector<at::Tensor>& tensors, int64_t max_inflight_bytes,
         double timeout_s) {
        absl::StatusOr<std::vector<at::Tensor>> result;
        {
          py::gil_scoped_release nogil;
          result = TransferToHost(tensors, max_inflight_bytes, timeout_s);
        }
        if (!result.ok()) Raise(result.status());
        return *std::move(result);
      },
      py::arg("tensors"), py::kw_only(), py::arg("max_inflight_bytes"),
      py::arg("timeout_s"));

  m.def("_xlakit_build_info", []() {
    const runtime::xlakit::BuildInfo& info = runtime::xlakit::GetBuildInfo();
    py::dict d;
    d["patch_set"] = info.patch_set;
    d["patches"] = info.patches;
    d["series_sha256"] = info.series_sha256;
    d["sources_sha256"] = info.sources_sha256;
    // What entries carry and cache keys are salted with; the cache folder's
    // name and `xlakit cache verify` use this, never a copy of its recipe.
    d["patch_series_id"] = runtime::xlakit::PatchSeriesId();
    d["torch_xla_commit"] = info.torch_xla_commit;
    d["xla_commit"] = info.xla_commit;
    return d;
  });
}

}  // namespace xlakit
}  // namespace torch_xla
