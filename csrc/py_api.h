// What the bindings of xlakit._C share: owned references, argument
// conversion, errors and the GIL, over the CPython limited API only.
//
// The limited API (the stable ABI) is what lets one `_C.abi3.so` serve every
// Python from the floor setup.py passes as Py_LIMITED_API (pyproject's
// requires-python) upwards, so one wheel covers all of them
// (docs/building.md, "One wheel for every Python"). pybind11 cannot build for
// it; these few helpers replace what the bindings used of it.
//
// A binding body runs inside Guard(): it throws ErrorSet once a Python
// exception is set (Raise() sets one), and Guard turns that, and any C++
// exception, into the NULL return CPython expects.
#ifndef XLAKIT_PY_API_H_
#define XLAKIT_PY_API_H_

#ifndef Py_LIMITED_API
#error "xlakit._C builds against the limited API: pass -DPy_LIMITED_API (setup.py does)"
#endif
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <cstdint>
#include <exception>
#include <new>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace xlakit::py {

// A Python exception is set; the binding edge returns NULL.
struct ErrorSet {};

// Sets `type(message)` and throws ErrorSet.
[[noreturn]] void Raise(PyObject* type, const std::string& message);

// An owned reference (never NULL once made: a NULL result throws ErrorSet).
class Ref {
 public:
  Ref() = default;
  // Takes ownership of a new reference from a CPython call.
  static Ref Steal(PyObject* o) {
    if (o == nullptr) throw ErrorSet{};
    return Ref(o);
  }
  static Ref Borrow(PyObject* o) {
    Py_XINCREF(o);
    return Ref(o);
  }
  Ref(Ref&& other) noexcept : o_(std::exchange(other.o_, nullptr)) {}
  Ref& operator=(Ref&& other) noexcept {
    std::swap(o_, other.o_);
    return *this;
  }
  Ref(const Ref&) = delete;
  Ref& operator=(const Ref&) = delete;
  ~Ref() { Py_XDECREF(o_); }
  PyObject* get() const { return o_; }
  PyObject* release() { return std::exchange(o_, nullptr); }

 private:
  explicit Ref(PyObject* o) : o_(o) {}
  PyObject* o_ = nullptr;
};

// Python values from C++ ones.
Ref None();
Ref Bool(bool v);
Ref Int(int64_t v);
Ref UInt(uint64_t v);
Ref Bytes(std::string_view s);
// A str; bytes that are not UTF-8 (header fields read from disk may be
// corrupt) are replaced, never a UnicodeDecodeError.
Ref Text(std::string_view s);
// Text(s), or None for "" (the core's "nothing to report").
Ref TextOrNone(std::string_view s);
Ref TupleOf(std::vector<Ref> items);
Ref List(std::vector<Ref> items);
template <typename... Item>
Ref Tuple(Item&&... items) {
  std::vector<Ref> v;
  v.reserve(sizeof...(Item));
  (v.push_back(std::forward<Item>(items)), ...);
  return TupleOf(std::move(v));
}

// A dict filled key by key.
class Dict {
 public:
  Dict() : d_(Ref::Steal(PyDict_New())) {}
  void Set(const char* key, Ref value);
  Ref Done() { return std::move(d_); }

 private:
  Ref d_;
};

// Arguments, each named in the TypeError it raises. `o` may be NULL (an
// argument not given) only for the optional ones, as may Py_None.
std::string_view BytesView(PyObject* o, const char* name);
std::string String(PyObject* o, const char* name);
std::optional<std::string> OptionalString(PyObject* o, const char* name);
bool Truth(PyObject* o, bool missing);
int64_t Int64(PyObject* o, const char* name);
uint64_t UInt64(PyObject* o, const char* name);
std::vector<int64_t> Int64List(PyObject* o, const char* name);
std::vector<std::string> StringList(PyObject* o, const char* name);

// PyArg_ParseTupleAndKeywords with a list of names (NULL-terminated).
template <typename... Out>
void Parse(PyObject* args, PyObject* kwargs, const char* format,
           const char* const* names, Out*... out) {
  if (!PyArg_ParseTupleAndKeywords(args, kwargs, format,
                                   const_cast<char**>(names), out...)) {
    throw ErrorSet{};
  }
}

// The one argument of a function that takes one, by position or `name`.
PyObject* OneArg(PyObject* args, PyObject* kwargs, const char* name);

// The GIL released for a scope (around every blocking native call).
class NoGil {
 public:
  NoGil() : state_(PyEval_SaveThread()) {}
  ~NoGil() { PyEval_RestoreThread(state_); }
  NoGil(const NoGil&) = delete;
  NoGil& operator=(const NoGil&) = delete;

 private:
  PyThreadState* state_;
};

// The GIL taken for a scope, from any thread.
class WithGil {
 public:
  WithGil() : state_(PyGILState_Ensure()) {}
  ~WithGil() { PyGILState_Release(state_); }
  WithGil(const WithGil&) = delete;
  WithGil& operator=(const WithGil&) = delete;

 private:
  PyGILState_STATE state_;
};

// Runs a binding body that returns a Ref; failures become a set exception.
template <typename Body>
PyObject* Guard(Body&& body) noexcept {
  try {
    return body().release();
  } catch (const ErrorSet&) {
    return nullptr;
  } catch (const std::bad_alloc&) {
    return PyErr_NoMemory();
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
    return nullptr;
  }
}

// A function of the module: f(args, kwargs) -> Ref, with its docstring.
using Body = Ref (*)(PyObject* args, PyObject* kwargs);
template <Body F>
PyObject* Entry(PyObject*, PyObject* args, PyObject* kwargs) {
  return Guard([&] { return F(args, kwargs); });
}
template <Body F>
PyMethodDef Method(const char* name, const char* doc) {
  return {name, reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(&Entry<F>)),
          METH_VARARGS | METH_KEYWORDS, doc};
}

// Module attributes.
void AddStr(PyObject* m, const char* name, std::string_view value);
void AddBytes(PyObject* m, const char* name, std::string_view value);
void AddInt(PyObject* m, const char* name, uint64_t value);
// `methods` ends with a {nullptr} entry and must outlive the module.
void AddFunctions(PyObject* m, PyMethodDef* methods);

}  // namespace xlakit::py

#endif  // XLAKIT_PY_API_H_
