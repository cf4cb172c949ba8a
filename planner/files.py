"""Reading and writing user-facing files: paths checked before the work, atomic writes, strict
JSON.

What a path may be. An input (a problem, graph, device, plan or model file) must be a regular
file, or a symlink to one: a directory, FIFO, socket or device (/dev/null, /dev/stdin
included) is refused at once with one `LayerwiseError` (`read_bytes_checked`,
`read_text_checked`, `read_json_checked`; a FIFO would block the reader for ever, and a
device is not a file one could give twice). The kind is checked before opening (a device is
never opened) and again on the opened file (opened without blocking, then fstat), so a FIFO
swapped in between cannot hang the read.
An output is written only to a new name or over a regular file; a symlink is followed
(every level) and the file it leads to is written, so the link stays a link; a symlink loop
and every other kind of file (directory, FIFO, socket, character or block device,
/dev/null included) are refused, and nothing is written: a rename would replace the device
node with a regular file, and writing into it in place would block (a FIFO with no reader)
or silently throw the plan away (/dev/null). To keep no file, leave the output option out.
A file appended to in place (a log file: `check_output_path(..., append=True)`) may also be
a character device (/dev/null, /dev/stderr) or a FIFO some process reads.

A command that will write a file checks its path first (`check_output_path`: it creates and
removes a probe file in the directory, so a directory no file can be made in, such as /proc,
is refused too), so a typo in a directory name is one error at once, not after a 60 s search.
Files are written to a temporary file in the same directory and renamed over the target
(`write_text_atomic`), flushed to disk before the rename: an interrupted or failed write
never leaves half a plan behind. A new file gets the permissions any new file gets (0666
less the user's umask), a file replaced keeps its own, and a failed write names the user's
path, not the temporary one. JSON written or printed for machines is
strict (`strict_json`): infinities and NaN become null (Python's default would write
`Infinity`, which is not JSON).
"""

from __future__ import annotations

import contextlib
import errno
import json
import math
import os
import secrets
import stat
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, TextIO

from planner.errors import LayerwiseError

__all__ = [
    "check_input_file",
    "check_output_path",
    "finite_or_none",
    "open_text_atomic",
    "read_bytes_checked",
    "read_json_checked",
    "read_text_checked",
    "strict_json",
    "write_text_atomic",
]


def _special(mode: int) -> str | None:
    """What a file of this `st_mode` is when it is not a regular file ("a FIFO", ...)."""
    for test, kind in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return kind
    return None if stat.S_ISREG(mode) else "not a regular file"


# ----------------------------------------------------------------------------- reading


def read_bytes_checked(
    path: str | Path, what: str = "input", error: type[LayerwiseError] = LayerwiseError
) -> bytes:
    """The bytes of the regular file `path` (or of the file its symlinks lead to).

    Every failure is one `error` naming `what` and `path`: missing, a symlink loop, not
    readable, or not a regular file (a directory, FIFO, socket or device: refused at once,
    never read, so a FIFO cannot block)."""
    try:
        # a device is not opened at all (opening one may act on it), a FIFO not waited on
        _refuse_special(os.stat(path).st_mode, path, what, error)
        # O_NONBLOCK: a FIFO swapped in since opens without waiting for a writer
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        dangling = " (a symlink to a missing file)" if Path(path).is_symlink() else ""
        raise error(f"{what} file {path} does not exist{dangling}") from None
    except OSError as exc:
        raise _read_error(path, what, error, exc) from None
    with os.fdopen(fd, "rb") as f:
        _refuse_special(os.fstat(fd).st_mode, path, what, error)
        try:
            return f.read()
        except OSError as exc:
            raise _read_error(path, what, error, exc) from None


def check_input_file(
    path: str | Path, what: str = "input", error: type[LayerwiseError] = LayerwiseError
) -> None:
    """One `error` when `path` exists but is no regular file (a directory, FIFO, socket or
    device) or is a symlink loop; nothing otherwise (a missing file is for the reader to say).

    For code that only sniffs a file before reading it: the check opens nothing."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise _read_error(path, what, error, exc) from None
        return
    _refuse_special(mode, path, what, error)


def _refuse_special(mode: int, path: str | Path, what: str, error: type[LayerwiseError]) -> None:
    kind = _special(mode)
    if kind is not None:
        raise error(f"{what} path {path} is {kind}, not a file: give a regular file")


def _read_error(
    path: str | Path, what: str, error: type[LayerwiseError], exc: OSError
) -> LayerwiseError:
    if exc.errno == errno.ELOOP:
        return error(f"{what} path {path} is a symlink loop: give a regular file")
    if exc.errno == errno.EISDIR:
        return error(f"{what} path {path} is a directory, not a file: give a regular file")
    return error(f"cannot read {what} file {path}: {exc.strerror or exc}")


def read_text_checked(
    path: str | Path, what: str = "input", error: type[LayerwiseError] = LayerwiseError
) -> str:
    """The UTF-8 text of the regular file `path` (`read_bytes_checked`'s checks); text that
    is not UTF-8 is one `error` too."""
    try:
        return read_bytes_checked(path, what, error).decode("utf-8")
    except UnicodeDecodeError:
        raise error(f"{what} file {path} is not text (expected UTF-8 JSON)") from None


def read_json_checked(
    path: str | Path, what: str = "input", error: type[LayerwiseError] = LayerwiseError
) -> Any:
    """The parsed JSON of the regular file `path`; every failure is one `error` naming it."""
    text = read_text_checked(path, what, error)
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise error(f"{what} file {path} is not valid JSON: {exc}") from None
    except RecursionError:
        raise error(f"{what} file {path} is nested too deeply") from None


# ----------------------------------------------------------------------------- writing


def _output_target(path: Path, what: str) -> Path:
    """The file a write to `path` creates or replaces: `path`, or where its symlinks lead.

    One LayerwiseError for a symlink loop or a target that exists and is not a regular file
    (see the module docstring)."""
    target = path
    if path.is_symlink():
        try:
            target = Path(os.path.realpath(path, strict=True))
        except FileNotFoundError:  # a dangling link: its target is created, as `>` would
            target = Path(os.path.realpath(path))
        except OSError as exc:
            if exc.errno != errno.ELOOP:
                raise LayerwiseError(f"cannot write {what} {path}: {exc.strerror}") from None
            raise LayerwiseError(
                f"cannot write {what} {path}: it is a symlink loop: give a file name"
            ) from None
    try:
        mode = os.stat(target).st_mode
    except FileNotFoundError:
        return target
    except OSError as exc:
        raise LayerwiseError(f"cannot write {what} {path}: {exc.strerror or exc}") from None
    kind = _special(mode)
    if kind == "a directory":
        raise LayerwiseError(f"{what} path {path} is a directory: give a file name")
    if kind is not None:
        raise LayerwiseError(
            f"cannot write {what} {path}: it is {kind}, not a regular file: give a file name "
            "(or leave the option out to write no file)"
        )
    return target


def check_output_path(path: str | Path, what: str = "output", append: bool = False) -> Path:
    """`path` as a Path when a file can be written there; else one `LayerwiseError` that says
    why (its directory is missing or not a directory, it is a directory, a FIFO, socket or
    device, a symlink loop, or not writable). A symlink is checked as the file it leads to.

    `append`: the file is opened in place and appended to (a log file), not replaced: a
    character device (/dev/null, /dev/stderr on a terminal) is accepted, and so is a FIFO
    some process reads (/dev/stderr into a pipe); a FIFO no process reads is refused (opening
    it would wait for one)."""
    path = Path(path)
    if append and _appendable_in_place(path, what):
        return path
    target = _output_target(path, what)
    parent = target.parent if str(target.parent) else Path(".")
    if not parent.exists():
        raise LayerwiseError(
            f"cannot write {what} {path}: directory {parent} does not exist (create it first)"
        )
    if not parent.is_dir():
        raise LayerwiseError(f"cannot write {what} {path}: {parent} is not a directory")
    if not os.access(parent, os.W_OK) or (target.exists() and not os.access(target, os.W_OK)):
        raise LayerwiseError(f"cannot write {what} {path}: permission denied")
    try:  # os.access says yes to root everywhere, and nothing says whether /proc takes files
        fd, probe = _create_temporary(target, ".probe")
    except OSError as exc:
        raise LayerwiseError(
            f"cannot write {what} {path}: no file can be created in {parent} ({exc.strerror})"
        ) from None
    os.close(fd)
    probe.unlink(missing_ok=True)
    return path


def _appendable_in_place(path: Path, what: str) -> bool:
    """Whether `path` leads to a character device, or a FIFO with a reader (False for a
    regular or missing file: the usual checks apply)."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISCHR(mode):
        return True
    if not stat.S_ISFIFO(mode):
        return False
    try:  # without O_NONBLOCK this waits for a reader; with it, no reader is ENXIO
        os.close(os.open(path, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC))
    except OSError:
        raise LayerwiseError(
            f"cannot write {what} {path}: it is a FIFO no process reads (writing would wait "
            "for one): start the reader first, or give a file name"
        ) from None
    return True


def _create_temporary(path: Path, suffix: str) -> tuple[int, Path]:
    """A new hidden file beside `path`, open for writing, mode 0666 less the umask (mkstemp's
    would be 0600, which a rename would give the user's file)."""
    for _ in range(100):
        tmp = path.parent / f".{path.name}.{secrets.token_hex(4)}{suffix}"
        try:
            return os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), tmp
        except FileExistsError:
            continue
    raise FileExistsError(f"no free temporary name beside {path}")


@contextlib.contextmanager
def open_text_atomic(path: str | Path, what: str = "output") -> Iterator[TextIO]:
    """A text file to write `path` through: a temporary file in the same directory, renamed
    over the target when the block ends without an exception (removed otherwise).

    The same rules as `write_text_atomic`; for a file written piece by piece."""
    path = Path(path)
    target = _output_target(path, what)
    try:
        fd, tmp = _create_temporary(target, ".tmp")
    except OSError as exc:
        raise LayerwiseError(f"cannot write {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            yield f
            f.flush()
            os.fsync(f.fileno())  # on disk before the rename: a crash leaves old or new, whole
        _output_target(path, what)  # again, just before the rename: nothing special appeared
        with contextlib.suppress(FileNotFoundError):  # a file replaced keeps its permissions
            os.chmod(tmp, stat.S_IMODE(os.stat(target).st_mode))
        os.replace(tmp, target)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        raise LayerwiseError(f"cannot write {path}: {exc.strerror or exc}") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


def write_text_atomic(path: str | Path, text: str, what: str = "output") -> None:
    """Write `text` to `path` through a temporary file in the same directory and a rename.

    A symlink is followed: the file it leads to is replaced and the link stays. A target that
    is a directory, FIFO, socket or device is refused (nothing written). A new file gets the
    user's umask, a replaced one keeps its permissions; a failure is one LayerwiseError
    naming `path`."""
    with open_text_atomic(path, what) as f:
        f.write(text)


def finite_or_none(value: Any) -> Any:
    """A float that is inf or NaN becomes None; anything else is returned unchanged."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    return value


def _sanitize(value: Any) -> Any:
    if isinstance(value, float):
        return finite_or_none(value)
    if isinstance(value, Mapping):
        return {str(k): _sanitize(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_sanitize(v) for v in value]
    if hasattr(value, "item") and callable(value.item):  # numpy scalars
        return _sanitize(value.item())
    return value


def strict_json(value: Any, indent: int | None = None) -> str:
    """JSON text of `value` with every inf/NaN float written as null (RFC 8259 JSON)."""
    return json.dumps(_sanitize(value), indent=indent, allow_nan=False)
