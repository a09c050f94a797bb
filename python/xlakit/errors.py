"""xlakit's exceptions: a small set, each also a builtin so existing handlers work.

`except TimeoutError` catches a checkpoint timeout, `except OSError` a write
failure, `except ValueError` a corrupt file. Every message says what was
expected, what was found and how to fix it; hints go in `add_note`.
"""

from __future__ import annotations


class XlakitError(Exception):
    """Base of every error xlakit raises on purpose."""


class CheckpointError(XlakitError):
    """Base of checkpoint save/load errors."""


class CheckpointTimeoutError(CheckpointError, TimeoutError):
    """The save or load ran past its deadline.

    Attributes name where it stopped: `stage` (sync, transfer, write, commit,
    ...), `tensor` (the one in flight, or None), `bytes_done`, `elapsed_s`.
    """

    def __init__(self, message: str, *, stage: str, tensor: str | None = None,
                 bytes_done: int = 0, elapsed_s: float = 0.0, rank: int | None = None):
        super().__init__(message)
        self.stage = stage
        self.tensor = tensor
        self.bytes_done = bytes_done
        self.elapsed_s = elapsed_s
        self.rank = rank

    def __reduce__(self):
        # DCP sends a rank's exception to the others pickled; the default reduction would call
        # __init__ without the keyword-only `stage` and fail on the receiving rank.
        return _rebuild, (type(self), self.args, self.__dict__)


def _rebuild(cls: type, args: tuple, state: dict) -> BaseException:
    err = cls.__new__(cls)
    Exception.__init__(err, *args)
    err.__dict__.update(state)
    return err


class CheckpointCorruptError(CheckpointError, ValueError):
    """The file does not match what was written (checksum, truncation, structure)."""

    def __init__(self, message: str, *, tensor: str | None = None):
        super().__init__(message)
        self.tensor = tensor


class CheckpointIncompleteError(CheckpointCorruptError):
    """A multi-file checkpoint has no commit record or misses a shard."""


class CheckpointFormatError(CheckpointError, ValueError):
    """The file is a readable checkpoint but not one xlakit can verify."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """A checkpoint does not fit the template it is restored into (keys, shapes, dtypes).

    `problems` lists every difference, one message each; nothing was changed.
    """

    def __init__(self, message: str, *, problems: list[str] | None = None):
        super().__init__(message)
        self.problems = list(problems or [])

    def __reduce__(self):
        return _rebuild, (type(self), self.args, self.__dict__)


class CheckpointSerializationError(CheckpointError, TypeError):
    """The state holds an object a weights-only checkpoint cannot store."""


class CheckpointWriteError(CheckpointError, OSError):
    """Writing failed (no folder, no permission, disk full); the old file is intact."""


class CheckpointConflictError(CheckpointError, FileExistsError):
    """Another save committed the same checkpoint first (object storage: its create-only commit
    record won); this save committed nothing and removed what it uploaded."""


class CheckpointBusyError(CheckpointError, RuntimeError):
    """An earlier save is still running (async, or abandoned after a timeout)."""


class CheckpointAsyncError(CheckpointError, RuntimeError):
    """An earlier asynchronous save failed and nobody asked its handle; raised by the next save."""


class CheckpointPeerError(CheckpointError, RuntimeError):
    """Another rank of a coordinated save failed; carries that rank and its error."""

    def __init__(self, message: str, *, rank: int | None = None):
        super().__init__(message)
        self.rank = rank


class ConfigurationError(XlakitError, ValueError):
    """An xlakit environment variable (`XLAKIT_*`) holds a value that cannot be used; the message
    names the variable and its value."""


class RuntimeFeatureError(XlakitError, NotImplementedError):
    """The running torch_xla lacks what was asked (stock build, unsupported platform)."""


class PinsError(XlakitError, ValueError):
    """The pins file (baked VERSIONS.toml) is missing, malformed or lacks a profile."""


class RunContractError(XlakitError, ValueError):
    """The run's environment breaks the contract (a removed libtpu flag, SPMD without
    `XLA_NO_SPECIAL_SCALARS=1`). `violations` lists each, one message per entry."""

    def __init__(self, message: str, *, violations: list[str] | None = None):
        super().__init__(message)
        self.violations = list(violations or [])


class CompileCacheError(XlakitError, RuntimeError):
    """The persistent compilation cache cannot be enabled as asked."""


class CacheFolderTrustError(CompileCacheError, PermissionError):
    """Someone other than the user (and root) can put an entry into the cache folder; names the fix."""


def with_hints(message: str, error: BaseException) -> str:
    """`message` (the error's, as a command prints it), then each hint `error` carries (`add_note`: how to fix
    it) on a line of its own, indented: what a command prints instead of a traceback."""
    return "\n".join([message, *(f"  {note}" for note in getattr(error, "__notes__", ()))])
