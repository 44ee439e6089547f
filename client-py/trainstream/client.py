"""`trainstream.connect()`: a session with the local tsd."""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Optional, Union

from . import _C  # type: ignore[attr-defined]  # the pybind11 extension
from .errors import FailedPrecondition

Size = Union[int, str, None]  # bytes, or e.g. "8GiB"

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(value: Size) -> int:
    """Bytes from an int or a string such as "8GiB", "512MiB", "1.5G" (as tsd's settings read them)."""
    if value is None:
        return 0
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative: {value}")
        return value
    m = re.fullmatch(r"\s*([0-9.]+)\s*([A-Za-z]*)\s*", str(value))
    if not m or m.group(2).lower() not in _UNITS:
        raise ValueError(f"cannot read {value!r} as a size: use bytes or e.g. '512MiB', '8GiB'")
    return int(float(m.group(1)) * _UNITS[m.group(2).lower()])


@dataclasses.dataclass(frozen=True)
class Status:
    """The daemon's pool, as `Client.status()` reports it."""

    version: str
    uptime_s: float
    pool_bytes: int
    used_bytes: int
    locked: bool
    jobs: int
    sessions: int
    max_job_quota_bytes: int
    pid: int

    @property
    def free_bytes(self) -> int:
        return max(0, self.pool_bytes - self.used_bytes)


@dataclasses.dataclass(frozen=True)
class Job:
    """One job of the daemon, as `Client.jobs()` reports it."""

    name: str
    uid: int
    sessions: int
    used_bytes: int
    quota_bytes: int
    regions: int


class Client:
    """A connection to tsd, optionally attached to a job (a session). Use it as a context manager,
    or call `close()`: closing detaches, and a job is released with its last session."""

    def __init__(self, socket: Optional[Union[str, os.PathLike]] = None, job: Optional[str] = None,
                 quota: Size = None) -> None:
        path = socket if socket is not None else os.environ.get("TSD_SOCKET", "")
        self._c = _C.Client.connect(os.fspath(path))
        self._optimizer_registered = False
        if job is not None:
            self.attach(job, quota)

    # ---- session
    def attach(self, job: str, quota: Size = None) -> "Client":
        """Joins or creates `job`; `quota` (bytes or "8GiB") caps what it may hold (None: the
        daemon's maximum). Returns self."""
        self._c.attach(job, parse_bytes(quota))
        return self

    def detach(self) -> None:
        """Leaves the job (the daemon releases it with its last session); the connection stays."""
        if self._c.attached:
            self._c.detach()
        self._optimizer_registered = False

    def close(self) -> None:
        """Detaches; the same as leaving the `with` block."""
        self.detach()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ---- queries
    def status(self) -> Status:
        """The daemon's pool: size, usage, jobs, sessions, whether it is locked in RAM."""
        return Status(**self._c.status())

    def jobs(self) -> list[Job]:
        """Every job the daemon holds (name, uid, sessions, bytes used and allowed, regions)."""
        return [Job(**j) for j in self._c.jobs()]

    @property
    def socket_path(self) -> str:
        """The control socket this client connected to."""
        return self._c.socket_path

    @property
    def attached(self) -> bool:
        return self._c.attached

    @property
    def job(self) -> Optional[str]:
        """The job this client is attached to, or None."""
        return self._c.job if self._c.attached else None

    @property
    def quota_bytes(self) -> int:
        """The attached job's quota in bytes."""
        return self._c.quota_bytes

    # ---- the optimizer engine (used by wrap())
    def _register_optimizer(self, **spec):
        if not self._c.attached:
            raise FailedPrecondition("attach the client to a job before wrapping a model (connect(job=...))")
        handle = self._c.register_optimizer(**spec)
        self._optimizer_registered = True
        return handle

    def __repr__(self) -> str:
        state = f"job={self.job!r}" if self.attached else "not attached"
        return f"<trainstream.Client {self.socket_path} {state}>"


def connect(socket: Optional[Union[str, os.PathLike]] = None, job: Optional[str] = None, quota: Size = None) -> Client:
    """Connects to the local tsd and returns a `Client` (a context manager).

    `socket` defaults to $TSD_SOCKET, then tsd's default path (/run/tsd/tsd.sock as root, else
    $XDG_RUNTIME_DIR/tsd/tsd.sock or /tmp/tsd-$UID/tsd.sock), or the system service's
    /run/tsd/tsd.sock when no daemon listens at that default and the service's socket exists. With `job`, the client attaches to that
    job (created on first attach) with `quota` bytes at most. With no daemon there, raises
    `trainstream.DaemonUnavailable` naming the path tried and how to start tsd."""
    return Client(socket=socket, job=job, quota=quota)
