"""Exceptions raised by kvpack, one class per kind of fault.

Every exception derives from :class:`KvpackError`. The classes also derive
from the matching built-in exception, so ``except ValueError`` and
``except OSError`` keep working.
"""

from __future__ import annotations

from typing import Optional

__all__ = [
    "KvpackError",
    "FormatError",
    "ParameterError",
    "LimitsError",
    "KvpackIOError",
    "UnsupportedError",
    "DeviceError",
]


class KvpackError(Exception):
    """Base class of every kvpack error.

    Attributes:
        location: where in a kvpack file or stream the fault was found
            (``"page #3 at byte 4096 (layer 1 K tokens 0..256)"``,
            ``"file header"``, ...), or ``None`` when it is not about the
            bytes of a file.
    """

    def __init__(self, message: str, location: Optional[str] = None, errno: Optional[int] = None):
        super().__init__(message)
        self.location = location


class FormatError(KvpackError, ValueError):
    """The bytes are not a valid kvpack file or stream: corrupted, truncated,
    or written by a newer major version. ``location`` names the header,
    page, section, index or trailer at fault."""


class ParameterError(KvpackError, ValueError):
    """An argument is invalid: unknown codec name, a shape or dtype the
    codec or file cannot take, a missing tensor, an existing output file
    without ``force=True``."""


class LimitsError(KvpackError):
    """The input is well formed but exceeds a configured limit."""


class KvpackIOError(KvpackError, OSError):
    """The operating system refused a read or write (``errno`` is set when
    the OS gave one)."""

    def __init__(self, message: str, location: Optional[str] = None, errno: Optional[int] = None):
        KvpackError.__init__(self, message, location)
        if errno is not None:
            self.errno = errno
        self.strerror = message


class UnsupportedError(KvpackError, NotImplementedError):
    """Supported by the format but not by this build or machine (for
    example GPU decoding in a build without CUDA)."""


class DeviceError(KvpackError, RuntimeError):
    """The GPU failed: a CUDA driver call, kernel compilation, a kernel
    launch or copy, or out of device memory. Not the data's fault; the same
    call may succeed on another device or after freeing memory."""


def _integers_in_range(f):
    """Raises ParameterError, naming the call, where an integer argument
    cannot be converted for the native layer (negative, or beyond u32/u64:
    PyO3 raises OverflowError, which is no kvpack error)."""
    import functools

    @functools.wraps(f)
    def checked(*args, **kwargs):
        try:
            return f(*args, **kwargs)
        except OverflowError as e:
            raise ParameterError(f"{f.__name__}: an integer argument is negative or too large ({e})") from None

    return checked
