"""Small PJRT plugins that sit between a framework and the plugin it loads, for tests only.

Each is C compiled here against the `pjrt_c_api.h` the wrapper is built with; each loads the next plugin
(`SHIM_NEXT`), copies its table and replaces one function.

`program_shim`'s PJRT_Client_Compile, in front of the wrapper, changes the program the wrapper sees: it
records each program (`SHIM_RECORD_DIR`, how tests/runtime/programs/ was captured), replaces one that holds
the bytes `SHIM_MATCH` with the file `SHIM_REPLACE` (the review's MLIR pair, fed through jax), or appends the
file `SHIM_APPEND` to every HLO program (appended protobuf fields are parsed as fields of the module: the
review's frontend attributes, grafted onto torch_xla's real programs).
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.support import REPO

_PROGRAM_SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include "xla/pjrt/c/pjrt_c_api.h"
static _Alignas(16) char table[16384];  /* the next table may be newer (larger) than this header's */
static const PJRT_Api* next;
static int count;

static char* slurp(const char* path, size_t* size) {
  FILE* f = fopen(path, "rb");
  if (!f) { perror(path); abort(); }
  fseek(f, 0, SEEK_END);
  *size = (size_t)ftell(f);
  fseek(f, 0, SEEK_SET);
  char* data = malloc(*size ? *size : 1);
  if (fread(data, 1, *size, f) != *size) abort();
  fclose(f);
  return data;
}

static PJRT_Error* Compile(PJRT_Client_Compile_Args* args) {
  const PJRT_Program* given = args->program;
  PJRT_Program program = *given;
  char* owned = NULL;
  const char* record = getenv("SHIM_RECORD_DIR");
  if (record) {
    char path[4096];
    snprintf(path, sizeof path, "%s/%03d.%.*s", record, count++, (int)given->format_size, given->format);
    FILE* f = fopen(path, "wb");
    if (!f) { perror(path); abort(); }
    fwrite(given->code, 1, given->code_size, f);
    fclose(f);
  }
  const char* match = getenv("SHIM_MATCH");
  const char* replace = getenv("SHIM_REPLACE");
  const char* append = getenv("SHIM_APPEND");
  if (match && replace && memmem(given->code, given->code_size, match, strlen(match))) {
    owned = slurp(replace, &program.code_size);
    program.code = owned;
  } else if (append && given->format_size == 3 && memcmp(given->format, "hlo", 3) == 0) {
    size_t extra = 0;
    char* tail = slurp(append, &extra);
    owned = malloc(given->code_size + extra);
    memcpy(owned, given->code, given->code_size);
    memcpy(owned + given->code_size, tail, extra);
    free(tail);
    program.code = owned;
    program.code_size = given->code_size + extra;
  }
  args->program = &program;
  PJRT_Error* error = next->PJRT_Client_Compile(args);
  args->program = given;
  free(owned);
  return error;
}

const PJRT_Api* GetPjrtApi(void) {
  void* h = dlopen(getenv("SHIM_NEXT"), RTLD_NOW | RTLD_LOCAL);
  if (!h) { fprintf(stderr, "%s\n", dlerror()); return NULL; }
  next = ((const PJRT_Api* (*)(void))dlsym(h, "GetPjrtApi"))();
  if (next == NULL || next->struct_size > sizeof table) return NULL;
  memcpy(table, next, next->struct_size);
  ((PJRT_Api*)table)->PJRT_Client_Compile = Compile;
  return (const PJRT_Api*)table;
}
"""


# A fake, by necessity: no allocation can be made to fail on demand otherwise. Preloaded, it replaces the
# process's operator new; while FAIL_NEW_FROM is set, an allocation made on behalf of xlakit's wrapper (its
# library on the call stack) is counted, and from the FAIL_NEW_FROM-th one on ("N+") or only that one ("N")
# it throws std::bad_alloc, as with no memory left. FAIL_NEW_REPORT=1 prints the count at exit.
_FAIL_NEW = r"""
#include <dlfcn.h>
#include <elf.h>
#include <execinfo.h>
#include <link.h>
#include <atomic>
#include <cstdint>
#include <mutex>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>

static thread_local bool inside = false;
static std::atomic<long> counted{0};
static long from = -2;
static bool onward = false;

// Whether the code that asked is the wrapper's: the first caller outside this library and libstdc++ (whose
// std::string and containers allocate for their callers). The direct caller decides most allocations
// cheaply; only those libstdc++ makes are traced further.
enum Origin { kWrapper, kLibstdcxx, kOther };

// The executable ranges of the wrapper, libstdc++ and this library, read again whenever a library was loaded
// (dladdr on every allocation would take minutes in torch's start).
struct Range { uintptr_t lo = 0, hi = 0; };
static Range wrapper_range, libstdcxx_range, self_range;
static unsigned long long scanned_adds = ~0ull;
static std::mutex ranges_mu;

static int PeekAdds(struct dl_phdr_info* info, size_t, void* out) {
  *static_cast<unsigned long long*>(out) = info->dlpi_adds;
  return 1;
}

static int Scan(struct dl_phdr_info* info, size_t, void*) {
  const char* name = info->dlpi_name ? info->dlpi_name : "";
  Range* r = strstr(name, "libxlakit_pjrt_wrap") ? &wrapper_range
             : strstr(name, "libstdc++")         ? &libstdcxx_range
             : strstr(name, "libfail_new")       ? &self_range
                                                 : nullptr;
  if (r == nullptr) return 0;
  for (int i = 0; i < info->dlpi_phnum; ++i) {
    const ElfW(Phdr)& ph = info->dlpi_phdr[i];
    if (ph.p_type != PT_LOAD || !(ph.p_flags & PF_X)) continue;
    r->lo = info->dlpi_addr + ph.p_vaddr;
    r->hi = r->lo + ph.p_memsz;
  }
  return 0;
}

static Origin OriginOf(void* address) {
  {
    std::lock_guard<std::mutex> lock(ranges_mu);
    unsigned long long adds = 0;
    dl_iterate_phdr(PeekAdds, &adds);
    if (adds != scanned_adds) {
      scanned_adds = adds;
      dl_iterate_phdr(Scan, nullptr);
    }
  }
  const uintptr_t a = reinterpret_cast<uintptr_t>(address);
  if (a >= wrapper_range.lo && a < wrapper_range.hi) return kWrapper;
  if ((a >= libstdcxx_range.lo && a < libstdcxx_range.hi) || (a >= self_range.lo && a < self_range.hi)) {
    return kLibstdcxx;
  }
  return kOther;
}

static bool FromWrapper(void* caller) {
  Origin first = OriginOf(caller);
  if (first != kLibstdcxx) return first == kWrapper;
  void* frames[10];
  int n = backtrace(frames, 10);
  for (int i = 1; i < n; ++i) {
    Origin o = OriginOf(frames[i]);
    if (o != kLibstdcxx) return o == kWrapper;
  }
  return false;
}

static bool Fail(void* caller) {
  if (inside) return false;
  inside = true;
  if (from == -2) {
    const char* v = getenv("FAIL_NEW_FROM");
    from = v ? atol(v) : -1;
    onward = v && strchr(v, '+');
  }
  bool fail = false;
  if (from >= 0 && FromWrapper(caller)) {
    long k = ++counted;
    fail = from > 0 && (onward ? k >= from : k == from);
  }
  inside = false;
  return fail;
}

static void Report() {
  if (getenv("FAIL_NEW_REPORT")) fprintf(stderr, "fail_new: %ld allocations on behalf of the wrapper\n", counted.load());
}
__attribute__((constructor)) static void Init() { atexit(Report); }

void* operator new(size_t size) {
  if (Fail(__builtin_return_address(0))) throw std::bad_alloc();
  void* p = malloc(size ? size : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new[](size_t size) {
  if (Fail(__builtin_return_address(0))) throw std::bad_alloc();
  void* p = malloc(size ? size : 1);
  if (!p) throw std::bad_alloc();
  return p;
}
void* operator new(size_t size, const std::nothrow_t&) noexcept {
  try { return operator new(size); } catch (...) { return nullptr; }
}
void* operator new[](size_t size, const std::nothrow_t&) noexcept {
  try { return operator new(size); } catch (...) { return nullptr; }
}
void* operator new(size_t size, std::align_val_t align) {
  if (Fail(__builtin_return_address(0))) throw std::bad_alloc();
  void* p = nullptr;
  if (posix_memalign(&p, static_cast<size_t>(align) < sizeof(void*) ? sizeof(void*) : static_cast<size_t>(align),
                     size ? size : 1)) throw std::bad_alloc();
  return p;
}
void* operator new[](size_t size, std::align_val_t align) { return operator new(size, align); }
void operator delete(void* p) noexcept { free(p); }
void operator delete[](void* p) noexcept { free(p); }
void operator delete(void* p, size_t) noexcept { free(p); }
void operator delete[](void* p, size_t) noexcept { free(p); }
void operator delete(void* p, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { free(p); }
void operator delete(void* p, size_t, std::align_val_t) noexcept { free(p); }
void operator delete[](void* p, size_t, std::align_val_t) noexcept { free(p); }
"""


def fail_new_preload(folder: Path) -> Path:
    """The allocation-failing preload (a fake), built in `folder`."""
    src = folder / "fail_new.cc"
    src.write_text(_FAIL_NEW)
    lib = folder / "libfail_new.so"
    subprocess.run(["c++", "-std=c++17", "-O1", "-shared", "-fPIC", "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


def compile_plugin(source: str, folder: Path, name: str) -> Path:
    """`source` (C) built as `folder/lib<name>.so` against the PJRT header the wrapper is built with."""
    sys.path.insert(0, str(REPO / "build"))
    try:
        import pjrt_header

        include = pjrt_header.include_dir(REPO / "VERSIONS.toml")
    finally:
        sys.path.pop(0)
    src = folder / f"{name}.c"
    src.write_text(source)
    lib = folder / f"lib{name}.so"
    subprocess.run(["cc", "-shared", "-fPIC", "-I", str(include), "-o", str(lib), str(src), "-ldl"], check=True)
    return lib


def program_shim(folder: Path) -> Path:
    """The program-changing shim, built in `folder`."""
    return compile_plugin(_PROGRAM_SHIM, folder, "program_shim")
