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
