// Python bindings for the cache entry envelope and atomic writes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <optional>
#include <string>

#include "bindings.h"
#include "core/atomic_file.h"
#include "core/envelope.h"

namespace py = pybind11;

namespace xlakit {
namespace {

EntryKind KindFromName(const std::string& name) {
  if (name == EntryKindName(EntryKind::kExecutable)) {
    return EntryKind::kExecutable;
  }
  if (name == EntryKindName(EntryKind::kHloModule)) {
    return EntryKind::kHloModule;
  }
  throw py::value_error("kind must be 'executable' or 'hlo_module', got '" +
                        name + "'");
}

// Header strings come from disk and may be corrupt; never let a bad byte turn
// a report into a UnicodeDecodeError.
py::object Text(const std::string& s) {
  PyObject* obj = PyUnicode_DecodeUTF8(
      s.data(), static_cast<Py_ssize_t>(s.size()), "replace");
  if (obj == nullptr) throw py::error_already_set();
  return py::reinterpret_steal<py::object>(obj);
}

py::dict ResultToDict(const DecodeResult& r) {
  py::dict d;
  d["status"] = EntryStatusName(r.status);
  d["ok"] = r.status == EntryStatus::kOk;
  d["message"] = Text(r.message);
  // Header fields are only meaningful once the header parsed.
  bool parsed = r.status == EntryStatus::kOk ||
                r.status == EntryStatus::kChecksumMismatch ||
                r.status == EntryStatus::kTrailingBytes ||
                r.status == EntryStatus::kPlatformMismatch ||
                r.status == EntryStatus::kPlatformVersionMismatch ||
                r.status == EntryStatus::kPatchSeriesMismatch ||
                r.status == EntryStatus::kTorchXlaRevisionMismatch;
  const EntryHeader& h = r.header;
  d["format_version"] = parsed ? py::cast(h.format_version) : py::none();
  d["kind"] = parsed ? py::cast(EntryKindName(h.kind)) : py::none();
  d["platform_name"] = parsed ? Text(h.platform_name) : py::none();
  d["platform_version"] = parsed ? Text(h.platform_version) : py::none();
  d["torch_xla_revision"] = parsed ? Text(h.torch_xla_revision) : py::none();
  d["patch_series_id"] = parsed ? Text(h.patch_series_id) : py::none();
  d["payload_length"] = parsed ? py::cast(h.payload_length) : py::none();
  return d;
}

std::string_view View(const py::bytes& b) {
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(b.ptr(), &data, &size) != 0) {
    throw py::error_already_set();
  }
  return std::string_view(data, static_cast<size_t>(size));
}

}  // namespace

void BindCache(py::module_& m) {
  m.attr("ENVELOPE_MAGIC") = py::bytes(kEnvelopeMagic, 4);
  m.attr("ENVELOPE_FORMAT_VERSION") = kEnvelopeFormatVersion;
  m.attr("TEMP_PREFIX") = kTempPrefix;

  m.def(
      "encode_entry",
      [](py::bytes payload, const std::string& kind,
         const std::string& platform_name, const std::string& platform_version,
         const std::string& torch_xla_revision,
         const std::string& patch_series_id) {
        EntryHeader h;
        h.kind = KindFromName(kind);
        h.platform_name = platform_name;
        h.platform_version = platform_version;
        h.torch_xla_revision = torch_xla_revision;
        h.patch_series_id = patch_series_id;
        std::string out = EncodeEntry(h, View(payload));
        return py::bytes(out);
      },
      py::arg("payload"), py::kw_only(), py::arg("kind"),
      py::arg("platform_name"), py::arg("platform_version"),
      py::arg("torch_xla_revision"), py::arg("patch_series_id"));

  m.def(
      "inspect_header",
      [](py::bytes prefix, uint64_t total_size) {
        return ResultToDict(DecodeHeader(View(prefix), total_size));
      },
      py::arg("prefix"), py::arg("total_size"));

  m.def(
      "verify_entry",
      [](py::bytes data, std::optional<std::string> platform_name,
         std::optional<std::string> platform_version,
         std::optional<std::string> patch_series_id,
         std::optional<std::string> torch_xla_revision) {
        int given = !!platform_name + !!platform_version + !!patch_series_id;
        if ((given != 0 && given != 3) || (given == 0 && torch_xla_revision)) {
          throw py::value_error(
              "pass all of platform_name, platform_version and "
              "patch_series_id to check an entry against a runtime, or none "
              "(torch_xla_revision only together with them)");
        }
        std::string_view view = View(data);
        DecodeResult r;
        {
          // The checksum walks the whole payload; let other threads run.
          py::gil_scoped_release nogil;
          r = given == 3
                  ? VerifyEntry(
                        view, RuntimeIdentity{*platform_name, *platform_version,
                                              *patch_series_id,
                                              torch_xla_revision.value_or("")})
                  : DecodeEntry(view);
        }
        return ResultToDict(r);
      },
      py::arg("data"), py::kw_only(), py::arg("platform_name") = py::none(),
      py::arg("platform_version") = py::none(),
      py::arg("patch_series_id") = py::none(),
      py::arg("torch_xla_revision") = py::none());

  m.def(
      "cache_key_material",
      [](const std::string& platform_name, const std::string& platform_version,
         const std::string& patch_series_id) {
        return py::bytes(CacheKeyMaterial(
            RuntimeIdentity{platform_name, platform_version, patch_series_id}));
      },
      py::kw_only(), py::arg("platform_name"), py::arg("platform_version"),
      py::arg("patch_series_id"));

  m.def(
      "write_file_atomic",
      [](const std::string& path, py::bytes data) {
        std::string_view view = View(data);
        std::string error;
        {
          py::gil_scoped_release nogil;
          error = WriteFileAtomic(path, view);
        }
        if (!error.empty()) {
          PyErr_SetString(PyExc_OSError, error.c_str());
          throw py::error_already_set();
        }
      },
      py::arg("path"), py::arg("data"));
}

}  // namespace xlakit
