// Python bindings for the cache folder trust rule (core/folder_trust.h): the
// one implementation both xlakit.enable_persistent_cache and the PJRT
// wrapping plugin judge folders with.
// Python.h (through bindings.h) comes first, as CPython requires.
#include "bindings.h"

#include <string>
#include <vector>

#include "core/folder_trust.h"

namespace xlakit {
namespace {

py::Ref JudgeFolder(PyObject* args, PyObject* kwargs) {
  static const char* kNames[] = {"folder", "trust_shared", "entries", nullptr};
  PyObject *folder = nullptr, *trust_shared = nullptr, *entries = nullptr;
  py::Parse(args, kwargs, "O|$OO", kNames, &folder, &trust_shared, &entries);
  std::string path = py::String(folder, "folder");
  bool shared = py::Truth(trust_shared, false);
  bool judge_entries = py::Truth(entries, true);
  FolderTrust t;
  {
    py::NoGil nogil;  // stats every folder up to /
    t = JudgeCacheFolder(path, shared, judge_entries);
  }
  std::vector<py::Ref> shared_items;
  for (const std::string& s : t.shared) shared_items.push_back(py::Text(s));
  py::Dict d;
  d.Set("folder", py::Text(t.folder));
  d.Set("state", py::Text(t.state));
  d.Set("problem", py::TextOrNone(t.problem));
  d.Set("fix", py::TextOrNone(t.fix));
  d.Set("shared", py::TupleOf(std::move(shared_items)));
  d.Set("not_a_folder", py::Bool(t.not_a_folder));
  return d.Done();
}

PyMethodDef kMethods[] = {
    py::Method<JudgeFolder>(
        "judge_cache_folder",
        "judge_cache_folder(folder, *, trust_shared=False, entries=True)\n\n"
        "Who can put an entry into `folder` (see core/folder_trust.h): "
        "{folder, state, problem, fix, shared, not_a_folder}; `entries`: the "
        "files in it judged too (one stat each)."),
    {nullptr, nullptr, 0, nullptr},
};

}  // namespace

void BindTrust(PyObject* m) {
  py::AddStr(m, "OWNER_ONLY", kOwnerOnly);
  py::AddStr(m, "SHARED_TRUSTED", kSharedTrusted);
  py::AddStr(m, "UNTRUSTED", kUntrusted);
  py::AddFunctions(m, kMethods);
}

}  // namespace xlakit
