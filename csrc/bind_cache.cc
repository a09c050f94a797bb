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
                r.status == EntryStatus::kTorchXlaRevisionMismatch ||
                r.status == EntryStatus::kKeyMismatch;
  const EntryHeader& h = r.header;
  d["format_version"] = parsed ? py::cast(h.format_version) : py::none();
  d["kind"] = parsed ? py::cast(EntryKindName(h.kind)) : py::none();
  d["platform_name"] = parsed ? Text(h.platform_name) : py::none();
  d["platform_version"] = parsed ? Text(h.platform_version) : py::none();
  d["torch_xla_revision"] = parsed ? Text(h.torch_xla_revision) : py::none();
  d["patch_series_id"] = parsed ? Text(h.patch_series_id) : py::none();
  d["cache_key"] = parsed ? Text(h.cache_key) : py::none();
  d["payload_length"] = parsed ? py::cast(h.payload_length) : py::none();
  d["authenticated"] = r.authenticated;
  d["tag_checked"] = r.tag_checked;
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

// EntryMac over Python's hmac (HMAC-SHA256), so xlakit._C links no crypto
// library; the runtime's is core/entry_mac_openssl.h. Made and destroyed with
// the GIL held; its methods take the GIL, so they may run in a nogil section.
class PyEntryMac : public EntryMac {
 public:
  explicit PyEntryMac(const py::bytes& key) {
    py::module_ hmac = py::module_::import("hmac");
    mac_ = hmac.attr("new")(key, py::arg("digestmod") = "sha256");
    compare_ = hmac.attr("compare_digest");
  }
  void Update(std::string_view data) override {
    py::gil_scoped_acquire gil;
    mac_.attr("update")(py::memoryview::from_memory(data.data(),
                                                     data.size()));
  }
  std::string Tag() override {
    py::gil_scoped_acquire gil;
    return mac_.attr("digest")().cast<std::string>();
  }
  bool Matches(std::string_view tag) override {
    py::gil_scoped_acquire gil;
    return compare_(mac_.attr("digest")(), py::bytes(tag.data(), tag.size()))
        .cast<bool>();
  }

 private:
  py::object mac_;
  py::object compare_;
};

std::optional<PyEntryMac> MacFor(const std::optional<py::bytes>& key) {
  if (!key) return std::nullopt;
  if (View(*key).empty()) throw py::value_error("key must not be empty");
  return std::optional<PyEntryMac>(std::in_place, *key);
}

// All three identity fields, or none (check integrity only); the torch_xla
// revision, compared when given, only together with them.
std::optional<RuntimeIdentity> Identity(
    const std::optional<std::string>& platform_name,
    const std::optional<std::string>& platform_version,
    const std::optional<std::string>& patch_series_id,
    const std::optional<std::string>& torch_xla_revision) {
  int given = !!platform_name + !!platform_version + !!patch_series_id;
  if ((given != 0 && given != 3) || (given == 0 && torch_xla_revision)) {
    throw py::value_error(
        "pass all of platform_name, platform_version and "
        "patch_series_id to check an entry against a runtime, or none "
        "(torch_xla_revision only together with them)");
  }
  if (given == 0) return std::nullopt;
  return RuntimeIdentity{*platform_name, *platform_version, *patch_series_id,
                         torch_xla_revision.value_or("")};
}

}  // namespace

void BindCache(py::module_& m) {
  m.attr("ENVELOPE_MAGIC") = py::bytes(kEnvelopeMagic, 4);
  m.attr("ENVELOPE_FORMAT_VERSION") = kEnvelopeFormatVersion;
  m.attr("TEMP_PREFIX") = kTempPrefix;
  m.attr("AUTH_MAGIC") = py::bytes(kAuthMagic, 4);
  m.attr("CACHE_KEY_ENV") = kCacheKeyEnv;
  m.attr("MIN_CACHE_KEY_BYTES") = kMinCacheKeyBytes;

  m.def(
      "cache_key_problem",
      [](py::bytes key) -> std::optional<std::string> {
        std::string problem = CacheKeyProblem(View(key));
        if (problem.empty()) return std::nullopt;
        return problem;
      },
      py::arg("key"));

  m.def(
      "cache_key_id",
      [](py::bytes key) {
        std::optional<PyEntryMac> mac = MacFor(key);
        return CacheKeyId(*mac);
      },
      py::arg("key"));

  m.def(
      "encode_entry",
      [](py::bytes payload, const std::string& kind,
         const std::string& platform_name, const std::string& platform_version,
         const std::string& torch_xla_revision,
         const std::string& patch_series_id, std::optional<py::bytes> key,
         const std::string& cache_key) {
        EntryHeader h;
        h.kind = KindFromName(kind);
        h.platform_name = platform_name;
        h.platform_version = platform_version;
        h.torch_xla_revision = torch_xla_revision;
        h.patch_series_id = patch_series_id;
        h.cache_key = cache_key;
        std::optional<PyEntryMac> mac = MacFor(key);
        std::string out = mac ? EncodeAuthenticatedEntry(h, View(payload), *mac)
                              : EncodeEntry(h, View(payload));
        return py::bytes(out);
      },
      py::arg("payload"), py::kw_only(), py::arg("kind"),
      py::arg("platform_name"), py::arg("platform_version"),
      py::arg("torch_xla_revision"), py::arg("patch_series_id"),
      py::arg("key") = py::none(), py::arg("cache_key") = "");

  m.def(
      "inspect_header",
      [](py::bytes prefix, uint64_t total_size) {
        return ResultToDict(DecodeCacheHeader(View(prefix), total_size));
      },
      py::arg("prefix"), py::arg("total_size"));

  m.def(
      "verify_entry",
      [](py::bytes data, std::optional<std::string> platform_name,
         std::optional<std::string> platform_version,
         std::optional<std::string> patch_series_id,
         std::optional<std::string> torch_xla_revision,
         std::optional<py::bytes> key,
         std::optional<std::string> expected_key) {
        std::optional<RuntimeIdentity> self = Identity(
            platform_name, platform_version, patch_series_id,
            torch_xla_revision);
        std::optional<PyEntryMac> mac = MacFor(key);
        std::string_view view = View(data);
        DecodeResult r;
        {
          // The checksum walks the whole payload; let other threads run.
          py::gil_scoped_release nogil;
          r = VerifyCacheEntry(view, self ? &*self : nullptr,
                               mac ? &*mac : nullptr,
                               expected_key ? &*expected_key : nullptr);
        }
        return ResultToDict(r);
      },
      py::arg("data"), py::kw_only(), py::arg("platform_name") = py::none(),
      py::arg("platform_version") = py::none(),
      py::arg("patch_series_id") = py::none(),
      py::arg("torch_xla_revision") = py::none(), py::arg("key") = py::none(),
      py::arg("expected_key") = py::none());

  // Enough bytes to decode any header, plain or authenticated.
  m.attr("MAX_HEADER_BYTES") = kAuthPrefixBytes + kMaxHeaderBytes;

  m.def(
      "verify_entry_file",
      [](const std::string& path, std::optional<std::string> platform_name,
         std::optional<std::string> platform_version,
         std::optional<std::string> patch_series_id,
         std::optional<std::string> torch_xla_revision,
         std::optional<py::bytes> key, size_t chunk_bytes,
         std::optional<std::string> expected_key) {
        std::optional<RuntimeIdentity> self = Identity(
            platform_name, platform_version, patch_series_id,
            torch_xla_revision);
        if (chunk_bytes == 0) throw py::value_error("chunk_bytes must be > 0");
        std::optional<PyEntryMac> mac = MacFor(key);
        DecodeResult r;
        std::string error;
        {
          py::gil_scoped_release nogil;
          r = VerifyEntryFile(path, self ? &*self : nullptr,
                              mac ? &*mac : nullptr, chunk_bytes, &error,
                              expected_key ? &*expected_key : nullptr);
        }
        if (!error.empty()) {
          PyErr_SetString(PyExc_OSError, error.c_str());
          throw py::error_already_set();
        }
        return ResultToDict(r);
      },
      py::arg("path"), py::kw_only(), py::arg("platform_name") = py::none(),
      py::arg("platform_version") = py::none(),
      py::arg("patch_series_id") = py::none(),
      py::arg("torch_xla_revision") = py::none(), py::arg("key") = py::none(),
      py::arg("chunk_bytes") = size_t{1} << 20,
      py::arg("expected_key") = py::none());

  m.def(
      "cache_key_material",
      [](const std::string& platform_name, const std::string& platform_version,
         const std::string& patch_series_id, const std::string& key_id) {
        // The revision is not part of the key material (the series id covers
        // it).
        return py::bytes(CacheKeyMaterial(
            RuntimeIdentity{platform_name, platform_version, patch_series_id,
                            ""},
            key_id));
      },
      py::kw_only(), py::arg("platform_name"), py::arg("platform_version"),
      py::arg("patch_series_id"), py::arg("key_id") = "");

  m.def(
      "temp_file_target",
      [](const std::string& name) -> std::optional<std::string> {
        std::string target = TempFileTarget(name);
        if (target.empty()) return std::nullopt;
        return target;
      },
      py::arg("name"));

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
