"""File descriptors: the process limit, and telling their exhaustion apart from other errors.

Each open stream holds two sockets (client and upstream), so the soft
``RLIMIT_NOFILE`` many systems default to (1024) caps a proxy at a few hundred
streams although the hard limit allows far more.
"""

from __future__ import annotations

import errno
import resource
from typing import Final

__all__ = ["EXHAUSTED_MESSAGE", "EXHAUSTION_ERRNOS", "is_fd_exhaustion", "raise_nofile_limit"]

#: ``EMFILE``: this process is at its limit; ``ENFILE``: the whole system is.
EXHAUSTION_ERRNOS: Final = frozenset({errno.EMFILE, errno.ENFILE})

#: What the client of a request refused for want of a descriptor reads (in a 503).
EXHAUSTED_MESSAGE: Final = "proxy is out of file descriptors; retry later"


def raise_nofile_limit() -> tuple[int, int]:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; return ``(before, after)``.

    An unlimited hard limit is not a valid soft limit on Linux: the soft limit
    then goes to ``fs.nr_open``'s usual ceiling, 1,048,576. If the kernel refuses
    (a container's seccomp, say), the limit stays as it was.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
    if target <= soft and soft != resource.RLIM_INFINITY:
        return soft, soft
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
    except (ValueError, OSError):
        return soft, soft
    return soft, target


def is_fd_exhaustion(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an error it wraps) is ``EMFILE``/``ENFILE``.

    A failed upstream connect comes wrapped (``proxy._upstream.ConnectFailed``)
    with the original as ``__cause__``/``os_error``, as aiohttp's errors do.
    """
    seen = 0
    while exc is not None and seen < 8:  # a short chain; bounded all the same
        if isinstance(exc, OSError) and exc.errno in EXHAUSTION_ERRNOS:
            return True
        inner = getattr(exc, "os_error", None)
        exc = inner if isinstance(inner, BaseException) else (exc.__cause__ or exc.__context__)
        seen += 1
    return False
