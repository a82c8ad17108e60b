"""Spooled request bodies: large bodies live in an anonymous temporary file.

docs/design.md §2 ("the spool") is the spec. A body over ``spool_above_bytes``
(declared, or crossing it while read) is written, decoded and hashed as it
arrives, into a file that has no name: ``O_TMPFILE`` where the kernel and file
system have it (open(2), Linux >= 3.11), else ``mkstemp`` + ``unlink`` at once.
Either way a crash or ``kill -9`` leaves nothing behind in ``spool_dir`` (the
kernel frees the inode with its last descriptor) and no other user ever sees a
path to it (mode 0600). Downstream reads the body through one read-only
``mmap`` (file-backed pages, which the kernel can drop and re-read, not
anonymous memory), exposed as a read-only ``memoryview``.

Ownership: one :class:`SpoolFile` per spooled body, owned by its exchange from
its first byte (:meth:`proxy._exchange.Exchange.adopt_spool`) and closed at the
exchange's release boundary. :meth:`SpoolFile.close` closes the mapping and the
descriptor; a view of the mapping that some code (a plugin) still holds makes
``mmap.close`` raise ``BufferError``: that is reported once in the log and the
mapping is left to the garbage collector (its disk space goes back when the
last view goes), never a crash of the exchange.

:class:`Spool` is the per-process policy and budget: the directory, the
threshold, ``max_spool_bytes`` of spooled bytes in flight (503 before a body is
read when a declared one would not fit, or when a read grows past it), the
counters the metrics read, and one rate-limited warning for a full disk.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import stat
import tempfile
from collections.abc import Iterator
from typing import Final, Protocol

from ._coding import BodyError
from ._fdlimit import EXHAUSTED_MESSAGE, EXHAUSTION_ERRNOS

__all__ = [
    "FileSlice",
    "Spool",
    "SpoolBusy",
    "SpoolFile",
    "SpoolFull",
    "SpoolNoDescriptor",
    "SpoolUnavailable",
    "open_anonymous",
    "spool_dir_problem",
]

log = logging.getLogger("context_proxy.spool")

#: errno values that mean "this file system cannot take more bytes": a full disk,
#: a full quota, or the process's file-size limit (``RLIMIT_FSIZE``; CPython ignores
#: ``SIGXFSZ``, so the write fails with ``EFBIG`` instead of killing the process).
_FULL_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})

#: errno values of an ``O_TMPFILE`` open that mean "not supported here" (an old
#: kernel or a file system without it); any other error is a real one.
_NO_TMPFILE: Final = frozenset({errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL, errno.ENOENT})


class SpoolFull(BodyError):
    """503: the spool's file system refused more bytes (``ENOSPC``, ``EDQUOT``, ``EFBIG``).

    Retryable (answer with ``Retry-After``). By the time it reaches the client
    the partial file is closed and its space returned.
    """

    status = 503
    kind = "spool_full"

    def __init__(self) -> None:
        super().__init__("the proxy has no disk space left for request bodies; retry later")


class SpoolNoDescriptor(BodyError):
    """503: the process (or the system) is out of file descriptors (``EMFILE``,
    ``ENFILE``) for the spool's file or its mapping; the same answer as a request
    refused from the descriptor reserve (``fd_reserve``, proxy/_fdlimit.py)."""

    status = 503
    kind = "fd_reserve"

    def __init__(self) -> None:
        super().__init__(EXHAUSTED_MESSAGE)


class SpoolUnavailable(BodyError):
    """503: ``spool_dir`` could not open a file (removed or made unwritable after start-up)."""

    status = 503
    kind = "spool_unavailable"

    def __init__(self) -> None:
        super().__init__("the proxy cannot store large request bodies right now; retry later")


class SpoolBusy(BodyError):
    """503: ``max_spool_bytes`` of spooled bodies are in flight; retryable (``Retry-After``)."""

    status = 503
    kind = "spool_busy"

    def __init__(self) -> None:
        super().__init__("too many large request bodies are being held at once; retry later")


def open_anonymous(directory: str) -> int:
    """A new file in ``directory`` with no name, open read-write, mode 0600: its descriptor.

    ``O_TMPFILE`` when available; otherwise :func:`tempfile.mkstemp` (0600) and
    an immediate ``unlink``. The descriptor is close-on-exec.

    Raises:
        OSError: the directory is missing, not a directory, or not writable.
    """
    flag = getattr(os, "O_TMPFILE", 0)
    if flag:
        try:
            return os.open(directory, flag | os.O_RDWR | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            if exc.errno not in _NO_TMPFILE:
                raise
    fd, path = tempfile.mkstemp(dir=directory, prefix=".context-proxy-spool-")
    try:
        os.unlink(path)
    except BaseException:
        os.close(fd)
        raise
    return fd


def spool_dir_problem(directory: str) -> str | None:
    """Why ``directory`` cannot hold spooled bodies (one line), or ``None`` when it can.

    Opens and closes one anonymous file there (nothing is left behind).
    """
    try:
        info = os.stat(directory)
    except OSError as exc:
        return f"spool_dir: {directory!r} cannot be used: {exc.strerror}"
    if not stat.S_ISDIR(info.st_mode):
        return f"spool_dir: {directory!r} is not a directory"
    try:
        fd = open_anonymous(directory)
    except OSError as exc:
        return f"spool_dir: cannot create files in {directory!r}: {exc.strerror}"
    os.close(fd)
    return None


class FileSlice:
    """A range of a spooled body's file, to send upstream: with ``os.sendfile`` from
    descriptor ``fd`` at ``offset`` on a plain TCP connection, else by writing
    ``view`` (the same bytes, a read-only slice of the mapping: no heap copy).

    ``len()`` is its size in bytes. It holds an export of the mapping until dropped.
    """

    __slots__ = ("fd", "offset", "view")

    def __init__(self, fd: int, offset: int, view: memoryview) -> None:
        self.fd = fd
        self.offset = offset
        self.view = view

    def __len__(self) -> int:
        return len(self.view)


class SpoolFile:
    """One spooled body: an anonymous file, then its read-only mapping.

    Written with :meth:`write` while the body is read, then :meth:`map`\\ ped
    once; :meth:`close` (idempotent) closes both. ``size`` is the bytes written.

    Args:
        fd: the descriptor from :func:`open_anonymous`; owned from here on.
        owner: the :class:`Spool` whose budget and counters the file's bytes
            count against until it is closed (``None``: none).
    """

    __slots__ = ("__weakref__", "_fd", "_map", "_owner", "_view", "leaked", "size")

    def __init__(self, fd: int, owner: Spool | None = None) -> None:
        self._fd = fd
        self._map: mmap.mmap | None = None
        self._view: memoryview | None = None
        self._owner = owner
        self.size = 0
        #: Whether :meth:`close` found a view of the mapping still held (a plugin bug).
        self.leaked = False

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` ran."""
        return self._fd < 0

    @property
    def fileno(self) -> int:
        """The descriptor (for ``sendfile``); -1 once closed."""
        return self._fd

    @property
    def view(self) -> memoryview | None:
        """The read-only view :meth:`map` returned, until :meth:`close`; else ``None``."""
        return self._view

    def write(self, data: bytes | bytearray | memoryview) -> None:
        """Append ``data`` (all of it: a short write is continued).

        Raises:
            SpoolFull: the file system is full, a quota or ``RLIMIT_FSIZE`` hit.
            SpoolBusy: the bytes took the owner past ``max_spool_bytes``.
            OSError: any other write error.
            ValueError: the file is closed or already mapped.
        """
        if self._fd < 0 or self._map is not None:
            raise ValueError("write to a closed or mapped spool file")
        with memoryview(data) as whole, whole.cast("B") as view:
            done = 0
            total = len(view)
            while done < total:
                try:
                    done += os.write(self._fd, view[done:])
                except OSError as exc:
                    if exc.errno in _FULL_ERRNOS:
                        owner = self._owner
                        raise (owner.filled() if owner is not None else SpoolFull()) from None
                    raise
        self.size += total
        if self._owner is not None:
            self._owner.grow(total, self.size)

    def map(self) -> memoryview:
        """The body as a read-only ``memoryview`` of a read-only ``mmap`` of the file.

        Called once, after the last :meth:`write`. An empty file has no mapping
        (``mmap`` cannot map 0 bytes): its view is of ``b""``.

        Raises:
            ValueError: closed, or mapped before.
            OSError: ``mmap`` failed.
        """
        if self._fd < 0 or self._view is not None:
            raise ValueError("map of a closed or mapped spool file")
        if self.size == 0:
            self._view = memoryview(b"")
        else:
            self._map = mmap.mmap(self._fd, self.size, access=mmap.ACCESS_READ)
            self._view = memoryview(self._map)
        return self._view

    def slices(self, start: int, end: int, piece: int) -> Iterator[FileSlice]:
        """Bytes ``start:end`` of the mapped file as :class:`FileSlice` pieces of at most
        ``piece`` bytes, in order.

        Raises:
            ValueError: not mapped (or closed).
        """
        view = self._view
        if view is None:
            raise ValueError("slices of a spool file that is not mapped")
        for offset in range(start, end, piece):
            yield FileSlice(self._fd, offset, view[offset : min(offset + piece, end)])

    def close(self) -> bool:
        """Close the mapping and the file; idempotent. Returns whether a view leaked.

        A view of the mapping still held elsewhere (a memoryview a plugin kept
        past the release boundary) makes ``mmap.close`` raise ``BufferError``:
        it is logged as a warning and the mapping is left to be freed with the
        last view; the descriptor is closed either way.
        """
        if self._fd < 0:
            return self.leaked
        view, self._view = self._view, None
        if view is not None:
            view.release()
        mapping, self._map = self._map, None
        if mapping is not None:
            try:
                mapping.close()
            except BufferError:
                self.leaked = True
                if self._owner is not None:
                    self._owner.leaks += 1
                log.warning(
                    "a view of a spooled request body (%d bytes) outlived the release boundary;"
                    " a plugin kept it: its mapping stays until the view goes",
                    self.size,
                )
        fd, self._fd = self._fd, -1
        os.close(fd)
        owner, self._owner = self._owner, None
        if owner is not None:
            owner.files -= 1
            owner.in_flight -= self.size
        return self.leaked


class Warner(Protocol):
    """A rate-limited warning (``proxy._logs.LogLimiter`` is one)."""

    def event(self, key: str, msg: str, *args: object) -> bool:
        """One event of ``key``: ``msg % args`` logged if the first of a run, else counted."""


class Spool:
    """The process's spool: where, above what size, and how much at once.

    Args:
        directory: ``spool_dir``.
        above_bytes: ``spool_above_bytes``; a body over it is spooled (0: never).
        max_bytes: ``max_spool_bytes``, spooled bytes in flight at most.
        warner: where the "disk full" and "directory unusable" warnings go,
            rate-limited (``None``: plain warnings on this module's logger).

    Counters: ``in_flight`` (spooled bytes of open files), ``files`` (open
    files), ``spooled`` (bodies spooled since start), ``full`` (bodies cut by a
    full disk), ``busy`` (bodies refused by ``max_spool_bytes``), ``leaks``
    (closes that found a view still held).
    """

    __slots__ = (
        "_warner",
        "above_bytes",
        "busy",
        "directory",
        "files",
        "full",
        "in_flight",
        "leaks",
        "max_bytes",
        "spooled",
    )

    def __init__(
        self,
        directory: str,
        *,
        above_bytes: int,
        max_bytes: int,
        warner: Warner | None = None,
    ) -> None:
        self.directory = directory
        self.above_bytes = above_bytes
        self.max_bytes = max_bytes
        self.in_flight = 0
        self.files = 0
        self.spooled = 0
        self.full = 0
        self.busy = 0
        self.leaks = 0
        self._warner = warner

    def problem(self) -> str | None:
        """Why the spool cannot work (one line, for start-up and ``check``), or ``None``.

        A disabled spool (``spool_above_bytes = 0``) has none.
        """
        return spool_dir_problem(self.directory) if self.above_bytes > 0 else None

    def wants(self, size: int) -> bool:
        """Whether a body of ``size`` bytes (declared or read so far) belongs in the spool."""
        return 0 < self.above_bytes < size

    def admits(self, declared: int) -> bool:
        """Whether a body declaring ``declared`` bytes fits in ``max_spool_bytes`` now.

        Only bodies the spool would take are checked; one is always admitted
        when nothing is spooled (the limit per body is ``max_body_bytes``).
        """
        if not self.wants(declared):
            return True
        return self.in_flight == 0 or self.in_flight + declared <= self.max_bytes

    def open(self) -> SpoolFile:
        """A new anonymous file, counted until closed.

        Raises:
            SpoolFull: the file system has no room for even the file.
            SpoolNoDescriptor: no file descriptor left (``EMFILE``, ``ENFILE``).
            SpoolUnavailable: the directory cannot be used (any other error;
                logged, rate-limited: start-up checked it, so it changed since).
        """
        try:
            fd = open_anonymous(self.directory)
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise self.filled() from None
            if exc.errno in EXHAUSTION_ERRNOS:
                # The descriptor limit, not the directory: nothing to warn about here.
                raise SpoolNoDescriptor() from None
            self._warn(
                "spool_dir unusable",
                "spool_dir %s cannot be used (%s): large request bodies get 503",
                self.directory,
                exc.strerror,
            )
            raise SpoolUnavailable() from None
        self.files += 1
        self.spooled += 1
        return SpoolFile(fd, self)

    def grow(self, nbytes: int, file_bytes: int) -> None:
        """``nbytes`` more bytes went to a spool file that now holds ``file_bytes``.

        Raises:
            SpoolBusy: past ``max_spool_bytes`` while other bodies hold part of it
                (a body alone may grow to ``max_body_bytes``).
        """
        self.in_flight += nbytes
        if self.in_flight > self.max_bytes and self.in_flight > file_bytes:
            self.busy += 1
            raise SpoolBusy()

    def filled(self) -> SpoolFull:
        """Count a body cut by a full disk, warn (rate-limited) and return its error."""
        self.full += 1
        self._warn(
            "spool_dir full",
            "spool_dir %s is full (or a quota or file-size limit was hit):"
            " large request bodies get 503 until space is freed",
            self.directory,
        )
        return SpoolFull()

    def _warn(self, key: str, msg: str, *args: object) -> None:
        if self._warner is not None:
            self._warner.event(key, msg, *args)
        else:
            log.warning(msg, *args)
