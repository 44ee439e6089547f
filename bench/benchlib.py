"""The benchmark pipeline's recording half: every benchmark appends its measured runs to
`bench/results/<benchmark>.jsonl` through this module, so every record has the same shape, and
`bench/report.py` turns those files into the tables and plots of docs/benchmarks.md.

One record (one JSON object on one line) per measured run of one mode:

    schema      1
    benchmark   e.g. "finetune", "optimizer"
    run_id      groups the records of one invocation; `order` is the record's place in it, `repeat`
                the round it belongs to (a benchmark run with --repeats 3 interleaves its modes:
                A B C A B C A B C)
    mode        what was measured (a tsd configuration or a peer)
    status      "ok", "skipped" (with `reason`: a peer that is not installed, a mode that needs a GPU)
                or "failed" (with `reason`: the end of its error output)
    workload    what was run: model architecture, batch, seq, dtypes, clipping, VRAM cap, ...
    values      what was measured, units in the key's name (step_s, step_s_median,
                vram_torch_peak_gib, vram_device_peak_gib, host_pss_peak_gib, tsd_used_gib, ...)
    commit, dirty, time_utc, host, command
    source      "measured", or where a transcribed figure came from

Only the standard library is needed, so shell benchmarks can record through the command line:

    some_bench | python3 bench/benchlib.py record-lines --benchmark optimizer --command "..." \
        --mode-keys bench,moments,impl --workload-keys params,threads

Measurement helpers: `pss_bytes(pid)` (PSS from /proc/<pid>/smaps_rollup: pages shared between the
trainer and tsd, such as tsd's regions the trainer maps, are split between them, so the sum over
both processes counts them once), `Nvml` (whole-device memory through NVML, without creating a
CUDA context) and `run_sampled()` (runs a child process and samples both while it runs).
"""
from __future__ import annotations

import argparse
import ctypes
import datetime
import json
import os
import secrets
import shlex
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from typing import Any, Callable, Iterable, Optional, Sequence

SCHEMA = 1
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS_DIR = os.path.join(ROOT, "bench", "results")
GIB = float(1 << 30)
STATUSES = ("ok", "skipped", "failed")
REQUIRED = {"schema": int, "benchmark": str, "run_id": str, "order": int, "repeat": int, "mode": str, "status": str,
            "workload": dict, "values": dict, "host": dict, "command": str, "source": str}


class RecordError(ValueError):
    """A results line that is not a well-formed record."""


def utc_now() -> str:
    """The current time in UTC, ISO 8601 to the second ("2026-12-03T10:15:00Z")."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def new_run_id() -> str:
    """A run id that sorts by time: UTC time plus 6 random hex digits."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ") + "-" + secrets.token_hex(3)


def git_commit(root: str = ROOT) -> tuple[Optional[str], Optional[bool]]:
    """(HEAD's commit, whether the tracked files differ from it), or (None, None) outside git.
    $TSD_BENCH_COMMIT names the commit where the tree was copied without its .git (a GPU machine)."""
    if os.environ.get("TSD_BENCH_COMMIT"):
        return os.environ["TSD_BENCH_COMMIT"], None
    try:
        head = subprocess.run(["git", "-C", root, "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        if head.returncode != 0:
            return None, None
        diff = subprocess.run(["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
                              capture_output=True, text=True, timeout=30)
        return head.stdout.strip(), bool(diff.stdout.strip()) if diff.returncode == 0 else None
    except (OSError, subprocess.SubprocessError):
        return None, None


def command_line(argv: Optional[list[str]] = None) -> str:
    """The exact command of this process, as a shell would take it (`python3 bench/x.py --a 1`)."""
    argv = sys.argv if argv is None else argv
    return shlex.join([os.path.basename(sys.executable) or "python3", *argv])


# ---------------------------------------------------------------------------------------------
# Host and device


class Nvml:
    """Whole-device GPU memory through NVML (libnvidia-ml, which ships with the driver), read
    through ctypes so that no CUDA context is created in the reading process. `Nvml.open()` is
    None where there is no driver. Indices are NVML's; `index_for_visible()` maps the first
    device of CUDA_VISIBLE_DEVICES when it is numeric."""

    class _Memory(ctypes.Structure):
        _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

    def __init__(self, lib: ctypes.CDLL) -> None:
        self._lib = lib

    @classmethod
    def open(cls) -> Optional["Nvml"]:
        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
            if lib.nvmlInit_v2() != 0:
                return None
        except (OSError, AttributeError):
            return None
        return cls(lib)

    def count(self) -> int:
        n = ctypes.c_uint(0)
        return n.value if self._lib.nvmlDeviceGetCount_v2(ctypes.byref(n)) == 0 else 0

    def _handle(self, index: int) -> Optional[ctypes.c_void_p]:
        h = ctypes.c_void_p()
        return h if self._lib.nvmlDeviceGetHandleByIndex_v2(ctypes.c_uint(index), ctypes.byref(h)) == 0 else None

    def name(self, index: int = 0) -> Optional[str]:
        h = self._handle(index)
        buf = ctypes.create_string_buffer(96)
        if h is None or self._lib.nvmlDeviceGetName(h, buf, ctypes.c_uint(96)) != 0:
            return None
        return buf.value.decode(errors="replace")

    def used_bytes(self, index: int = 0) -> Optional[int]:
        """Memory in use on the whole device (every process, CUDA contexts included), as nvidia-smi shows it."""
        h = self._handle(index)
        mem = Nvml._Memory()
        if h is None or self._lib.nvmlDeviceGetMemoryInfo(h, ctypes.byref(mem)) != 0:
            return None
        return int(mem.used)

    @staticmethod
    def index_for_visible() -> int:
        first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip()
        return int(first) if first.isdigit() else 0

    @staticmethod
    def indices_for_visible(n: int) -> list[int]:
        """The NVML indices of CUDA devices 0..n-1 as a child started with `CUDA_DEVICE_ORDER=
        PCI_BUS_ID` (NVML's order) numbers them: the first n entries of CUDA_VISIBLE_DEVICES where
        it lists numbers, else 0..n-1. Raises ValueError where it names devices otherwise (UUIDs)."""
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        if visible is None:
            return list(range(n))
        entries = [e.strip() for e in visible.split(",") if e.strip()]
        if not all(e.isdigit() for e in entries[:n]):
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r}: give device numbers to sample several GPUs")
        if len(entries) < n:
            raise ValueError(f"CUDA_VISIBLE_DEVICES={visible!r} lists {len(entries)} devices, {n} asked")
        return [int(e) for e in entries[:n]]


def host_info() -> dict[str, Any]:
    """The machine a run ran on: GPU name and count (NVML; None without a GPU), CPUs (all, and
    those this process may use), the CPU model and the RAM."""
    info: dict[str, Any] = {"gpu": None, "gpus": 0, "cpus": os.cpu_count(), "cpus_usable": len(os.sched_getaffinity(0))}
    nvml = Nvml.open()
    if nvml is not None:
        info["gpus"] = nvml.count()
        info["gpu"] = nvml.name(Nvml.index_for_visible()) if info["gpus"] else None
    try:
        with open("/proc/cpuinfo") as f:
            info["cpu_model"] = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), None)
        with open("/proc/meminfo") as f:
            kb = next(int(ln.split()[1]) for ln in f if ln.startswith("MemTotal:"))
        info["mem_gib"] = round(kb * 1024 / GIB, 1)
    except (OSError, StopIteration, ValueError):
        pass
    return info


def pss_bytes(pid: int) -> Optional[int]:
    """The proportional set size of `pid` (/proc/<pid>/smaps_rollup), or None if it is gone or unreadable."""
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for ln in f:
                if ln.startswith("Pss:"):
                    return int(ln.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return None


def own_pss_bytes(pid: int) -> Optional[int]:
    """The PSS of `pid` without its mappings of memfds (/proc/<pid>/smaps): a trainer's own
    memory, without the pages of tsd's regions and stores it maps (tsd's memory is memfds), or
    None if it is gone or unreadable."""
    total, memfd = 0, False
    try:
        with open(f"/proc/{pid}/smaps") as f:
            for ln in f:
                head = ln.split(None, 5)
                if head and "-" in head[0] and len(head) >= 5 and ":" in head[3]:  # a mapping's header line
                    memfd = len(head) == 6 and head[5].startswith("/memfd:")
                elif ln.startswith("Pss:") and not memfd:
                    total += int(ln.split()[1]) * 1024
    except (OSError, ValueError):
        return None
    return total


def descendants(pid: int) -> list[int]:
    """`pid` and every process below it (from /proc/<pid>/task/*/children)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo.extend(int(c) for c in f.read().split())
        except OSError:
            continue
    return out


class ChildRun:
    """What `run_sampled()` saw of one child: its exit status, output, peak RSS (wait4) and the
    peaks of the sampled figures (None where not sampled). `device_baseline` and `device_peak`
    are the first sampled GPU's; `device_baselines`, `device_peaks` and `device_steps_peaks`
    hold every sampled GPU's, in the order asked. The `*_steps_peak` figures are the peaks of
    the samples taken while the child's phase file existed (its timed steps)."""

    def __init__(self) -> None:
        self.returncode = 0
        self.stdout = ""
        self.stderr = ""
        self.rss_peak_bytes = 0
        self.trainer_pss_peak: Optional[int] = None
        self.daemon_pss_peak: Optional[int] = None
        self.host_pss_peak: Optional[int] = None
        self.device_baseline: Optional[int] = None
        self.device_peak: Optional[int] = None
        self.tsd_used_peak: Optional[int] = None
        self.samples = 0
        self.device_baselines: list[Optional[int]] = []
        self.device_peaks: list[Optional[int]] = []
        self.device_steps_peaks: list[Optional[int]] = []
        self.trainer_pss_steps_peak: Optional[int] = None
        self.daemon_pss_steps_peak: Optional[int] = None
        self.host_pss_steps_peak: Optional[int] = None
        self.steps_samples = 0

    def values(self) -> dict[str, Any]:
        """The sampled peaks as record values (GiB). With several GPUs sampled,
        `vram_device_peak_gib` is the largest of theirs (each less its own baseline) and
        `vram_device_peak_gib_per_gpu` lists them; with a phase file, the `*_steps_peak_gib`
        figures are those of the timed steps only (setup's transients left out)."""
        v: dict[str, Any] = {"rss_peak_gib": self.rss_peak_bytes / GIB}
        for key, b in (("trainer_pss_peak_gib", self.trainer_pss_peak), ("tsd_pss_peak_gib", self.daemon_pss_peak),
                       ("host_pss_peak_gib", self.host_pss_peak), ("tsd_used_peak_gib", self.tsd_used_peak),
                       ("vram_device_baseline_gib", self.device_baseline)):
            if b is not None:
                v[key] = b / GIB
        if self.device_peak is not None and self.device_baseline is not None:
            v["vram_device_peak_gib"] = max(0, self.device_peak - self.device_baseline) / GIB
        for key, peaks in (("vram_device_peak_gib", self.device_peaks),
                           ("vram_device_steps_peak_gib", self.device_steps_peaks)):
            per_gpu = [max(0, p - b) / GIB for p, b in zip(peaks, self.device_baselines) if p is not None and b is not None]
            if per_gpu and len(per_gpu) == len(peaks):
                v[key] = max(per_gpu)
                if len(per_gpu) > 1:
                    v[key + "_per_gpu"] = per_gpu
        for key, b in (("trainer_pss_steps_peak_gib", self.trainer_pss_steps_peak),
                       ("tsd_pss_steps_peak_gib", self.daemon_pss_steps_peak),
                       ("host_pss_steps_peak_gib", self.host_pss_steps_peak)):
            if b is not None:
                v[key] = b / GIB
        return v


def _peak(old: Optional[int], new: Optional[int]) -> Optional[int]:
    if new is None:
        return old
    return new if old is None else max(old, new)


def run_sampled(argv: list[str], interval_s: float = 0.5, daemon_pid: Optional[int] = None,
                tsd_used: Optional[Callable[[], Optional[int]]] = None, nvml: Optional[Nvml] = None,
                gpu_index: int = 0, env: Optional[dict[str, str]] = None,
                gpu_indices: Optional[Sequence[int]] = None, phase_file: Optional[str] = None) -> ChildRun:
    """Runs `argv` to its end and, every `interval_s` while it runs, samples the PSS of the child
    (with its descendants) and of the daemon (`daemon_pid`), their sum (the host memory of the
    run, tsd's shared regions counted once), the device's used memory (NVML; the child's share
    is the peak less the baseline read before it started; every device of `gpu_indices`, else
    `gpu_index`'s) and `tsd_used()` (the daemon's own used_bytes). While `phase_file` exists
    (the child creates it when its timed steps begin and removes it after them), the samples
    also go into the `*_steps_peak` figures. Sampling happens here, outside the measured process."""
    run = ChildRun()
    indices = list(gpu_indices) if gpu_indices is not None else [gpu_index]
    if nvml is not None:
        run.device_baselines = [nvml.used_bytes(i) for i in indices]
        run.device_peaks = [None] * len(indices)
        run.device_steps_peaks = [None] * len(indices)
        run.device_baseline = run.device_baselines[0] if indices else None
    with tempfile.TemporaryFile("w+") as out, tempfile.TemporaryFile("w+") as err:
        proc = subprocess.Popen(argv, stdout=out, stderr=err, text=True, env=env)
        stop = threading.Event()

        def sample() -> None:
            steps = phase_file is not None and os.path.exists(phase_file)
            trainer = sum(filter(None, (pss_bytes(p) for p in descendants(proc.pid)))) or None
            daemon = pss_bytes(daemon_pid) if daemon_pid else None
            run.trainer_pss_peak = _peak(run.trainer_pss_peak, trainer)
            run.daemon_pss_peak = _peak(run.daemon_pss_peak, daemon)
            host = trainer + (daemon or 0) if trainer is not None else None
            run.host_pss_peak = _peak(run.host_pss_peak, host)
            if steps:
                run.trainer_pss_steps_peak = _peak(run.trainer_pss_steps_peak, trainer)
                run.daemon_pss_steps_peak = _peak(run.daemon_pss_steps_peak, daemon)
                run.host_pss_steps_peak = _peak(run.host_pss_steps_peak, host)
                run.steps_samples += 1
            if nvml is not None:
                for k, i in enumerate(indices):
                    used = nvml.used_bytes(i)
                    run.device_peaks[k] = _peak(run.device_peaks[k], used)
                    if steps:
                        run.device_steps_peaks[k] = _peak(run.device_steps_peaks[k], used)
                run.device_peak = run.device_peaks[0] if indices else None
            if tsd_used is not None:
                try:
                    run.tsd_used_peak = _peak(run.tsd_used_peak, tsd_used())
                except Exception:  # the daemon is being asked by a sampler; a failed query is no figure
                    pass
            run.samples += 1

        def loop() -> None:
            while not stop.wait(interval_s):
                sample()

        sampler = threading.Thread(target=loop, daemon=True)
        sampler.start()
        _, status, usage = os.wait4(proc.pid, 0)
        stop.set()
        sampler.join()
        proc.returncode = run.returncode = os.waitstatus_to_exitcode(status)
        run.rss_peak_bytes = usage.ru_maxrss * 1024
        out.seek(0)
        err.seek(0)
        run.stdout, run.stderr = out.read(), err.read()
    return run


# ---------------------------------------------------------------------------------------------
# Records


def start_tsd(binary: str, directory: str, pool: str, *args: str,
              timeout_s: float = 30) -> tuple[subprocess.Popen[bytes], str]:
    """Starts `binary` (tsd) on a socket in `directory` with `pool` bytes and `args`, its output in
    `directory`/tsd.log, and returns it and the socket once a client's attach answers. Exits with
    where to look when it exits first or does not answer within `timeout_s`."""
    import trainstream

    socket = os.path.join(directory, "tsd.sock")
    log_path = os.path.join(directory, "tsd.log")
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([binary, "--socket", socket, "--pool-size", pool, "--metrics-listen", "", *args],
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"tsd exited with {proc.returncode}; see {log_path}")
        try:
            trainstream.connect(socket=socket).close()
            return proc, socket
        except trainstream.DaemonUnavailable:
            time.sleep(0.1)
    proc.kill()
    raise SystemExit(f"tsd did not answer on {socket} within {timeout_s:.0f} s; see {log_path}")


def validate_record(rec: Any, where: str = "record") -> dict[str, Any]:
    """Checks one record's shape; raises RecordError naming what is wrong. Returns it."""
    if not isinstance(rec, dict):
        raise RecordError(f"{where}: a record is a JSON object, got {type(rec).__name__}")
    for key, typ in REQUIRED.items():
        if key not in rec:
            raise RecordError(f"{where}: missing {key!r}")
        if not isinstance(rec[key], typ) or (typ is int and isinstance(rec[key], bool)):
            raise RecordError(f"{where}: {key!r} must be {typ.__name__}, got {rec[key]!r}")
    if rec["schema"] != SCHEMA:
        raise RecordError(f"{where}: schema {rec['schema']} is not {SCHEMA}; regenerate it with this checkout")
    if rec["status"] not in STATUSES:
        raise RecordError(f"{where}: status must be one of {STATUSES}, got {rec['status']!r}")
    if rec["status"] != "ok" and not rec.get("reason"):
        raise RecordError(f"{where}: a {rec['status']} record needs a 'reason'")
    for key, v in rec["values"].items():
        ok = isinstance(v, (int, float)) and not isinstance(v, bool) or v is None or (
            isinstance(v, list) and all(isinstance(x, (int, float)) for x in v))
        if not ok:
            raise RecordError(f"{where}: value {key!r} must be a number or a list of numbers, got {v!r}")
    for key in ("commit", "time_utc"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            raise RecordError(f"{where}: {key!r} must be a string or null")
    return rec


def read_results(path: str) -> list[dict[str, Any]]:
    """Every record of one results file, checked; a malformed line is an error naming its line."""
    out = []
    with open(path) as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise RecordError(f"{path}:{n}: not JSON ({e}); fix or remove the line") from None
            out.append(validate_record(rec, f"{path}:{n}"))
    return out


def run_records(paths: list[str], run_id: str, tool: str) -> list[dict[str, Any]]:
    """The records of run `run_id` in the results files `paths` (each read once, missing ones
    skipped), for a command that continues that run: one figure measured by several commands, e.g.
    the rounds of an interleaved run split over calls to the GPU machine. `run_id` "last" is the
    newest run of the first file that has one. Exits with a message naming the files if none holds
    the run (`tool` names the command in it)."""
    per_file = [read_results(p) for p in dict.fromkeys(os.path.abspath(p) for p in paths) if os.path.exists(p)]
    if run_id == "last":
        run_id = next((recs[-1]["run_id"] for recs in per_file if recs), "")
    have = [r for recs in per_file for r in recs if r["run_id"] == run_id]
    if not have:
        raise SystemExit(f"{tool}: --run-id {run_id or 'last'}: no record of that run in {' or '.join(paths)} to "
                         f"continue (append the earlier command's records to one of them first)")
    return list({r["order"]: r for r in have}.values())  # a record in two of the files counts once


def read_results_dir(directory: str = RESULTS_DIR) -> list[dict[str, Any]]:
    """The records of every `*.jsonl` in `directory`, in file-name order."""
    out: list[dict[str, Any]] = []
    if not os.path.isdir(directory):
        return out
    for name in sorted(os.listdir(directory)):
        if name.endswith(".jsonl"):
            out.extend(read_results(os.path.join(directory, name)))
    return out


def median(xs: Iterable[float]) -> float:
    """The median (the mean of the middle two for an even count)."""
    return float(statistics.median(list(xs)))


def settled_median(xs: Sequence[float]) -> float:
    """A per-step figure of one run: the steps from the third on (all of them if there are fewer),
    their middle value, the upper one for an even count, as peers.py takes its step time."""
    tail = sorted(xs[2:]) or sorted(xs)
    return tail[len(tail) // 2]


class Recorder:
    """Appends the records of one invocation of a benchmark to its results file (by default
    bench/results/<benchmark>.jsonl). Commit, host and time are read once, at the start."""

    def __init__(self, benchmark: str, results: Optional[str] = None, command: Optional[str] = None,
                 run_id: Optional[str] = None, source: str = "measured") -> None:
        if not benchmark or not all(c.isalnum() or c in "_-." for c in benchmark):
            raise ValueError(f"benchmark name {benchmark!r}: use letters, digits, '_', '-' or '.'")
        self.benchmark = benchmark
        self.path = results or os.path.join(RESULTS_DIR, f"{benchmark}.jsonl")
        self.command = command if command is not None else command_line()
        self.run_id = run_id or new_run_id()
        self.source = source
        self.commit, self.dirty = git_commit()
        self.host = host_info()
        self.order = 0

    def record(self, mode: str, workload: dict[str, Any], values: dict[str, Any], status: str = "ok",
               reason: Optional[str] = None, repeat: int = 0, extra: Optional[dict[str, Any]] = None) -> dict[str, Any]:
        """Appends one record and returns it. `extra` holds fields beside the standard ones
        (e.g. `raw`: the benchmark's own output line)."""
        rec: dict[str, Any] = {"schema": SCHEMA, "benchmark": self.benchmark, "run_id": self.run_id, "order": self.order,
                               "repeat": repeat, "mode": mode, "status": status}
        if reason is not None:
            rec["reason"] = reason
        rec.update(workload=workload, values=values, commit=self.commit, dirty=self.dirty, time_utc=utc_now(),
                   host=self.host, command=self.command, source=self.source)
        if extra:
            rec.update(extra)
        validate_record(rec)
        os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
        with open(self.path, "a") as f:
            f.write(json.dumps(rec) + "\n")
        self.order += 1
        return rec


def record_lines(args: argparse.Namespace, lines: Iterable[str], echo: Any = sys.stdout) -> int:
    """The `record-lines` command: every JSON object line of `lines` becomes one record (its
    mode from --mode-keys joined by '/', workload from --workload-keys and --workload, numbers
    as values, the line itself as `raw`); every line is echoed. Returns the count recorded."""
    rec = Recorder(args.benchmark, args.results, command=args.command, run_id=args.run_id)
    fixed = {}
    for kv in args.workload or []:
        k, _, v = kv.partition("=")
        fixed[k] = v
    wkeys = [k for k in (args.workload_keys or "").split(",") if k]
    mkeys = [k for k in args.mode_keys.split(",") if k]
    n = 0
    for line in lines:
        echo.write(line if line.endswith("\n") else line + "\n")
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict):
            continue
        mode = "/".join(str(obj[k]) for k in mkeys if k in obj) or "default"
        workload = {**fixed, **{k: obj[k] for k in wkeys if k in obj}}
        values = {k: v for k, v in obj.items()
                  if k not in wkeys and k not in mkeys and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if "skipped" in obj:
            rec.record(mode, workload, {}, status="skipped", reason=str(obj["skipped"]), extra={"raw": obj})
        else:
            rec.record(mode, workload, values, extra={"raw": obj})
        n += 1
    return n


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    rl = sub.add_parser("record-lines", help="record the JSON lines read from stdin (echoing every line)")
    rl.add_argument("--benchmark", required=True)
    rl.add_argument("--results", default=None, help="results file (default bench/results/<benchmark>.jsonl)")
    rl.add_argument("--command", required=True, help="the benchmark's exact command line, as run")
    rl.add_argument("--run-id", default=None)
    rl.add_argument("--mode-keys", default="bench", help="keys whose values, joined by '/', name the mode")
    rl.add_argument("--workload-keys", default="", help="keys of a line that describe the workload, not a measurement")
    rl.add_argument("--workload", action="append", help="KEY=VALUE added to every record's workload")
    ck = sub.add_parser("check", help="check that results files are well-formed")
    ck.add_argument("files", nargs="+")
    a = ap.parse_args(argv)
    if a.cmd == "record-lines":
        n = record_lines(a, sys.stdin)
        print(f"benchlib: {n} records appended to {a.results or os.path.join(RESULTS_DIR, a.benchmark + '.jsonl')}",
              file=sys.stderr)
        return 0
    bad = 0
    for path in a.files:
        try:
            print(f"{path}: {len(read_results(path))} records")
        except (RecordError, OSError) as e:
            print(f"benchlib: {e}", file=sys.stderr)
            bad += 1
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
