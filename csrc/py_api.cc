// The helpers of py_api.h, over the CPython limited API.
#include "py_api.h"

namespace xlakit::py {

void Raise(PyObject* type, const std::string& message) {
  PyErr_SetString(type, message.c_str());
  throw ErrorSet{};
}

Ref None() { return Ref::Borrow(Py_None); }

Ref Bool(bool v) { return Ref::Borrow(v ? Py_True : Py_False); }

Ref Int(int64_t v) { return Ref::Steal(PyLong_FromLongLong(v)); }

Ref UInt(uint64_t v) { return Ref::Steal(PyLong_FromUnsignedLongLong(v)); }

Ref Bytes(std::string_view s) {
  return Ref::Steal(
      PyBytes_FromStringAndSize(s.data(), static_cast<Py_ssize_t>(s.size())));
}

Ref Text(std::string_view s) {
  return Ref::Steal(PyUnicode_DecodeUTF8(
      s.data(), static_cast<Py_ssize_t>(s.size()), "replace"));
}

Ref TextOrNone(std::string_view s) { return s.empty() ? None() : Text(s); }

Ref TupleOf(std::vector<Ref> items) {
  Ref t = Ref::Steal(PyTuple_New(static_cast<Py_ssize_t>(items.size())));
  for (size_t i = 0; i < items.size(); ++i) {
    // PyTuple_SetItem steals the reference, even when it fails.
    if (PyTuple_SetItem(t.get(), static_cast<Py_ssize_t>(i),
                        items[i].release()) != 0) {
      throw ErrorSet{};
    }
  }
  return t;
}

Ref List(std::vector<Ref> items) {
  Ref l = Ref::Steal(PyList_New(static_cast<Py_ssize_t>(items.size())));
  for (size_t i = 0; i < items.size(); ++i) {
    if (PyList_SetItem(l.get(), static_cast<Py_ssize_t>(i),
                       items[i].release()) != 0) {
      throw ErrorSet{};
    }
  }
  return l;
}

void Dict::Set(const char* key, Ref value) {
  if (PyDict_SetItemString(d_.get(), key, value.get()) != 0) throw ErrorSet{};
}

namespace {

[[noreturn]] void WrongType(const char* name, const char* expected,
                            PyObject* found) {
  Ref type = Ref::Steal(PyObject_Type(found));
  Ref type_name = Ref::Steal(PyObject_GetAttrString(type.get(), "__name__"));
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(type_name.get(), &size);
  if (text == nullptr) throw ErrorSet{};
  Raise(PyExc_TypeError, std::string(name) + " must be " + expected +
                             ", not " + std::string(text, size));
}

bool Missing(PyObject* o) { return o == nullptr || o == Py_None; }

// PyArg_ParseTupleAndKeywords takes keyword-only arguments as optional only:
// a required one not given arrives here as NULL.
void Required(PyObject* o, const char* name) {
  if (o == nullptr) {
    Raise(PyExc_TypeError,
          std::string("missing required argument '") + name + "'");
  }
}

}  // namespace

std::string_view BytesView(PyObject* o, const char* name) {
  Required(o, name);
  if (!PyBytes_Check(o)) WrongType(name, "bytes", o);
  char* data = nullptr;
  Py_ssize_t size = 0;
  if (PyBytes_AsStringAndSize(o, &data, &size) != 0) throw ErrorSet{};
  return std::string_view(data, static_cast<size_t>(size));
}

std::string String(PyObject* o, const char* name) {
  Required(o, name);
  if (!PyUnicode_Check(o)) WrongType(name, "str", o);
  Py_ssize_t size = 0;
  const char* text = PyUnicode_AsUTF8AndSize(o, &size);
  if (text == nullptr) throw ErrorSet{};
  return std::string(text, static_cast<size_t>(size));
}

std::optional<std::string> OptionalString(PyObject* o, const char* name) {
  if (Missing(o)) return std::nullopt;
  return String(o, name);
}

bool Truth(PyObject* o, bool missing) {
  if (o == nullptr) return missing;
  int truth = PyObject_IsTrue(o);
  if (truth < 0) throw ErrorSet{};
  return truth != 0;
}

int64_t Int64(PyObject* o, const char* name) {
  Required(o, name);
  if (!PyLong_Check(o)) WrongType(name, "int", o);
  long long v = PyLong_AsLongLong(o);
  if (v == -1 && PyErr_Occurred()) throw ErrorSet{};
  return v;
}

uint64_t UInt64(PyObject* o, const char* name) {
  Required(o, name);
  if (!PyLong_Check(o)) WrongType(name, "int", o);
  unsigned long long v = PyLong_AsUnsignedLongLong(o);
  if (v == static_cast<unsigned long long>(-1) && PyErr_Occurred()) {
    throw ErrorSet{};
  }
  return v;
}

namespace {

// Each item of a sequence (not a str or bytes), in order.
template <typename Item>
std::vector<Item> Items(PyObject* o, const char* name, const char* expected,
                        Item (*convert)(PyObject*, const char*)) {
  Required(o, name);
  if (!PySequence_Check(o) || PyUnicode_Check(o) || PyBytes_Check(o)) {
    WrongType(name, expected, o);
  }
  Py_ssize_t n = PySequence_Size(o);
  if (n < 0) throw ErrorSet{};
  std::vector<Item> out;
  out.reserve(static_cast<size_t>(n));
  std::string item_name = std::string("items of ") + name;
  for (Py_ssize_t i = 0; i < n; ++i) {
    Ref item = Ref::Steal(PySequence_GetItem(o, i));
    out.push_back(convert(item.get(), item_name.c_str()));
  }
  return out;
}

}  // namespace

std::vector<int64_t> Int64List(PyObject* o, const char* name) {
  return Items<int64_t>(o, name, "a sequence of int", &Int64);
}

std::vector<std::string> StringList(PyObject* o, const char* name) {
  return Items<std::string>(o, name, "a sequence of str", &String);
}

PyObject* OneArg(PyObject* args, PyObject* kwargs, const char* name) {
  const char* names[] = {name, nullptr};
  PyObject* arg = nullptr;
  Parse(args, kwargs, "O", names, &arg);
  return arg;
}

void AddStr(PyObject* m, const char* name, std::string_view value) {
  Ref v = Text(value);
  if (PyModule_AddObjectRef(m, name, v.get()) != 0) throw ErrorSet{};
}

void AddBytes(PyObject* m, const char* name, std::string_view value) {
  Ref v = Bytes(value);
  if (PyModule_AddObjectRef(m, name, v.get()) != 0) throw ErrorSet{};
}

void AddInt(PyObject* m, const char* name, uint64_t value) {
  Ref v = UInt(value);
  if (PyModule_AddObjectRef(m, name, v.get()) != 0) throw ErrorSet{};
}

void AddFunctions(PyObject* m, PyMethodDef* methods) {
  if (PyModule_AddFunctions(m, methods) != 0) throw ErrorSet{};
}

}  // namespace xlakit::py
