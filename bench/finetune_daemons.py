"""The tsd daemons of one finetune_bench run."""
from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass
class Daemon:
    """One tsd a run's tsd modes talk to: the process (None for the daemon at --socket, which the
    run did not start), its socket, a client, its PID (for the PSS samples) and the bytes it lends
    before any mode runs (what a finished child's job must return it to before the next child)."""

    proc: Optional[subprocess.Popen[bytes]]
    socket: str
    client: Any
    pid: int
    idle_used: int

    def wait_idle(self, timeout_s: float = 120) -> None:
        """Waits until tsd has freed the last child's job (it does so after the child goes)."""
        deadline = time.time() + timeout_s
        while self.client.status().used_bytes > self.idle_used and time.time() < deadline:
            time.sleep(0.5)


class Daemons:
    """The daemons of a run, one per optimizer thread count. The run's tsd modes share the default
    one: the daemon at --socket, or build/bin/tsd (--tsd-bin) started on a private socket with
    --pool-size and --daemon-args. An entry MODE:threads=N gets a tsd of its own, started with
    --optimizer-threads N when that entry first runs, so thread counts compare side by side in one
    interleaved run. Every daemon the run started is stopped by `close()`."""

    def __init__(self, a: argparse.Namespace) -> None:
        self.a = a
        self.by_threads: dict[Optional[int], Daemon] = {}

    def get(self, threads: Optional[int] = None) -> Daemon:
        """The daemon for `threads` optimizer threads (None: the run's default one)."""
        if threads not in self.by_threads:
            self.by_threads[threads] = self._open(threads)
        return self.by_threads[threads]

    def close(self) -> None:
        for d in self.by_threads.values():
            d.client.close()
            if d.proc is not None:
                d.proc.terminate()
                d.proc.wait(30)
        self.by_threads.clear()

    def _open(self, threads: Optional[int]) -> Daemon:
        import trainstream

        if threads is not None and self.a.socket:
            sys.exit("finetune_bench: a MODE:threads=N entry needs a tsd this script starts (leave out --socket)")
        proc, socket = (None, self.a.socket) if self.a.socket else self._start(threads)
        client = trainstream.connect(socket=socket)
        status = client.status()
        return Daemon(proc=proc, socket=socket, client=client, pid=status.pid, idle_used=status.used_bytes)

    def _start(self, threads: Optional[int]) -> tuple[subprocess.Popen[bytes], str]:
        import trainstream

        a = self.a
        binary = a.tsd_bin or os.environ.get("TSD_BIN") or os.path.join(ROOT, "build", "bin", "tsd")
        if not os.path.exists(binary):
            sys.exit(f"finetune_bench: no tsd at {binary}: build it (scripts/build.sh) or pass --tsd-bin/--socket")
        socket = os.path.join(tempfile.mkdtemp(prefix="tsd-bench-"), "tsd.sock")
        proc = subprocess.Popen([binary, "--socket", socket, "--pool-size", a.pool_size, "--metrics-listen", "",
                                 *daemon_args(a.daemon_args, threads)], stdout=subprocess.DEVNULL,
                                stderr=subprocess.STDOUT)
        for _ in range(300):
            try:
                trainstream.connect(socket=socket).close()
                return proc, socket
            except trainstream.DaemonUnavailable:
                if proc.poll() is not None:
                    break
                time.sleep(0.1)
        proc.kill()
        sys.exit(f"finetune_bench: tsd did not start (exit status {proc.poll()}); run {binary} --help")


def daemon_args(text: str, threads: Optional[int]) -> list[str]:
    """--daemon-args as a list; with `threads`, its --optimizer-threads replaced by that count (tsd
    refuses the flag twice)."""
    args = text.split()
    if threads is None:
        return args
    out: list[str] = []
    skip = False
    for arg in args:
        if skip:
            skip = False
        elif arg == "--optimizer-threads":
            skip = True
        elif not arg.startswith("--optimizer-threads="):
            out.append(arg)
    return [*out, "--optimizer-threads", str(threads)]
