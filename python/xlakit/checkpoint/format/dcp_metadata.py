"""A DCP checkpoint's `.metadata`, read without running pickled code (`xlakit ckpt`).

torch.distributed.checkpoint writes `.metadata` with pickle and reads it with
`pickle.load`, which runs whatever the file names: a tampered folder or
bucket would run code the moment anyone looked into it. The readers here
unpickle it with an allowlist of what DCP's metadata is made of (its own
metadata classes, `torch.Size`, dtypes, layouts and memory formats, paths);
anything else is refused, naming it, and never called.
"""

from __future__ import annotations

import pickle
from typing import Any

import torch

from xlakit.errors import CheckpointFormatError

_DCP_MODULES = ("torch.distributed.checkpoint.metadata", "torch.distributed.checkpoint.planner")
# DCP's StorageMeta.checkpoint_id is the path saved to; Python 3.13 pickles paths as pathlib._local's.
_PATHS = {(module, name) for module in ("pathlib", "pathlib._local")
          for name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath")}
_ALLOWED = {("torch.distributed.checkpoint.filesystem", "_StorageInfo"), ("torch", "Size"),
            ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"), *_PATHS}
_TORCH_VALUES = (torch.dtype, torch.layout, torch.memory_format)


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: Any, where: str):
        super().__init__(file)
        self.where = where

    def find_class(self, module: str, name: str) -> Any:
        found = super().find_class(module, name) if self._allowed(module, name) else None
        if found is None:
            err = CheckpointFormatError(f"{self.where}: its DCP .metadata names {module}.{name}, which is not "
                                        f"part of DCP's metadata; refused (xlakit never runs pickled code)")
            err.refused = f"{module}.{name}"  # a class the allowlist lacks (the file itself is readable)
            raise err
        return found

    @staticmethod
    def _allowed(module: str, name: str) -> bool:
        if (module, name) in _ALLOWED:
            return True
        if module in _DCP_MODULES:
            import importlib

            return isinstance(getattr(importlib.import_module(module), name, None), type)
        return module == "torch" and isinstance(getattr(torch, name, None), _TORCH_VALUES)


def load(stream: Any, where: str) -> Any:
    """The metadata pickled in `stream` (the `.metadata` of the checkpoint at `where`)."""
    try:
        return _Unpickler(stream, where).load()
    except CheckpointFormatError:
        raise
    except Exception as e:  # noqa: BLE001 - a damaged or foreign file, said in one line
        raise CheckpointFormatError(f"{where}: its DCP .metadata cannot be read ({type(e).__name__}: {e})") from e


def folder_reader(path: Any) -> Any:
    """A DCP reader of the local folder `path` whose metadata is read through the allowlist."""
    from torch.distributed.checkpoint import FileSystemReader

    class Reader(SafeMetadata, FileSystemReader):
        pass

    return Reader(str(path))


class SafeMetadata:
    """Mixed into a DCP storage reader (before it): `read_metadata` through the allowlist."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        from torch.distributed.checkpoint.metadata import StorageMeta

        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            metadata = load(f, str(self.path))
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata
