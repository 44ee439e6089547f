"""The modes of tests/python/test_distributed_options.py, run by dist_worker.main: wrap()'s
options under data parallel (the gradients' reductions streamed during backward, overlap_forward,
the GPU share, activation and weight paging, accumulation), each against DDP + AdamW and against
the same run without the option. Shares dist_worker's data, loss and settings."""
from __future__ import annotations

import json
import os
import subprocess
from typing import Any

import torch

import dist_worker as dw


class _Branchy(torch.nn.Module):
    """The MLP's shape plus `extra`, used only by rank 0's forwards (the other ranks add zeros to
    its sum), and `never`, used by no rank (no update at all, as torch.optim.AdamW skips it)."""

    def __init__(self, rank: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.trunk = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        self.extra = torch.nn.Linear(8, 4)
        self.never = torch.nn.Linear(4, 4)
        self.rank = rank

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.trunk(x)
        return y + self.extra(x) if self.rank == 0 else y


def _branchy_steps(rank: int, steps: int) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """dw.ACCUM micro-batches a step, but the last step has one (a partial accumulation)."""
    batches = dw._batches(rank, steps)
    return batches[:-1] + [batches[-1][:1]]


def _ddp_reference(model: torch.nn.Module, steps: list[list[tuple[torch.Tensor, torch.Tensor]]],
                   find_unused: bool = False) -> list[torch.Tensor]:
    """DDP + AdamW on `model` over `steps` (no_sync for all but each step's last micro-batch),
    clipped at MAX_NORM: the parameters after."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, find_unused_parameters=find_unused)
    opt = torch.optim.AdamW(ddp.parameters(), lr=dw.LR, weight_decay=0.01)
    for micro in steps:
        for i, (x, y) in enumerate(micro):
            if i < len(micro) - 1:
                with ddp.no_sync():
                    dw._loss(ddp, x, y).backward()
            else:
                dw._loss(ddp, x, y).backward()
        torch.nn.utils.clip_grad_norm_(ddp.parameters(), dw.MAX_NORM)
        opt.step()
        opt.zero_grad(set_to_none=True)
    return [p.detach().clone() for p in model.parameters()]


def _branchy_reference(rank: int) -> list[torch.Tensor]:
    """DDP (find_unused_parameters) + AdamW on the branchy model over `_branchy_steps`."""
    return _ddp_reference(_Branchy(rank), _branchy_steps(rank, dw.STEPS), find_unused=True)


def stream_parity(rank: int, world: int, sock: str, out: dict[str, Any]) -> None:
    """Parameters that get gradients on some ranks only or on none, a partial last accumulation,
    clipping: tsd streaming the reductions during backward, tsd reducing at step() (the same
    collectives, launched later), tsd streaming with overlap_forward (updates completed by the
    next forward) and DDP (find_unused_parameters) + AdamW."""
    import trainstream
    ref = _branchy_reference(rank)

    def run(streams: bool, job: str, overlap: bool = False) -> tuple[list[torch.Tensor], list[int], list[int]]:
        model = _Branchy(rank)
        opt = torch.optim.AdamW(model.parameters(), lr=dw.LR, weight_decay=0.01)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True, job=job,
                                      max_grad_norm=dw.MAX_NORM, accumulation_steps=dw.ACCUM, overlap_forward=overlap)
        session = trainstream.unwrap_session(model)
        session.dp.reducer.streams = streams
        launched = []  # buckets whose reductions started before step(), per step
        for step, micro in enumerate(_branchy_steps(rank, dw.STEPS)):
            for x, y in micro:
                dw._loss(model, x, y).backward()
            launched.append(len(session.dp.reducer.taken))
            opt.step()
            if overlap:
                out.setdefault("owed", []).append(len(session.waits.pending))
                if step == 5:  # a state dict mid-run waits for the updates it reads
                    sd = model.state_dict()
                    out["state_dict_current"] = all(
                        torch.equal(sd[name], ps.master.view(ps.shape)) for name, ps in
                        ((n, session.by_param[id(p)]) for n, p in model.named_parameters()))
            opt.zero_grad(set_to_none=True)
        order = list(session.dp.reducer.order)
        out.setdefault("events", []).append(session.events[-1])
        opt.synchronize()  # overlap_forward: the last step's updates are still owed to the model
        torch.distributed.barrier()
        params = [p.detach().clone() for p in model.parameters()]
        trainstream.unwrap(model)
        return params, launched, order

    streamed, launched, order = run(True, "dp-streamed")
    later, launched_later, _ = run(False, "dp-at-step")
    overlapped, _, _ = run(True, "dp-overlap", overlap=True)
    orders: list[Any] = [None] * world
    torch.distributed.all_gather_object(orders, order)
    untouched = [p.detach() for p in _Branchy(rank).parameters()]
    out.update(launched=launched, launched_later=launched_later, orders=orders,
               bit_equal=all(torch.equal(a, b) for a, b in zip(streamed, later)),
               overlap_bit_equal=all(torch.equal(a, b) for a, b in zip(streamed, overlapped)),
               max_diff=max(float((a - b).abs().max()) for a, b in zip(ref, streamed)),
               moved=max(float((a - b).abs().max()) for a, b in zip(ref, untouched)),
               never_moved=all(torch.equal(a, b) for a, b in zip(streamed[-2:], untouched[-2:])))


def share_parity(rank: int, sock: str, out: dict[str, Any]) -> None:
    """optimizer_gpu_fraction under data parallel: part of the parameters updated by torch's AdamW
    in every rank (their gradients averaged over the group), the rest in tsd, clipped by the global
    norm; against DDP (find_unused_parameters) + AdamW, with the branchy model and a partial last
    accumulation."""
    import trainstream
    ref = _branchy_reference(rank)
    # "auto" from each rank's own VRAM budget: rank 0 has room for everything, the others for about
    # 3/4 of the share's bytes (the first 2 tensors); the ranks agree on the smallest.
    model = _Branchy(rank)
    opt = torch.optim.AdamW(model.parameters(), lr=dw.LR, weight_decay=0.01)
    roomy = trainstream.plan_wrap(model, opt, device="cpu", socket=sock, optimizer_gpu_fraction="auto",
                                  budget=trainstream.Budget(vram_usable=1 << 40))
    total = sum(p.numel() for p in model.parameters())
    half = int((roomy.demand.vram_resident - roomy.demand.gpu_optimizer + 9 * total) / 0.75)
    budgets = {"auto": trainstream.Budget(vram_usable=1 << 40 if rank == 0 else half)}
    for fraction in (0.5, 0.9, "auto"):
        model = _Branchy(rank)
        opt = torch.optim.AdamW(model.parameters(), lr=dw.LR, weight_decay=0.01)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True,
                                      job=f"dp-share-{fraction}", max_grad_norm=dw.MAX_NORM, accumulation_steps=dw.ACCUM,
                                      optimizer_gpu_fraction=fraction, budget=budgets.get(str(fraction)))
        session = trainstream.unwrap_session(model)
        for micro in _branchy_steps(rank, dw.STEPS):
            for x, y in micro:
                dw._loss(model, x, y).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        torch.distributed.barrier()
        got = [p.detach().clone() for p in model.parameters()]
        out[f"share_{fraction}"] = dict(
            share=len(session.share.entries), tsd=len(session.params),
            max_diff=max(float((a - b).abs().max()) for a, b in zip(ref, got)),
            events=[e for e in session.events if "optimizer_gpu_fraction" in e],
            never_moved=all(torch.equal(a, b) for a, b in zip(got[-2:], list(_Branchy(rank).parameters())[-2:])))
        trainstream.unwrap(model)


class _Stack(torch.nn.Module):
    """A stack of blocks (an nn.ModuleList), as activation paging needs, then a head."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(8, 32)
        self.blocks = torch.nn.ModuleList(torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Tanh())
                                          for _ in range(3))
        self.head = torch.nn.Linear(32, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for b in self.blocks:
            h = h + b(h)
        return self.head(h)


def _activity(sock: str, job: str) -> Any:
    """`tsctl jobs --json`'s activity of `job` (what the clients reported of their steps)."""
    from conftest import tsd_binary
    tsctl = os.environ.get("TSCTL_BIN", os.path.join(os.path.dirname(tsd_binary()), "tsctl"))
    listed = json.loads(subprocess.run([tsctl, "--socket", sock, "jobs", "--json"], capture_output=True, text=True,
                                       check=True).stdout)
    return next((j["activity"] for j in listed if j["name"] == job), None)


def paging_parity(rank: int, sock: str, out: dict[str, Any]) -> None:
    """Paging under data parallel, each rank its own: the blocks' saved activations into host
    memory tsd lends it (activation_offload), blocks 0 and 2's weights out of the model between
    uses (param_offload: their tsd slot, shared by the node's ranks, is their only copy), both with
    overlap_forward; each bit-identical to the run without paging and within 1e-6 of DDP + AdamW
    (clipping, accumulation)."""
    import trainstream
    ref = _ddp_reference(_Stack(), dw._batches(rank, dw.STEPS))
    variants: dict[str, dict[str, Any]] = {
        "none": {}, "act": dict(activation_offload=True), "weights": dict(param_offload=[0, 2]),
        "both-overlap": dict(activation_offload=True, param_offload=[0, 2], overlap_forward=True)}
    runs = {}
    for name, options in variants.items():
        model = _Stack()
        opt = torch.optim.AdamW(model.parameters(), lr=dw.LR, weight_decay=0.01)
        model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True, job=f"dp-{name}",
                                      max_grad_norm=dw.MAX_NORM, accumulation_steps=dw.ACCUM, **options)
        session = trainstream.unwrap_session(model)
        if session.act_pager is not None:
            session.act_pager.min_bytes = 256  # 1 MiB would page nothing of this small model
        paged = 0
        for micro in dw._batches(rank, dw.STEPS):
            for x, y in micro:
                dw._loss(model, x, y).backward()
            if session.act_pager is not None:
                paged += session.act_pager.paged_tensors
            opt.step()
            opt.zero_grad(set_to_none=True)
        opt.synchronize()
        torch.distributed.barrier()
        runs[name] = [p.detach().clone() for p in model.parameters()] if session.pager is None else \
            [session.by_param[id(p)].master.view(session.by_param[id(p)].shape).clone() for p in model.parameters()]
        out[name] = dict(paged_tensors=paged,
                         weight_pages=0 if session.pager is None else sum(b.paged for b in session.pager.blocks))
        if rank == 0:  # the job's activity, reported by the node's first rank (tsctl top)
            out[name]["activity"] = _activity(sock, session.client.job)
        torch.distributed.barrier()
        trainstream.unwrap(model)
        back = [p.detach().clone() for p in model.parameters()]  # unwrap() brought paged weights back
        out[name].update(unwrapped_equal=all(torch.equal(a, b) for a, b in zip(back, runs[name])))
    for name in variants:
        out[name].update(bit_equal=all(torch.equal(a, b) for a, b in zip(runs[name], runs["none"])),
                         max_diff=max(float((a - b).abs().max()) for a, b in zip(ref, runs[name])))


def stale_use(rank: int, world: int, sock: str, out: dict[str, Any]) -> None:
    """overlap_forward with a weight used outside any module's forward: `extra` runs in the first
    (recorded) forward only; later, a penalty on its weight in the loss is its only use, so no
    pre-hook takes its update and its next gradient finds the update still owed. The rank takes it
    then (an event says so) and the ranks stay identical."""
    import trainstream
    model = _Branchy(0)  # every rank uses `extra` in the first forward
    opt = torch.optim.AdamW(model.parameters(), lr=dw.LR, weight_decay=0.01)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True, job="dp-stale",
                                  max_grad_norm=dw.MAX_NORM, overlap_forward=True)
    session = trainstream.unwrap_session(model)
    penalized = model.extra.weight
    for step, micro in enumerate(dw._batches(rank, 6)):
        x, y = micro[0]
        (dw._loss(model, x, y) + 1e-2 * penalized.pow(2).sum()).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        model.rank = 1  # from the second forward on, `extra` does not run
    opt.synchronize()
    got = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    everyone: list[Any] = [None] * world
    torch.distributed.all_gather_object(everyone, got)
    out.update(events=[e for e in session.events if "still pending" in e],
               same=all(torch.equal(g, everyone[0]) for g in everyone))
    torch.distributed.barrier()
    trainstream.unwrap(model)


def misaccumulate(rank: int, sock: str, out: dict[str, Any]) -> None:
    """Two backward passes before step() without accumulation_steps=2: the second raises."""
    import trainstream
    model = dw._model()
    opt = torch.optim.AdamW(model.parameters(), lr=dw.LR)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=sock, distributed=True)
    x, y = dw._batches(rank, 1)[0][0]
    dw._loss(model, x, y).backward()
    try:
        dw._loss(model, x, y).backward()
    except RuntimeError as e:
        out.update(error=str(e))
        return
    out.update(error=None)
