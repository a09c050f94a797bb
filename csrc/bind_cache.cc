// Python bindings for the cache entry envelope and atomic writes.
// Python.h (through bindings.h) comes first, as CPython requires.
#include "bindings.h"

#include <optional>
#include <string>

#include "core/atomic_file.h"
#include "core/envelope.h"

namespace xlakit {
namespace {

EntryKind KindFromName(const std::string& name) {
  if (name == EntryKindName(EntryKind::kExecutable)) {
    return EntryKind::kExecutable;
  }
  if (name == EntryKindName(EntryKind::kHloModule)) {
    return EntryKind::kHloModule;
  }
  py::Raise(PyExc_ValueError,
            "kind must be 'executable' or 'hlo_module', got '" + name + "'");
}

py::Ref ResultToDict(const DecodeResult& r) {
  py::Dict d;
  d.Set("status", py::Text(EntryStatusName(r.status)));
  d.Set("ok", py::Bool(r.status == EntryStatus::kOk));
  d.Set("message", py::Text(r.message));
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
  auto text = [parsed](const std::string& s) {
    return parsed ? py::Text(s) : py::None();
  };
  d.Set("format_version", parsed ? py::UInt(h.format_version) : py::None());
  d.Set("kind", parsed ? py::Text(EntryKindName(h.kind)) : py::None());
  d.Set("platform_name", text(h.platform_name));
  d.Set("platform_version", text(h.platform_version));
  d.Set("torch_xla_revision", text(h.torch_xla_revision));
  d.Set("patch_series_id", text(h.patch_series_id));
  d.Set("cache_key", text(h.cache_key));
  d.Set("payload_length", parsed ? py::UInt(h.payload_length) : py::None());
  d.Set("authenticated", py::Bool(r.authenticated));
  d.Set("tag_checked", py::Bool(r.tag_checked));
  return d.Done();
}

// EntryMac over Python's hmac (HMAC-SHA256), so xlakit._C links no crypto
// library; the runtime's is core/entry_mac_openssl.h. Made and destroyed with
// the GIL held; its methods take the GIL, so they may run in a nogil section.
class PyEntryMac : public EntryMac {
 public:
  explicit PyEntryMac(PyObject* key) {
    py::Ref hmac = py::Ref::Steal(PyImport_ImportModule("hmac"));
    py::Ref make = py::Ref::Steal(PyObject_GetAttrString(hmac.get(), "new"));
    py::Ref args = py::Tuple(py::Ref::Borrow(key));
    py::Dict kwargs;
    kwargs.Set("digestmod", py::Text("sha256"));
    mac_ = py::Ref::Steal(
        PyObject_Call(make.get(), args.get(), kwargs.Done().get()));
    compare_ =
        py::Ref::Steal(PyObject_GetAttrString(hmac.get(), "compare_digest"));
  }
  ~PyEntryMac() override {
    py::WithGil gil;
    mac_ = py::Ref();
    compare_ = py::Ref();
  }
  void Update(std::string_view data) override {
    py::WithGil gil;
    py::Ref view = py::Ref::Steal(PyMemoryView_FromMemory(
        const_cast<char*>(data.data()), static_cast<Py_ssize_t>(data.size()),
        PyBUF_READ));
    py::Ref::Steal(PyObject_CallMethod(mac_.get(), "update", "(O)", view.get()));
  }
  std::string Tag() override {
    py::WithGil gil;
    return std::string(py::BytesView(Digest().get(), "digest()"));
  }
  bool Matches(std::string_view tag) override {
    py::WithGil gil;
    py::Ref found = Digest();
    py::Ref wanted = py::Bytes(tag);
    py::Ref same = py::Ref::Steal(PyObject_CallFunctionObjArgs(
        compare_.get(), found.get(), wanted.get(), nullptr));
    return py::Truth(same.get(), false);
  }

 private:
  py::Ref Digest() {
    return py::Ref::Steal(PyObject_CallMethod(mac_.get(), "digest", nullptr));
  }
  py::Ref mac_;
  py::Ref compare_;
};

std::optional<PyEntryMac> MacFor(PyObject* key) {
  if (key == nullptr || key == Py_None) return std::nullopt;
  if (py::BytesView(key, "key").empty()) {
    py::Raise(PyExc_ValueError, "key must not be empty");
  }
  return std::optional<PyEntryMac>(std::in_place, key);
}

// All three identity fields, or none (check integrity only); the torch_xla
// revision, compared when given, only together with them.
std::optional<RuntimeIdentity> Identity(PyObject* platform_name,
                                        PyObject* platform_version,
                                        PyObject* patch_series_id,
                                        PyObject* torch_xla_revision) {
  std::optional<std::string> name =
      py::OptionalString(platform_name, "platform_name");
  std::optional<std::string> version =
      py::OptionalString(platform_version, "platform_version");
  std::optional<std::string> series =
      py::OptionalString(patch_series_id, "patch_series_id");
  std::optional<std::string> revision =
      py::OptionalString(torch_xla_revision, "torch_xla_revision");
  int given = !!name + !!version + !!series;
  if ((given != 0 && given != 3) || (given == 0 && revision)) {
    py::Raise(PyExc_ValueError,
              "pass all of platform_name, platform_version and "
              "patch_series_id to check an entry against a runtime, or none "
              "(torch_xla_revision only together with them)");
  }
  if (given == 0) return std::nullopt;
  return RuntimeIdentity{*name, *version, *series, revision.value_or("")};
}

py::Ref KeyProblem(PyObject* args, PyObject* kwargs) {
  PyObject* key = py::OneArg(args, kwargs, "key");
  return py::TextOrNone(CacheKeyProblem(py::BytesView(key, "key")));
}

py::Ref KeyId(PyObject* args, PyObject* kwargs) {
  PyObject* key = py::OneArg(args, kwargs, "key");
  py::BytesView(key, "key");  // bytes, never None
  std::optional<PyEntryMac> mac = MacFor(key);
  return py::Text(CacheKeyId(*mac));
}

py::Ref Encode(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {
      "payload",         "kind", "platform_name", "platform_version",
      "torch_xla_revision", "patch_series_id", "key", "cache_key", nullptr};
  PyObject *payload = nullptr, *kind = nullptr, *platform_name = nullptr,
           *platform_version = nullptr, *torch_xla_revision = nullptr,
           *patch_series_id = nullptr, *key = nullptr, *cache_key = nullptr;
  py::Parse(args, kwargs, "O|$OOOOOOO", kNames, &payload, &kind,
            &platform_name, &platform_version, &torch_xla_revision,
            &patch_series_id, &key, &cache_key);
  std::string_view data = py::BytesView(payload, "payload");
  EntryHeader h;
  h.kind = KindFromName(py::String(kind, "kind"));
  h.platform_name = py::String(platform_name, "platform_name");
  h.platform_version = py::String(platform_version, "platform_version");
  h.torch_xla_revision = py::String(torch_xla_revision, "torch_xla_revision");
  h.patch_series_id = py::String(patch_series_id, "patch_series_id");
  h.cache_key = cache_key ? py::String(cache_key, "cache_key") : "";
  std::optional<PyEntryMac> mac = MacFor(key);
  return py::Bytes(mac ? EncodeAuthenticatedEntry(h, data, *mac)
                       : EncodeEntry(h, data));
}

py::Ref InspectHeader(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"prefix", "total_size", nullptr};
  PyObject *prefix = nullptr, *total_size = nullptr;
  py::Parse(args, kwargs, "OO", kNames, &prefix, &total_size);
  return ResultToDict(DecodeCacheHeader(
      py::BytesView(prefix, "prefix"), py::UInt64(total_size, "total_size")));
}

py::Ref Verify(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {
      "data", "platform_name", "platform_version", "patch_series_id",
      "torch_xla_revision", "key", "expected_key", nullptr};
  PyObject *data = nullptr, *platform_name = nullptr,
           *platform_version = nullptr, *patch_series_id = nullptr,
           *torch_xla_revision = nullptr, *key = nullptr,
           *expected_key = nullptr;
  py::Parse(args, kwargs, "O|$OOOOOO", kNames, &data, &platform_name,
            &platform_version, &patch_series_id, &torch_xla_revision, &key,
            &expected_key);
  std::string_view view = py::BytesView(data, "data");
  std::optional<RuntimeIdentity> self = Identity(
      platform_name, platform_version, patch_series_id, torch_xla_revision);
  std::optional<std::string> expected =
      py::OptionalString(expected_key, "expected_key");
  std::optional<PyEntryMac> mac = MacFor(key);
  DecodeResult r;
  {
    // The checksum walks the whole payload; let other threads run.
    py::NoGil nogil;
    r = VerifyCacheEntry(view, self ? &*self : nullptr, mac ? &*mac : nullptr,
                         expected ? &*expected : nullptr);
  }
  return ResultToDict(r);
}

py::Ref VerifyFile(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {
      "path", "platform_name", "platform_version", "patch_series_id",
      "torch_xla_revision", "key", "chunk_bytes", "expected_key", nullptr};
  PyObject *path = nullptr, *platform_name = nullptr,
           *platform_version = nullptr, *patch_series_id = nullptr,
           *torch_xla_revision = nullptr, *key = nullptr,
           *chunk_bytes = nullptr, *expected_key = nullptr;
  py::Parse(args, kwargs, "O|$OOOOOOO", kNames, &path, &platform_name,
            &platform_version, &patch_series_id, &torch_xla_revision, &key,
            &chunk_bytes, &expected_key);
  std::string file = py::String(path, "path");
  std::optional<RuntimeIdentity> self = Identity(
      platform_name, platform_version, patch_series_id, torch_xla_revision);
  uint64_t chunk =
      chunk_bytes ? py::UInt64(chunk_bytes, "chunk_bytes") : uint64_t{1} << 20;
  if (chunk == 0) py::Raise(PyExc_ValueError, "chunk_bytes must be > 0");
  std::optional<std::string> expected =
      py::OptionalString(expected_key, "expected_key");
  std::optional<PyEntryMac> mac = MacFor(key);
  DecodeResult r;
  std::string error;
  {
    py::NoGil nogil;
    r = VerifyEntryFile(file, self ? &*self : nullptr, mac ? &*mac : nullptr,
                        static_cast<size_t>(chunk), &error,
                        expected ? &*expected : nullptr);
  }
  if (!error.empty()) py::Raise(PyExc_OSError, error);
  return ResultToDict(r);
}

py::Ref KeyMaterial(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"platform_name", "platform_version",
                                 "patch_series_id", "key_id", nullptr};
  PyObject *platform_name = nullptr, *platform_version = nullptr,
           *patch_series_id = nullptr, *key_id = nullptr;
  py::Parse(args, kwargs, "|$OOOO", kNames, &platform_name, &platform_version,
            &patch_series_id, &key_id);
  // The revision is not part of the key material (the series id covers it).
  RuntimeIdentity self{py::String(platform_name, "platform_name"),
                       py::String(platform_version, "platform_version"),
                       py::String(patch_series_id, "patch_series_id"), ""};
  return py::Bytes(
      CacheKeyMaterial(self, key_id ? py::String(key_id, "key_id") : ""));
}

py::Ref TempTarget(PyObject* args, PyObject* kwargs) {
  PyObject* name = py::OneArg(args, kwargs, "name");
  return py::TextOrNone(TempFileTarget(py::String(name, "name")));
}

py::Ref WriteAtomic(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"path", "data", nullptr};
  PyObject *path = nullptr, *data = nullptr;
  py::Parse(args, kwargs, "OO", kNames, &path, &data);
  std::string file = py::String(path, "path");
  std::string_view view = py::BytesView(data, "data");
  std::string error;
  {
    py::NoGil nogil;
    error = WriteFileAtomic(file, view);
  }
  if (!error.empty()) py::Raise(PyExc_OSError, error);
  return py::None();
}

PyMethodDef kMethods[] = {
    py::Method<KeyProblem>("cache_key_problem",
                           "cache_key_problem(key) -> why the job key may not "
                           "be used, or None"),
    py::Method<KeyId>("cache_key_id",
                      "cache_key_id(key) -> the key's id (reveals nothing of "
                      "it)"),
    py::Method<Encode>(
        "encode_entry",
        "encode_entry(payload, *, kind, platform_name, platform_version, "
        "torch_xla_revision, patch_series_id, key=None, cache_key='') -> "
        "bytes"),
    py::Method<InspectHeader>("inspect_header",
                              "inspect_header(prefix, total_size) -> dict"),
    py::Method<Verify>(
        "verify_entry",
        "verify_entry(data, *, platform_name=None, platform_version=None, "
        "patch_series_id=None, torch_xla_revision=None, key=None, "
        "expected_key=None) -> dict"),
    py::Method<VerifyFile>(
        "verify_entry_file",
        "verify_entry_file(path, *, platform_name=None, "
        "platform_version=None, patch_series_id=None, "
        "torch_xla_revision=None, key=None, chunk_bytes=1 << 20, "
        "expected_key=None) -> dict; OSError when it cannot be read"),
    py::Method<KeyMaterial>(
        "cache_key_material",
        "cache_key_material(*, platform_name, platform_version, "
        "patch_series_id, key_id='') -> bytes"),
    py::Method<TempTarget>("temp_file_target",
                           "temp_file_target(name) -> the file an atomic "
                           "write's temporary is for, or None"),
    py::Method<WriteAtomic>("write_file_atomic",
                            "write_file_atomic(path, data); OSError naming "
                            "the path"),
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void BindCache(PyObject* m) {
  py::AddBytes(m, "ENVELOPE_MAGIC", std::string_view(kEnvelopeMagic, 4));
  py::AddInt(m, "ENVELOPE_FORMAT_VERSION", kEnvelopeFormatVersion);
  py::AddStr(m, "TEMP_PREFIX", kTempPrefix);
  py::AddBytes(m, "AUTH_MAGIC", std::string_view(kAuthMagic, 4));
  py::AddStr(m, "CACHE_KEY_ENV", kCacheKeyEnv);
  py::AddInt(m, "MIN_CACHE_KEY_BYTES", kMinCacheKeyBytes);
  // Enough bytes to decode any header, plain or authenticated.
  py::AddInt(m, "MAX_HEADER_BYTES", kAuthPrefixBytes + kMaxHeaderBytes);
  py::AddFunctions(m, kMethods);
}

}  // namespace xlakit
