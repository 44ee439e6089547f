"""One measured mode of `finetune_bench.py`, run in its own process (`finetune_bench.py --mode
MODE ...`): builds the model, wraps it through tsd (or runs a local peer), times the steps with
CUDA events, optionally profiles one step and saves and restores, and prints its figures as one
`@@{json}` line for the parent. Also `--run-capped`, which runs a peer script under a VRAM cap."""
from __future__ import annotations

import argparse
import cProfile
import json
import os
import pickle
import pstats
import re
import runpy
import sys
import tempfile
import time
from typing import Any, Optional

import benchlib
import stream
import tsd_timeline
from finetune_model import build_model, host_built
from finetune_modes import LORA_MODES, TSD_MODES, option_value

def run_tsd_mode(a: argparse.Namespace) -> None:
    """One tsd mode, or a peer this script runs itself (bnb_qlora), in this process; prints
    @@{json} like peers.py does."""
    import torch

    cuda = a.device == "cuda"
    history = os.environ.get("TSD_BENCH_MEMORY_HISTORY")  # a folder: the allocator's history, dumped on failure
    if cuda and history:
        # Python frames only, and a bounded history: the snapshot of a 14B run with C++ frames was
        # too large to bring back from the GPU machine.
        torch.cuda.memory._record_memory_history(max_entries=100_000, stacks="python")
    try:
        _run_mode(a, cuda)
    except BaseException:
        # Where it failed and what tsd's planner had decided by then, then (with a history) what
        # held the device's memory: the parent prints the end of this output.
        print(f"{a.mode} failed at step {_PROGRESS['step']} ({_PROGRESS['phase']}); the session's events:",
              file=sys.stderr)
        for e in list(getattr(_PROGRESS["session"], "events", []) or [])[-30:]:
            print(f"  {e}", file=sys.stderr)
        if cuda and history:
            import memory_summary

            os.makedirs(history, exist_ok=True)
            snapshot = torch.cuda.memory._snapshot()
            torch.cuda.memory._record_memory_history(enabled=None)
            with open(os.path.join(history, f"{safe_name(a.mode)}-failed.pickle"), "wb") as f:
                pickle.dump(snapshot, f)
            print(memory_summary.summarize(snapshot, top=30, trace=25, depth=3), file=sys.stderr)
        sys.stderr.flush()
        raise


# Where the running mode is (step, phase, its session), for the report of a failure.
_PROGRESS: dict[str, Any] = {"step": 0, "phase": "setup", "session": None}


def _run_mode(a: argparse.Namespace, cuda: bool) -> None:
    import torch

    if a.cap_gib:
        torch.cuda.set_per_process_memory_fraction(a.cap_gib * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    t0 = time.time()
    lora = a.mode in LORA_MODES
    model, vocab = build_model(a, a.mode)
    n_params = sum(p.numel() for p in model.parameters())  # before wrap(): paged weights leave placeholders
    n_trained_all = sum(p.numel() for p in model.parameters() if p.requires_grad)  # so do the trained ones
    if not host_built(a, a.mode):
        model = model.to(a.device)
    param_dtype = torch.bfloat16 if a.mode.startswith("tsd_bf16") else None
    moment_dtype = "bfloat16" if a.mode.startswith("tsd_bf16m") else a.moment_dtype
    activation_offload = option_value(a.activation_offload) if a.mode.endswith("_act") else False
    activation_recompute = option_value(a.activation_recompute) if a.mode.endswith("_act") else False
    if activation_recompute == "auto" and activation_offload != "auto":
        activation_recompute = False  # "auto" acts on activation_offload="auto"'s pages: with another, none
    param_offload = option_value(a.param_offload) if a.param_offload else False
    stock_opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4 if lora else 1e-5)
    autocast = cuda and not lora
    session = None
    # The trainer's host memory before wrap() (the model built, CUDA up): the base that
    # check_memory's host_bytes (tsd's regions and the client's own needs) is added to.
    host_before_wrap = benchlib.pss_bytes(os.getpid())
    built_s = time.time() - t0  # the model built (and quantized) and on its device
    if a.mode in TSD_MODES:
        import trainstream

        model, opt = trainstream.wrap(model, stock_opt, device=a.device, socket=a.socket,
                                      offload=option_value(a.offload),
                                      moment_dtype=moment_dtype, param_dtype=param_dtype,
                                      activation_offload=activation_offload, param_offload=param_offload,
                                      activation_recompute=activation_recompute,
                                      max_grad_norm=a.clip or None, overlap_forward=a.overlap == "on",
                                      optimizer_gpu_fraction=option_value(a.gpu_fraction))
        session = trainstream.unwrap_session(model)
        _PROGRESS["session"] = session
        clip = None
    else:  # a peer: torch's AdamW on the GPU, clipping as Hugging Face's Trainer does
        opt = stock_opt
        trained = [p for p in model.parameters() if p.requires_grad]
        clip = (lambda: torch.nn.utils.clip_grad_norm_(trained, a.clip)) if a.clip else None
    setup_s = time.time() - t0
    ids = torch.randint(0, vocab, (a.batch, a.seq), device=a.device)
    loader = iter(random_token_loader(a, vocab)) if a.loader_workers else None
    data_ms: list[float] = []
    # The activation pager's cumulative bytes before each step, with the pager counting them: under
    # activation_offload="auto" the first step's profiler gives way to the pager after that step.
    act_paged: list[tuple[int, int]] = []

    def act_sample() -> tuple[int, int]:
        pager_now = getattr(session, "act_pager", None)
        return id(pager_now), int(getattr(pager_now, "paged_bytes", 0) or 0)
    times, fwd_ms, bwd_ms, step_ms = [], [], [], []
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    retries: list[int] = []  # the caching allocator's retries in each step
    retries_seen = 0
    if cuda:
        torch.cuda.reset_peak_memory_stats()
        retries_seen = torch.cuda.memory_stats().get("num_alloc_retries", 0)
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
    # tsd's global gradient norm of each step (what it clipped by), as peers.py records its own
    norms: Optional[list[Optional[float]]] = [] if session is not None and a.clip else None
    # The figures are of the settled steps: from the third, or from the first after every "auto"
    # decision of tsd was made (the weight plan settled, the activation pages and the GPU share
    # chosen; they take up to five steps), whichever is later. The window runs from that step's start
    # to the end of the last, its updates drained (overlap_forward pays a step's updates in the next
    # forward; the last step's are owed at the end): its mean is a step's whole work.
    settled_after: Optional[int] = None  # steps run when every decision had been made
    starts: list[float] = []
    # tsd's threads' seconds on this job's bucket work before each step (JobActivity.work_busy_s):
    # over the window, per step and thread, the time the updates take with every thread on them.
    tsd_job = TsdJob(session, a.socket)
    busy_at: list[Optional[float]] = []
    # The trainer's phases on the control page's clock, beside tsd's stamps of each update it
    # waited for (Session.timeline): where tsd's threads had nothing to do (tsd_timeline.py).
    timeline: Optional[list[Any]] = [] if session is not None else None
    if session is not None:
        session.timeline = timeline
    marks: list[tuple[int, int, int, int, int]] = []  # step, start, forward, backward, step() ends (ns)
    timed: list[int] = []  # the step of each entry of times (the profiled one is left out)
    # TSD_BENCH_STEP_PROFILE=FOLDER: the Python calls of the settled steps' step() (cProfile), by
    # cumulative time, into FOLDER/step-calls-ENTRY.txt (the --modes entry): where step() waits.
    step_calls = cProfile.Profile() if os.environ.get("TSD_BENCH_STEP_PROFILE") else None
    for step in range(a.steps):
        _PROGRESS.update(step=step + 1, phase="forward")
        sync()
        prof = start_profile(cuda) if step + 1 == a.profile_step else None
        busy_at.append(tsd_job.busy())
        t = time.perf_counter()
        t_ns = time.monotonic_ns()
        starts.append(t)
        act_paged.append(act_sample())
        data_wait: Optional[float] = None
        if loader is not None:  # the next batch from the workers (the wait counts in the step)
            ids = next(loader).to(a.device, non_blocking=True)
            data_wait = (time.perf_counter() - t) * 1e3
        if cuda:
            ev[0].record()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=autocast):
            loss = model(input_ids=ids, labels=ids).loss
        if cuda:
            ev[1].record()
        if norms is not None and step > 0:
            # The last step's norm, read once this forward has waited for its updates (asking right
            # after step() would wait for the whole commit, which overlap_forward runs during it).
            norms.append(opt.last_grad_norm)
        tb = time.perf_counter()
        fwd_ns = time.monotonic_ns()
        _PROGRESS["phase"] = "backward"
        loss.backward()
        if cuda:
            ev[2].record()
        ts = time.perf_counter()
        bwd_ns = time.monotonic_ns()
        _PROGRESS["phase"] = "optimizer step"
        if clip is not None:
            clip()
        if step_calls is not None and settled_after is not None:
            step_calls.enable()
        opt.step()
        if step_calls is not None:
            step_calls.disable()
        step_ms.append((time.perf_counter() - ts) * 1e3)
        marks.append((step, t_ns, fwd_ns, bwd_ns, time.monotonic_ns()))
        opt.zero_grad(set_to_none=True)
        sync()
        if cuda:
            now = torch.cuda.memory_stats().get("num_alloc_retries", 0)
            retries.append(now - retries_seen)
            retries_seen = now
        if settled_after is None and decisions_made(session):
            settled_after = step + 1
        if prof is not None:  # the profiled step is left out of the figures: the profiler slows it
            end_profile(prof, a.entry or a.mode)  # the --modes entry: MODE and MODE:uncapped apart
            continue
        times.append(time.perf_counter() - t)
        timed.append(step)
        if data_wait is not None:  # like the step times, without the profiled step's
            data_ms.append(data_wait)
        if cuda:
            fwd_ms.append(ev[0].elapsed_time(ev[1]))
            bwd_ms.append(ev[1].elapsed_time(ev[2]))
        else:  # wall time: the CPU runs forward and backward synchronously
            fwd_ms.append((tb - t) * 1e3)
            bwd_ms.append((ts - tb) * 1e3)

    if step_calls is not None:
        write_step_calls(step_calls, a.entry or a.mode)
    if session is not None and hasattr(opt, "synchronize"):
        opt.synchronize()  # the last step's updates, owed with overlap_forward
    sync()
    drained_ns = time.monotonic_ns()
    if session is not None:
        session.timeline = None
    first = min(2, a.steps - 1)  # the first settled step (0-based)
    if settled_after is not None and settled_after < a.steps:
        first = max(first, settled_after)
    window_steps = a.steps - first if a.steps else 0
    profiled_in_window = bool(a.profile_step) and a.profile_step > first
    step_s_window = ((time.perf_counter() - starts[first]) / window_steps
                     if window_steps and not profiled_in_window else None)
    # The job as tsd reports it once its steps are done: the threads' busy time, the bytes it holds,
    # its speculated and redone commits.
    mine = tsd_job.jobs()
    busy_end = sum(j.work_busy_s for j in mine) if mine else None
    busy_start = busy_at[first] if window_steps else None
    threads = getattr(getattr(session, "handle", None), "threads", None)
    tsd_busy_s = ((busy_end - busy_start) / window_steps / threads
                  if busy_end is not None and busy_start is not None and threads and step_s_window else None)
    tsd_job.close()
    tsd_gaps = None
    if timeline and window_steps and not profiled_in_window:
        tsd_gaps = tsd_timeline.idle_by_phase(timeline, window_phases(marks, first, drained_ns), window_steps)
    held = sum(j.used_bytes for j in mine)
    speculated = sum(j.speculated_commits for j in mine)
    redone = sum(j.redone_commits for j in mine)
    keep = [k for k, st in enumerate(timed) if st >= first] or list(range(len(timed)))

    def settled(xs: list[float]) -> Optional[float]:
        """The middle (the upper one for an even count) of a per-step figure's settled steps."""
        tail = sorted(xs[k] for k in keep if k < len(xs))
        return tail[len(tail) // 2] if tail else None
    if norms is not None and a.steps:
        norms.append(opt.last_grad_norm)

    med = benchlib.settled_median

    pager = getattr(session, "pager", None)
    handle = getattr(session, "handle", None)
    host: dict[str, Any] = {}
    if session is not None:
        trained = [p for p in model.parameters() if p.requires_grad]
        moments = str(getattr(opt, "moment_dtype", moment_dtype))
        # Clipping reads each gradient a second time for the norm, unless every step after the
        # first speculated (the squares are summed in the update's pass, from cache) and none redid.
        fused = bool(a.clip) and speculated >= a.steps - 1 and redone == 0
        grad_bytes = param_bytes = trained[0].element_size() if trained else 4
        per = stream.host_bytes_per_param(grad_bytes, param_bytes, 2 if moments == "bfloat16" else 4,
                                          bool(a.clip) and not fused)
        # Counted before wrap(): a paged block's parameters are empty placeholders between uses, yet
        # their updates move the same host bytes as the resident ones'.
        n_trained = n_trained_all
        act_paged.append(act_sample())
        act_steps = stream.growth_per_step(act_paged)
        act_out = med([float(x) for x in act_steps]) if act_steps else 0.0  # activation pages out a step
        weights_in = pager.moved_bytes / a.steps if pager is not None else 0.0  # paged weights in a step
        paging = 2 * act_out + weights_in  # the activations out and back, the weights in
        # The GPU share's parameters (optimizer_gpu_fraction; everything after offload="auto"'s switch)
        # move no optimizer bytes through host memory.
        share = getattr(session, "share", None)
        on_device = n_trained if not getattr(session, "offloading", True) else (share.numel if share is not None else 0)
        in_tsd = max(0, n_trained - on_device)
        host = dict(host_bytes_per_param=per["total"], host_bytes_breakdown=per, trained_params=n_trained,
                    gpu_share_params=on_device, paging_host_bytes_per_step=paging,
                    host_bytes_per_step=in_tsd * per["total"] + paging,
                    # Over PCIe: the gradients down and the updated weights up; the activation pages
                    # down and back; the paged weights up.
                    pcie_d2h_bytes_per_step=in_tsd * grad_bytes + act_out,
                    pcie_h2d_bytes_per_step=in_tsd * param_bytes + act_out + weights_in)
    events = list(getattr(session, "events", []) or [])
    mplan = getattr(session, "memory_plan", None)
    if mplan is not None and host_before_wrap is not None:
        host.update(host_pss_before_wrap_gib=host_before_wrap / 2**30,
                    # wrap()'s host bytes and the activation pages checked after the first step
                    check_memory_host_gib=(mplan.host_bytes + session.activation_host_bytes) / 2**30,
                    check_memory_room_gib=(mplan.host_room / 2**30 if mplan.host_room is not None else None))
    record = dict(
        mode=a.mode, arch=a.arch, params=n_params, batch=a.batch, seq=a.seq,
        clip=a.clip, speculated_commits=speculated, redone_commits=redone, step_s_median=settled(times), steps=times, step_s_window=step_s_window,
        tsd_busy_s=tsd_busy_s, tsd_idle_s=(step_s_window - tsd_busy_s if tsd_busy_s is not None else None),
        tsd_gaps=tsd_gaps, tsd_gap_ms=(tsd_gaps or {}).get("total_ms"),
        **{f"tsd_gap_{k}_ms": v for k, v in ((tsd_gaps or {}).get("per_step_ms") or {}).items()},
        settled_after=settled_after, first_settled_step=first + 1,
        peak_gib=torch.cuda.max_memory_allocated() / 2**30 if cuda else None, tsd_gib=held / 2**30,
        setup_s=setup_s, loss=loss.item(), moments=str(getattr(opt, "moment_dtype", moment_dtype)),
        param_dtype=str(param_dtype), activation_offload=activation_offload, activation_recompute=activation_recompute,
        recomputed_blocks=(len(session.recompute.blocks_recomputed)
                           if session is not None and session.recompute is not None else 0),
        paged_gib_per_step=(pager.moved_bytes / a.steps / 2**30 if pager is not None else 0.0),
        paged_blocks=(len(pager.paged) if pager is not None else 0),
        blocks=(len(pager.blocks) if pager is not None else None), param_offload=param_offload,
        reserved_peak_gib=torch.cuda.max_memory_reserved() / 2**30 if cuda else None,
        # Times the caching allocator hit the cap, freed its cache (cudaFree: a device sync) and
        # retried, over the timed steps: a run planned close to its cap pays for each.
        alloc_retries=sum(retries) if cuda else None,
        alloc_retries_per_step=retries if cuda else None,
        plan=[e for e in events if "plan" in e or "offload" in e or "activation" in e or "gpu_fraction" in e
              or "watchdog" in e][-8:],
        # setup_s split: the model built and on its device, then wrap() (its event line says
        # where wrap()'s time went: the plan, the registration in tsd, the parameters' copies)
        build_s=built_s, wrap_s=(setup_s - built_s if a.mode in TSD_MODES else None),
        **({"grad_norms": norms} if norms is not None else {}),
        wrap_event=next((e for e in events if e.startswith("wrap: ")), None),
        offload_final=str(getattr(session, "offload", None)),
        gpu_forward_ms=settled(fwd_ms), gpu_backward_ms=settled(bwd_ms), step_call_ms=settled(step_ms),
        isa=getattr(handle, "isa", None), threads=getattr(handle, "threads", None), grad_ckpt=a.grad_ckpt,
        loader_workers=a.loader_workers, data_wait_ms=med(data_ms) if data_ms else None,
        data_wait_ms_steps=data_ms or None, **host)
    if session is not None and a.save_restore:
        _PROGRESS["phase"] = "save and restore"
        try:  # a failure here is recorded beside the steps' figures, as unwrap()'s is
            import save_restore

            batches = save_restore.fixed_batches(vocab, a.batch, a.seq, a.device)
            record.update(save_restore.check(model, opt, batches, autocast))
        except Exception:
            import traceback

            traceback.print_exc()
            record["resume_exact"] = 0
            record["save_restore_failed"] = 1
    if session is not None:
        # unwrap() is part of the run (a model handed back must fit where it goes back); a failure
        # there is reported beside the steps' figures instead of discarding them.
        import traceback

        import trainstream

        _PROGRESS["phase"] = "unwrap"
        t_unwrap = time.time()
        try:
            trainstream.unwrap(model)
            record["unwrap_s"] = time.time() - t_unwrap
            record["unwrap_failed"] = 0
        except Exception:
            traceback.print_exc()
            record["unwrap_failed"] = 1
        record["unwrap_device"] = str(next(model.parameters()).device)
    print("@@" + json.dumps(record), flush=True)


def decisions_made(session: Any) -> bool:
    """Whether tsd made every decision it takes from measured steps: the weight plan settled
    (param_offload="auto"), the activation pages chosen and refined (activation_offload="auto": its
    profiler is gone, and so is the refinement it left) and the GPU share chosen
    (optimizer_gpu_fraction="auto"). A peer has none to make."""
    if session is None:
        return True
    planner = getattr(session, "planner", None)
    profiling = type(getattr(session, "act_pager", None)).__name__ == "ActivationProfiler"
    return (planner is None or bool(getattr(planner, "done", True))) and not profiling \
        and getattr(session, "act_refine", None) is None and getattr(session, "auto_share", None) is None


class TsdJob:
    """This session's job as tsd reports it (`Client.jobs()`), over a connection of its own: the
    seconds its optimizer threads spent on the job before each step, and the job's figures at the
    end. Without a session there is no connection and no job."""

    def __init__(self, session: Any, socket: Optional[str]) -> None:
        self.job = getattr(getattr(session, "client", None), "job", None)
        self.client: Any = None
        if session is not None:
            import trainstream

            self.client = trainstream.connect(socket=socket)

    def jobs(self) -> list[Any]:
        """The session's job (every job, where the session names none); [] without a session."""
        if self.client is None:
            return []
        return [j for j in self.client.jobs() if self.job is None or j.name == self.job]

    def busy(self) -> Optional[float]:
        """The threads' seconds on the job so far (JobActivity.work_busy_s); None without a session."""
        return sum(j.work_busy_s for j in self.jobs()) if self.client is not None else None

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None


def window_phases(marks: list[tuple[int, int, int, int, int]], first: int,
                  drained_ns: int) -> list[tuple[str, int, int]]:
    """The trainer's phases from step `first` (0-based) on, back to back: each step's forward,
    backward and step(), the loop's own work up to the next step ("between"), and after the last
    step the wait for its owed updates ("drain")."""
    out: list[tuple[str, int, int]] = []
    steps = [m for m in marks if m[0] >= first]
    for i, (_step, start, fwd, bwd, done) in enumerate(steps):
        nxt = steps[i + 1][1] if i + 1 < len(steps) else None
        out += [("forward", start, fwd), ("backward", fwd, bwd), ("step", bwd, done)]
        if nxt is not None:
            out.append(("between", done, nxt))
        else:
            out.append(("drain", done, drained_ns))
    return out


def write_step_calls(prof: "cProfile.Profile", mode: str) -> None:
    """The profile of the settled steps' step() calls, by cumulative and by own time."""
    folder = os.environ["TSD_BENCH_STEP_PROFILE"]
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, f"step-calls-{safe_name(mode)}.txt"), "w") as f:
        for key in ("cumulative", "tottime"):
            pstats.Stats(prof, stream=f).sort_stats(key).print_stats(25)
        pstats.Stats(prof, stream=f).sort_stats("cumulative").print_callers(r"wait|synchronize|commit|idle")


def safe_name(mode: str) -> str:
    """`mode` (a --modes entry, e.g. "tsd_bf16_act:cap=16:gpu=auto") as a file name of letters,
    digits, '.', '_' and '-' only: the device tool brings back no file whose name has others."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", mode)


def start_profile(cuda: bool) -> Any:
    """A started torch profiler (CPU, and CUDA on a GPU) for `--profile-step`."""
    import torch

    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    prof = torch.profiler.profile(activities=acts, record_shapes=False, with_stack=True)  # Python calls in the trace
    prof.start()
    return prof


def end_profile(prof: Any, mode: str) -> None:
    """Stops `prof` and writes, into $TSD_BENCH_PROFILE_DIR (default: the temporary folder), the
    operations by CPU time and by device time (profile-MODE.txt, also printed to stderr, which
    finetune_bench relays) and a gzipped Chrome trace (profile-MODE.json.gz); MODE as
    `safe_name` writes it."""
    import torch

    prof.stop()
    folder = os.environ.get("TSD_BENCH_PROFILE_DIR") or tempfile.gettempdir()
    os.makedirs(folder, exist_ok=True)
    base = os.path.join(folder, f"profile-{safe_name(mode)}")
    prof.export_chrome_trace(base + ".json.gz")
    table = prof.key_averages()
    text = f"--profile-step: {mode}; by CPU time:\n" + table.table(sort_by="self_cpu_time_total", row_limit=30)
    if torch.cuda.is_available():
        text += "\nby device time:\n" + table.table(sort_by="self_device_time_total", row_limit=20)
    with open(base + ".txt", "w") as f:
        f.write(text + "\n")
    print(text, file=sys.stderr, flush=True)


class RandomTokens:
    """An endless stream of random token batches (what the benchmark trains on), made in a
    DataLoader's worker processes: each worker draws from its own seed."""

    def __init__(self, vocab: int, batch: int, seq: int) -> None:
        self.vocab, self.batch, self.seq = vocab, batch, seq

    def __iter__(self) -> Any:
        import torch

        g = torch.Generator().manual_seed(torch.initial_seed() % 2**63)
        while True:
            yield torch.randint(0, self.vocab, (self.batch, self.seq), generator=g)


def random_token_loader(a: argparse.Namespace, vocab: int) -> Any:
    """--loader-workers: a torch DataLoader of `a.loader_workers` worker processes (pinned batches
    on a GPU run), as a trainer's input pipeline would be."""
    import torch.utils.data as tud

    class RandomTokenDataset(RandomTokens, tud.IterableDataset):  # type: ignore[misc]
        pass

    dataset = RandomTokenDataset(vocab, a.batch, a.seq)
    return tud.DataLoader(dataset, batch_size=None, num_workers=a.loader_workers, pin_memory=a.device == "cuda",
                          persistent_workers=True, prefetch_factor=2)


def run_capped() -> None:
    """Internal: `--run-capped GIB SCRIPT ARGS...` runs SCRIPT as __main__ under a VRAM cap (for
    offload_peers.py, which has no --cap-gib of its own)."""
    import torch

    cap, script, rest = float(sys.argv[2]), sys.argv[3], sys.argv[4:]
    torch.cuda.set_per_process_memory_fraction(cap * 2**30 / torch.cuda.get_device_properties(0).total_memory)
    sys.argv = [script, *rest]
    runpy.run_path(script, run_name="__main__")
