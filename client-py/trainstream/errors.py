"""trainstream's exceptions: every error from tsd (or from the client library talking to it) is a
`TsdError`, with the daemon's message and the gRPC status code it came with. Subclasses also derive
from the matching built-in exception, so `except MemoryError` catches an exhausted pool too."""
from __future__ import annotations

import dataclasses
from typing import NoReturn, Optional, Sequence

# gRPC / absl status codes (the same numbers on both).
OK, CANCELLED, UNKNOWN, INVALID_ARGUMENT, DEADLINE_EXCEEDED, NOT_FOUND, ALREADY_EXISTS = range(7)
PERMISSION_DENIED, RESOURCE_EXHAUSTED, FAILED_PRECONDITION, ABORTED, OUT_OF_RANGE = range(7, 12)
UNIMPLEMENTED, INTERNAL, UNAVAILABLE, DATA_LOSS, UNAUTHENTICATED = range(12, 17)


class TsdError(Exception):
    """An error reported by tsd or by the client library; `code` is the gRPC status code."""

    code: int = UNKNOWN

    def __init__(self, message: str, code: Optional[int] = None) -> None:
        super().__init__(message)
        self.message = message
        if code is not None:
            self.code = code


class DaemonUnavailable(TsdError, ConnectionError):
    """No daemon at the socket, or it exited, was killed or shut down. The message names the
    socket and how to start `tsd`."""

    code = UNAVAILABLE


class InvalidRequest(TsdError, ValueError):
    """The daemon refused a malformed request or an unsupported option (amsgrad, maximize, ...)."""

    code = INVALID_ARGUMENT


class QuotaExceeded(TsdError, MemoryError):
    """The job's quota or the daemon's pool cannot hold what was asked; the message says what is
    free and who holds it. Also raised by `wrap(check_memory=True)` before anything is allocated."""

    code = RESOURCE_EXHAUSTED


@dataclasses.dataclass(frozen=True)
class Refusal:
    """One check of `wrap(check_memory=True)` that failed: `what` is where ("tsd": the job's quota
    and the pool; "vram_free" / "vram_usable": the device; "host": the node's RAM), `needed` and
    `available` are bytes, `message` says each part, its size and what would make it fit."""

    what: str
    needed: int
    available: int
    message: str


class MemoryCheckFailed(QuotaExceeded):
    """`wrap(check_memory=True)` (or `plan_wrap`) refused, before allocating anything, a run that is
    certain not to fit. `refusals` lists each failed check (`Refusal`); the message joins them."""

    def __init__(self, message: str, refusals: Sequence[Refusal] = ()) -> None:
        super().__init__(message)
        self.refusals = tuple(refusals)


class PermissionDenied(TsdError, PermissionError):
    """The job belongs to another user, or a session token was wrong."""

    code = PERMISSION_DENIED


class NotFound(TsdError, LookupError):
    code = NOT_FOUND


class AlreadyExists(TsdError):
    """E.g. a second optimizer registered on one session (one `wrap()` per Client)."""

    code = ALREADY_EXISTS


class FailedPrecondition(TsdError):
    """A call made in the wrong state (e.g. before attaching)."""

    code = FAILED_PRECONDITION


class SessionClosed(TsdError):
    """The daemon closed this job's session or optimizer (it saw a protocol violation); the
    message says why. Attach again to continue."""

    code = ABORTED


class Timeout(TsdError, TimeoutError):
    code = DEADLINE_EXCEEDED


_BY_CODE = {c.code: c for c in (DaemonUnavailable, InvalidRequest, QuotaExceeded, PermissionDenied, NotFound,
                                AlreadyExists, FailedPrecondition, SessionClosed, Timeout)}


def error_class(code: int) -> type[TsdError]:
    """The exception class for a status code (used by the extension when it raises)."""
    return _BY_CODE.get(code, TsdError)


def raise_for(code: int, message: str) -> NoReturn:
    raise error_class(code)(message, code)
