"""`trainstream.connect()`: a session with the local tsd."""
import dataclasses
import os
import re

from . import _C
from .errors import FailedPrecondition

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}


def parse_bytes(value):
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
    def free_bytes(self):
        return max(0, self.pool_bytes - self.used_bytes)


@dataclasses.dataclass(frozen=True)
class Job:
    name: str
    uid: int
    sessions: int
    used_bytes: int
    quota_bytes: int
    regions: int


class Client:
    """A connection to tsd, optionally attached to a job (a session). Use it as a context manager,
    or call `close()`: closing detaches, and a job is released with its last session."""

    def __init__(self, socket=None, job=None, quota=None):
        path = socket if socket is not None else os.environ.get("TSD_SOCKET", "")
        self._c = _C.Client.connect(os.fspath(path))
        self._optimizer_registered = False
        if job is not None:
            self.attach(job, quota)

    # ---- session
    def attach(self, job, quota=None):
        """Joins or creates `job`; `quota` (bytes or "8GiB") caps what it may hold (None: the
        daemon's maximum). Returns self."""
        self._c.attach(job, parse_bytes(quota))
        return self

    def detach(self):
        if self._c.attached:
            self._c.detach()
        self._optimizer_registered = False

    def close(self):
        self.detach()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
        return False

    # ---- queries
    def status(self):
        """The daemon's pool: size, usage, jobs, sessions, whether it is locked in RAM."""
        return Status(**self._c.status())

    def jobs(self):
        return [Job(**j) for j in self._c.jobs()]

    @property
    def socket_path(self):
        return self._c.socket_path

    @property
    def attached(self):
        return self._c.attached

    @property
    def job(self):
        return self._c.job if self._c.attached else None

    @property
    def quota_bytes(self):
        return self._c.quota_bytes

    # ---- the optimizer engine (used by wrap())
    def _register_optimizer(self, **spec):
        if not self._c.attached:
            raise FailedPrecondition("attach the client to a job before wrapping a model (connect(job=...))")
        handle = self._c.register_optimizer(**spec)
        self._optimizer_registered = True
        return handle

    def __repr__(self):
        state = f"job={self.job!r}" if self.attached else "not attached"
        return f"<trainstream.Client {self.socket_path} {state}>"


def connect(socket=None, job=None, quota=None):
    """Connects to the local tsd and returns a `Client` (a context manager).

    `socket` defaults to $TSD_SOCKET, then tsd's default path (/run/tsd/tsd.sock as root, else
    $XDG_RUNTIME_DIR/tsd/tsd.sock or /tmp/tsd-$UID/tsd.sock), or the system service's
    /run/tsd/tsd.sock when no daemon listens at that default and the service's socket exists. With `job`, the client attaches to that
    job (created on first attach) with `quota` bytes at most. With no daemon there, raises
    `trainstream.DaemonUnavailable` naming the path tried and how to start tsd."""
    return Client(socket=socket, job=job, quota=quota)
