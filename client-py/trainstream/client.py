"""`trainstream.connect()`: a session with the local tsd, and the regions of host memory it lends."""
from __future__ import annotations

import dataclasses
import os
from typing import Any, Optional, Sequence, Union

import torch

from . import _C  # type: ignore[attr-defined]  # the pybind11 extension
from .errors import FailedPrecondition
from .store import Store, StoreInfo
from .durations import Duration, parse_duration
from .units import Size, parse_bytes

__all__ = ["Client", "Status", "Job", "Region", "RegionInfo", "OptimizerLayout", "Notice", "connect", "parse_bytes"]


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
    # With max_grad_norm: commits whose updates tsd applied before the commit (speculated), and
    # those of them it undid and redid (clipping bit, or the hyperparameters changed).
    speculated_commits: int = 0
    redone_commits: int = 0
    # Seconds tsd's optimizer threads spent on the job's bucket work, all threads together (per
    # step and thread: the time its updates take with every thread on them).
    work_busy_s: float = 0.0
    # Its share of those threads' time over its last steps (0 to 1; 0 once it stops stepping).
    work_busy_share: float = 0.0


@dataclasses.dataclass(frozen=True)
class RegionInfo:
    """One region of the attached job, as `Client.regions()` lists it (not mapped)."""

    id: int
    name: str
    size: int
    locked: bool


@dataclasses.dataclass(frozen=True)
class OptimizerLayout:
    """What registering an optimizer would allocate, from the daemon's dry run
    (`Client.plan_optimizer`). Sizes are page-rounded as tsd charges them; `state_bytes` is their
    sum, the moments counted twice (exp_avg and exp_avg_sq). `buckets`: each bucket's byte offsets
    (master, grad, param) into "opt/master", "opt/grads" and "opt/params"."""

    state_bytes: int
    control_bytes: int
    master_bytes: int
    moment_bytes: int
    grad_bytes: int
    param_bytes: int
    accum_bytes: int
    buckets: tuple[tuple[int, int, int], ...]

    def parts(self, moment_dtype: str) -> list[tuple[str, int]]:
        """(what, bytes) of each region, for messages."""
        out = [("fp32 master weights", self.master_bytes), (f"{moment_dtype} moments", 2 * self.moment_bytes),
               ("gradient slots", self.grad_bytes)]
        if self.param_bytes:  # none when the parameters are fp32: their slots are the masters
            out.append(("parameter slots", self.param_bytes))
        out.append(("control page", self.control_bytes))
        if self.accum_bytes:
            out.append(("fp32 accumulator", self.accum_bytes))
        return out


class Region:
    """A region of host memory lent by tsd and mapped into this process: charged to the job's
    quota, shown by `tsctl jobs`, locked in RAM by the daemon, and registered with CUDA where a GPU
    is present (`cuda_registered`: copies to and from the GPU then run at pinned speed).

    `view(dtype, offset, numel)` returns a torch tensor over the mapping, without a copy. Free the
    region with `Client.free(region)` once no view is left (tsd zeroes freed memory; a region with
    live views is refused). A region nobody frees is released with the job."""

    def __init__(self, handle: Any) -> None:
        self._h = handle

    @property
    def name(self) -> str:
        return str(self._h.name)

    @property
    def size(self) -> int:
        """Bytes, page-rounded (what is charged and mapped)."""
        return int(self._h.size)

    @property
    def id(self) -> int:
        return int(self._h.id)

    @property
    def locked(self) -> bool:
        """Resident and mlock()ed in the daemon."""
        return bool(self._h.locked)

    @property
    def cuda_registered(self) -> bool:
        """Registered with CUDA (cudaHostRegister) in this process."""
        return bool(self._h.cuda_registered)

    @property
    def freed(self) -> bool:
        return bool(self._h.freed)

    @property
    def live_views(self) -> int:
        """Tensor storages over this region that are still alive."""
        return int(self._h.live_views)

    def view(self, dtype: torch.dtype = torch.uint8, offset: int = 0, numel: Optional[int] = None) -> torch.Tensor:
        """A 1-D tensor of `dtype` over `numel` elements starting `offset` bytes into the region
        (default: to its end), aliasing the mapping (no copy). `offset` must be a multiple of the
        dtype's size."""
        item = dtype.itemsize
        if offset < 0 or offset % item:
            raise ValueError(f"offset {offset} into region {self.name!r} must be >= 0 and a multiple of "
                             f"{dtype}'s {item} bytes")
        if numel is None:
            numel = max(0, self.size - offset) // item
        if numel < 0:
            raise ValueError(f"numel must be >= 0, not {numel}")
        if offset + numel * item > self.size:
            raise ValueError(f"{numel} elements of {dtype} at byte {offset} are outside region {self.name!r} of "
                             f"{self.size} bytes")
        data = self._h.bytes(offset, numel * item)
        return data if dtype == torch.uint8 else data.view(dtype)

    def __repr__(self) -> str:
        state = "freed" if self.freed else f"{self.size} bytes{', CUDA-registered' if self.cuda_registered else ''}"
        return f"<trainstream.Region {self.name!r} {state}>"


@dataclasses.dataclass(frozen=True)
class Notice:
    """A notice tsd sent this client on its own: `kind` is "shutdown" (the daemon is stopping),
    "session_closed" (tsd closed the session; `message` says why) or "other"."""

    kind: str
    message: str


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
    def attach(self, job: str, quota: Size = None, keep_for: Duration = None, resume: bool = False) -> "Client":
        """Joins or creates `job`; `quota` (bytes or "8GiB") caps what it may hold (None: the
        daemon's maximum). `keep_for` ("10m", "30s" or seconds): tsd keeps the job (its memory
        and optimizer state) that long after its last session dies, up to the daemon's
        `max_keep_for`. `resume=True` continues such a kept job (it must exist). Returns self."""
        if not isinstance(resume, bool):
            raise TypeError(f"resume must be True or False, not {resume!r}")
        self._c.attach(job, parse_bytes(quota), parse_duration(keep_for, "keep_for"), resume)
        return self

    @property
    def keep_for(self) -> float:
        """Seconds the attached job is kept after its last session dies (0: released at once)."""
        return float(self._c.keep_for_s)

    @property
    def resumed(self) -> bool:
        """This session attached with resume=True to an existing job."""
        return bool(self._c.resumed)

    def checkpoint(self, job: str, fd: int) -> int:
        """Has tsd write `job`'s optimizer state (a job of this uid) into `fd`, a regular file
        opened for writing, with a checksum per tensor; returns the bytes written. Uses a
        connection of its own (this client must not be attached). `tsctl checkpoint` wraps this
        with the temporary file, fsync and rename."""
        return int(self._c.checkpoint(job, fd))

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

    def set_request_timeout(self, seconds: float) -> None:
        """How long one request of the session waits for tsd's reply (default 120 s; saving and
        loading optimizer state wait at least an hour). A request that times out ends the
        session: the connection is closed rather than left to read a stale reply."""
        self._c.set_request_timeout(float(seconds))

    def last_notice(self) -> Optional[Notice]:
        """The last notice tsd sent this client (a shutdown, or why it closed the session), or
        None; a notice that arrived while the client was idle is read here."""
        n = self._c.last_notice()
        return Notice(**n) if n is not None else None

    # ---- regions
    def alloc(self, name: str, size: Size) -> Region:
        """Allocates a region of the job (at least `size` bytes, page-rounded) and maps it. The
        name is unique within the job while the region exists."""
        return Region(self._c.alloc(name, parse_bytes(size)))

    def map(self, name: str) -> Region:
        """Maps an existing region of the job by name (e.g. one another session allocated)."""
        return Region(self._c.map(name))

    def free(self, region: Region) -> None:
        """Frees a region in tsd and unmaps it here. Refused (FailedPrecondition) while tensor
        views of it are alive: drop them first."""
        self._c.free(region._h)

    def regions(self) -> list[RegionInfo]:
        """The regions of the attached job (its optimizer's among them)."""
        return [RegionInfo(**r) for r in self._c.list_regions()]

    # ---- the optimizer engine (used by wrap())
    def plan_optimizer(self, groups: Sequence[dict[str, float]], buckets: Sequence[tuple[int, int, str, str]],
                       moment_dtype: str = "float32", max_grad_norm: float = 0.0, accumulate: bool = False,
                       seed: int = 0, amsgrad: bool = False, maximize: bool = False) -> OptimizerLayout:
        """The daemon's dry run of an optimizer registration: checks the request as registration
        does and returns what it would allocate; allocates nothing and needs no job. `groups`:
        dicts of lr, beta1, beta2, eps, weight_decay; `buckets`: (group, numel, grad dtype,
        param dtype) with tsd's dtype names."""
        d = self._c.plan_optimizer(list(groups), list(buckets), moment_dtype, max_grad_norm, accumulate, seed,
                                   amsgrad, maximize)
        offsets = tuple((int(m), int(g), int(p)) for m, g, p in d.pop("buckets"))
        return OptimizerLayout(buckets=offsets, **{k: int(v) for k, v in d.items()})

    # ---- weight stores (docs/stores.md)
    def open_store(self, files: Sequence[Union[str, os.PathLike]], format: str = "none", block_size: int = 64,
                   tensors: Sequence[tuple[str, bool]] = ()) -> Store:
        """Opens the weight store of the safetensors checkpoint `files` (opened here, read-only,
        and sent to tsd as descriptors): tsd finds it, or builds it in `format` ("none": as
        stored, "nf4", "int8"; `block_size` elements per absmax block) holding `tensors`
        ((name, quantize) pairs; empty: every tensor, as stored). The job uses the store until
        `close_store` or its release."""
        handle = self._c.open_store([os.fspath(f) for f in files], format, int(block_size),
                                    [(str(n), bool(q)) for n, q in tensors])
        return Store(handle, self)

    def close_store(self, store_id: int) -> None:
        """The job stops using store `store_id` (tsd keeps it warm for store_keep)."""
        self._c.close_store(int(store_id))

    def stores(self) -> list[StoreInfo]:
        """The complete weight stores this user may see (metadata only): those its jobs opened
        with the stores' files, every one for tsd's own uid (docs/stores.md, "Isolation"). Works
        attached or not; other users' stores are not listed."""
        return [StoreInfo(**d) for d in self._c.stores()]

    def _register_optimizer(self, **spec: Any) -> Any:
        if not self._c.attached:
            raise FailedPrecondition("attach the client to a job before wrapping a model (connect(job=...))")
        handle = self._c.register_optimizer(**spec)
        self._optimizer_registered = True
        return handle

    def _resume_optimizer(self, **spec: Any) -> tuple[Any, dict[str, Any]]:
        if not self._c.attached:
            raise FailedPrecondition("attach the client to a job before resuming it (resume=True)")
        handle, report = self._c.resume_optimizer(**spec)
        self._optimizer_registered = True
        return handle, report

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
