// Python bindings for the cache folder trust rule (core/folder_trust.h): the
// one implementation both xlakit.enable_persistent_cache and the PJRT
// wrapping plugin judge folders with.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include "bindings.h"
#include "core/folder_trust.h"

namespace py = pybind11;

namespace xlakit {

void BindTrust(py::module_& m) {
  m.attr("OWNER_ONLY") = kOwnerOnly;
  m.attr("SHARED_TRUSTED") = kSharedTrusted;
  m.attr("UNTRUSTED") = kUntrusted;
  m.def(
      "judge_cache_folder",
      [](const std::string& folder, bool trust_shared, bool entries) {
        FolderTrust t;
        {
          py::gil_scoped_release release;  // stats every folder up to /
          t = JudgeCacheFolder(folder, trust_shared, entries);
        }
        py::dict d;
        d["folder"] = t.folder;
        d["state"] = t.state;
        d["problem"] = t.problem.empty() ? py::none() : py::cast(t.problem);
        d["fix"] = t.fix.empty() ? py::none() : py::cast(t.fix);
        d["shared"] = py::tuple(py::cast(t.shared));
        d["not_a_folder"] = t.not_a_folder;
        return d;
      },
      py::arg("folder"), py::kw_only(), py::arg("trust_shared") = false,
      py::arg("entries") = true,
      "Who can put an entry into `folder` (see core/folder_trust.h): "
      "{folder, state, problem, fix, shared, not_a_folder}; `entries`: the "
      "files in it judged too (one stat each).");
}

}  // namespace xlakit
