"""One rank of tests/python/test_distributed.py (and test_distributed_nccl.py, one rank per GPU
with NCCL: `main`'s backend): a gloo group over localhost, a small MLP trained
data parallel through tsd (`wrap(..., distributed=True)`) next to torch's DDP + AdamW on the same
data, results as JSON in OUT_DIR/rank<R>.json.

Modes:
  parity  20 fp32 steps with clipping and accumulation; records both models' parameters' largest
          difference and, on rank 0, tsd's view of the job (sessions, used_bytes) before unwrap.
          `parity-chunked`: the same with the gradients reduced in 512-byte chunks.
  kill    the last rank kills itself (SIGKILL) after the backward of step 3; the others record the
          error their step() raised and how long it took.
  kill-in-tsd  the same, but the last rank dies inside step() 3, after the gradients' reductions and
          before it delivers its buckets to tsd: the others wait on tsd, not on a collective.
  diverge two nodes (ranks 0-1 and 2-3): after step 2, rank 2 changes a master in its node's tsd;
          at the nodes' state comparison (every 4 steps here) every rank's step() raises.
  kept-kill-between  a kept job (job=KEPT_JOB, keep_for): KILL_AT steps with clipping, then every
          rank kills itself (SIGKILL) between steps. `-nokeep`: the same without keep_for.
  kept-kill-in-step  a kept job: after KILL_AT steps, the last rank dies inside step() (after the
          reductions, before it delivers its buckets or commits); the others record their error.
  kept-kill-after-commit  every rank dies inside step() KILL_AT + 1 once all asked its commit (before
          they see it applied or record the step's end).
  kept-resume  a restarted group: wrap(..., resume=True) on KEPT_JOB, the run continued to
          RESUME_STEPS; then, in the same processes, the same run uninterrupted (another job) and
          DDP + AdamW: records what resume reported and the parameters' differences.
  (`-noclip` after kept-kill-in-step and kept-resume: the same without max_grad_norm.)
  stream, share, paging, stale, misaccumulate  wrap()'s options under data parallel (dist_options.py, for
          tests/python/test_distributed_options.py).
"""
from __future__ import annotations

import json
import os
import signal
import time
import traceback
from typing import Any

import torch

STEPS = 20
ACCUM = 2
MAX_NORM = 0.05
LR = 1e-2
QUOTA = "64KiB"  # one optimizer of the MLP (44 KiB) fits, two would not


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 32), torch.nn.Tanh(),
                               torch.nn.Linear(32, 4))


def _batches(rank: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    g = torch.Generator().manual_seed(100 + rank)
    return [[(torch.randn(6, 8, generator=g), torch.randn(6, 4, generator=g)) for _ in range(ACCUM)]
            for _ in range(steps)]


def _loss(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.mse_loss(model(x), y) / ACCUM


def reference(rank: int, device: str, steps: int = STEPS, micros: int = ACCUM, clip: bool = True) -> list[torch.Tensor]:
    """torch DDP + torch.optim.AdamW over the first `micros` micro-batches of each of `steps`
    steps: no_sync for all but the last micro-batch, clip_grad_norm_ when `clip`."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    model = _model().to(device)
    ddp = DDP(model)
    opt = torch.optim.AdamW(ddp.parameters(), lr=LR, weight_decay=0.01)
    for micro in _batches(rank, steps):
        micro = micro[:micros]
        for i, (x, y) in enumerate(micro):
            x, y = x.to(device), y.to(device)
            if i < len(micro) - 1:
                with ddp.no_sync():
                    _loss(ddp, x, y).backward()
            else:
                _loss(ddp, x, y).backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(ddp.parameters(), MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().cpu().clone() for p in model.parameters()]


def trained(rank: int, sock: str, device: str, out: dict[str, Any], out_dir: str) -> list[torch.Tensor]:
    import trainstream
    model = _model().to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    model, opt = trainstream.wrap(model, opt, device=device, socket=sock, distributed=True, max_grad_norm=MAX_NORM,
                                  accumulation_steps=ACCUM, quota=QUOTA)
    session = trainstream.unwrap_session(model)
    session.dp.check_every = 4  # with several nodes, they compare their states every 4 steps
    for micro in _batches(rank, STEPS):
        for x, y in micro:
            _loss(model, x.to(device), y.to(device)).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.distributed.barrier()
    with trainstream.connect(socket=sock) as c:
        jobs = [j for j in c.jobs() if j.name == session.client.job]
    out.update(job=session.client.job, jobs=len(jobs), sessions=jobs[0].sessions if jobs else 0,
               used_bytes=jobs[0].used_bytes if jobs else 0, state_bytes=session.state_bytes,
               local_world=session.dp.local_world, nodes=len(session.dp.nodes), events=session.events[-1])
    # A checkpoint per node, by its first rank: the node's one optimizer state holds every
    # parameter's master, equal to the trained parameters.
    if session.dp.local_rank == 0:
        from trainstream import _state
        path = os.path.join(out_dir, f"node{session.dp.node}.state")
        with open(path, "wb") as f:
            opt.save_state(f)
        fd = os.open(path, os.O_RDONLY)
        try:
            tensors, _ = _state.read(fd)
        finally:
            os.close(fd)
        out["checkpoint_matches"] = all(
            torch.equal(tensors[_state.entry(b, "master")].view(ps.param.shape), ps.param.detach().cpu())
            for b, ps in enumerate(session.params))
    torch.distributed.barrier()  # every rank read the job (and the checkpoints were written) before any unwraps
    params = [p.detach().cpu().clone() for p in model.parameters()]
    trainstream.unwrap(model)
    return params


def kill(rank: int, world: int, sock: str, out: dict[str, Any], in_tsd: bool) -> None:
    import trainstream
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True)
    victim = rank == world - 1
    if in_tsd and victim:
        session = trainstream.unwrap_session(model)
        _die_at_first_delivery(session, lambda: session.steps == 3)
    for step, micro in enumerate(_batches(rank, 6)):
        x, y = micro[0]
        _loss(model, x, y).backward()
        if step == 3 and victim and not in_tsd:
            os.kill(os.getpid(), signal.SIGKILL)
        if step == 3:
            time.sleep(0.5)  # the victim is dead by now
        t0 = time.monotonic()
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - the error is the result
            out.update(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0, step=step)
            return
        opt.zero_grad(set_to_none=True)
    out.update(error=None)


def _die_at_first_delivery(session: Any, when: Any) -> None:
    """This rank reduces at step() (not during backward) and kills itself (SIGKILL) at its first
    delivery to tsd while `when()`: every collective of that step is done (the other ranks wait on
    tsd, not on a collective), and its own buckets' sums are here, not yet in tsd."""
    dp = session.dp
    dp.reducer.streams = False
    deliver = dp.deliver

    def deliver_then_die(*args: Any, **kwargs: Any) -> Any:
        if when():
            os.kill(os.getpid(), signal.SIGKILL)
        return deliver(*args, **kwargs)

    dp.deliver = deliver_then_die


KEPT_JOB = "dp-kept"
KILL_AT = 3        # steps the killed group completed
RESUME_STEPS = 7   # steps of the whole run


def _kept_wrap(sock: str, job: str, clip: bool, **options: Any) -> tuple[torch.nn.Module, Any]:
    import trainstream
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.01)
    return trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True,
                            max_grad_norm=MAX_NORM if clip else 0.0, quota=QUOTA, job=job, **options)


def _kept_steps(model: torch.nn.Module, opt: Any, rank: int, first: int, last: int) -> None:
    for micro in _batches(rank, RESUME_STEPS)[first:last]:
        x, y = micro[0]
        _loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


class _DieAfterCommit:
    """A rank's optimizer handle whose commit kills the process once every rank asked it."""

    def __init__(self, handle: Any) -> None:
        self._handle = handle

    def __getattr__(self, name: str) -> Any:
        return getattr(self._handle, name)

    def commit(self, *args: Any, **kwargs: Any) -> Any:
        self._handle.commit(*args, **kwargs)
        torch.distributed.barrier()  # every rank's commit is in
        time.sleep(0.2)
        os.kill(os.getpid(), signal.SIGKILL)


def kept_kill(rank: int, world: int, sock: str, out: dict[str, Any], where: str, keep: bool, clip: bool) -> None:
    import trainstream
    model, opt = _kept_wrap(sock, KEPT_JOB, clip, keep_for="60s" if keep else None)
    _kept_steps(model, opt, rank, 0, KILL_AT)
    if where == "between":
        torch.distributed.barrier()
        time.sleep(0.2)  # every rank is out of the barrier
        os.kill(os.getpid(), signal.SIGKILL)
    victim = rank == world - 1
    session = trainstream.unwrap_session(model)
    if where == "after-commit":  # every rank
        session.handle = _DieAfterCommit(session.handle)
    elif victim:  # it dies before it delivers its buckets or commits
        _die_at_first_delivery(session, lambda: True)
    x, y = _batches(rank, RESUME_STEPS)[KILL_AT][0]
    _loss(model, x, y).backward()
    t0 = time.monotonic()
    try:
        opt.step()
    except Exception as e:  # noqa: BLE001 - the error is the result
        out.update(error=f"{type(e).__name__}: {e}", seconds=time.monotonic() - t0, step=session.steps)
        return
    out.update(error=None)


def kept_resume(rank: int, world: int, sock: str, out: dict[str, Any], clip: bool) -> None:
    import trainstream
    try:
        model, opt = _kept_wrap(sock, KEPT_JOB, clip, keep_for="60s", resume=True)
    except Exception as e:  # noqa: BLE001 - a refused resume is the result
        out.update(error=f"{type(e).__name__}: {e}")
        return
    session = trainstream.unwrap_session(model)
    info = session.resumed
    out.update(error=None, steps=info.steps, bucket_steps=info.bucket_steps, rolled_back=info.rolled_back,
               ahead=info.ahead, expected=list(session.dp.expected))
    _kept_steps(model, opt, rank, info.steps, RESUME_STEPS)
    resumed = [p.detach().clone() for p in model.parameters()]
    out["final_steps"] = [int(session.handle.steps(b)) for b in range(session.handle.num_buckets)]
    torch.distributed.barrier()
    trainstream.unwrap(model)
    # The same run, uninterrupted (another job of the same tsd), and DDP + AdamW.
    model, opt = _kept_wrap(sock, "dp-straight", clip, keep_for="60s")
    _kept_steps(model, opt, rank, 0, RESUME_STEPS)
    straight = [p.detach().clone() for p in model.parameters()]
    torch.distributed.barrier()
    trainstream.unwrap(model)
    ref = reference(rank, "cpu", steps=RESUME_STEPS, micros=1, clip=clip)  # one micro-batch a step, as _kept_steps
    out.update(bit_equal=all(torch.equal(a, b) for a, b in zip(resumed, straight)),
               straight_diff=max(float((a - b).abs().max()) for a, b in zip(resumed, straight)),
               ddp_diff=max(float((a - b).abs().max()) for a, b in zip(resumed, ref)),
               moved=max(float((a - b).abs().max()) for a, b in zip(resumed, [p.detach() for p in _model().parameters()])))


def diverge(rank: int, sock: str, out: dict[str, Any]) -> None:
    import trainstream
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True)
    session = trainstream.unwrap_session(model)
    session.dp.check_every = 4
    for step, micro in enumerate(_batches(rank, 8)):
        x, y = micro[0]
        _loss(model, x, y).backward()
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - the error is the result
            out.update(error=f"{type(e).__name__}: {e}", step=step)
            return
        opt.zero_grad(set_to_none=True)
        if step == 1 and rank == 2:
            session.params[0].master[0] += 1e-3  # node 1's tsd now holds another model
    out.update(error=None)


def main(rank: int, world: int, port: int, sockets: list[str], mode: str, out_dir: str, device: str,
         backend: str = "gloo") -> None:
    """One rank of `mode`. `backend` is the process group's (gloo; with NCCL, e.g. "cpu:gloo,cuda:nccl",
    rank r runs on cuda:r, as a launcher with one rank per GPU places it)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    out: dict[str, Any] = {"rank": rank}
    import dist_options  # the wrap() options' modes (imports this module)
    try:
        if "nccl" in backend:
            torch.cuda.set_device(rank)
            out["cuda_device"] = torch.cuda.current_device()
        torch.distributed.init_process_group(backend, rank=rank, world_size=world)
        if mode in ("parity", "parity-chunked"):
            if mode == "parity-chunked":  # at step() through a host buffer, in many chunks: biases share one,
                import trainstream.distributed  # a weight is one alone
                import trainstream.reduction
                trainstream.distributed.REDUCTION = "host"
                trainstream.reduction.REDUCE_CHUNK_BYTES = 512
            ref = reference(rank, device)
            got = trained(rank, sockets[rank], device, out, out_dir)
            out["max_diff"] = max(float((a - b).abs().max()) for a, b in zip(ref, got))
            out["moved"] = max(float((a - b).abs().max()) for a, b in zip(ref, [p.detach() for p in _model().parameters()]))
        elif mode == "stream":
            dist_options.stream_parity(rank, world, sockets[rank], out)
        elif mode == "share":
            dist_options.share_parity(rank, sockets[rank], out)
        elif mode == "paging":
            dist_options.paging_parity(rank, sockets[rank], out)
        elif mode == "stale":
            dist_options.stale_use(rank, world, sockets[rank], out)
        elif mode == "misaccumulate":
            dist_options.misaccumulate(rank, sockets[rank], out)
        elif mode == "diverge":
            diverge(rank, sockets[rank], out)
        elif mode in ("kill", "kill-in-tsd"):
            kill(rank, world, sockets[rank], out, mode == "kill-in-tsd")
        elif mode.startswith("kept-kill-"):
            where = next(w for w in ("between", "in-step", "after-commit") if mode.startswith(f"kept-kill-{w}"))
            kept_kill(rank, world, sockets[rank], out, where, not mode.endswith("-nokeep"), not mode.endswith("-noclip"))
        elif mode.startswith("kept-resume"):
            kept_resume(rank, world, sockets[rank], out, not mode.endswith("-noclip"))
    except Exception:  # noqa: BLE001 - reported to the test
        out["exception"] = traceback.format_exc()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(out, f)
    if mode not in ("parity", "parity-chunked", "stream", "share", "paging", "stale", "kept-resume", "kept-resume-noclip"):
        os._exit(0)  # the group has a dead member: destroying it could wait on it
    torch.distributed.destroy_process_group()
