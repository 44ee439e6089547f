"""Starting the processes of a multi-process test: `spawn_ranks` runs one process per rank,
waits for them within a deadline and kills any left, so a hung collective fails the test instead
of hanging it."""
from __future__ import annotations

import socket
import time
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port on the loopback that nothing listens on now (for MASTER_PORT)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def spawn_ranks(target: Callable[..., Any], args_of: Callable[[int], tuple], world: int, timeout: float) -> None:
    """Runs `target(*args_of(rank))` in a spawned process for each rank of `world` and waits for
    all of them; ranks still running after `timeout` seconds are killed and fail the test."""
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=args_of(r)) for r in range(world)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    for p in procs:
        p.join(max(0.0, deadline - time.monotonic()))
    hung = [r for r, p in enumerate(procs) if p.is_alive()]
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    assert not hung, f"ranks {hung} did not finish within {timeout} s"
