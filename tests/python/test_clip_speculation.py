"""wrap(max_grad_norm=..., clip_speculation=True): tsd applies each update as its gradient arrives while
the last step's norm was under 0.8x the limit, and undoes and redoes it at step() when clipping bites
after all. Compared with the same run holding every update until step() (clip_speculation=False) and
with torch's AdamW + clip_grad_norm_, on a small GPT with tied weights, two groups and a scheduler
stepped right after step() (as Hugging Face's Trainer does)."""
import copy
from typing import Any

import pytest
import torch

import trainstream
from gpt import batches, loss_of, make_gpt, param_groups

HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
STEPS = 20
SPIKES = {6: 4.0, 13: 3.0}  # loss scales of a few steps: their gradient norm jumps


def scale(step: int, spikes: bool) -> float:
    return SPIKES.get(step, 1.0) if spikes else 1.0


def schedule(step: int) -> float:
    return min(1.0, (step + 1) / 4) * 0.95 ** step


def run_torch(limit: float, spikes: bool = False) -> tuple[list[torch.Tensor], list[float]]:
    model = make_gpt(0)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), foreach=False, **HP)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    norms = []
    for i, t in enumerate(batches(STEPS)):
        (loss_of(model, t) * scale(i, spikes)).backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), limit)))
        opt.step()
        sched.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], norms


def run_tsd(tsd: Any, limit: float, speculate: Any, spikes: bool = False, **wrap_kw: Any) -> dict[str, Any]:
    model = make_gpt(0)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    if speculate is not None:
        wrap_kw["clip_speculation"] = speculate
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, max_grad_norm=limit, **wrap_kw)
    session = trainstream.unwrap_session(model)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule)
    norms, losses = [], []
    try:
        for i, t in enumerate(batches(STEPS)):
            loss = loss_of(model, t) * scale(i, spikes)
            loss.backward()
            opt.step()
            norms.append(opt.last_grad_norm)
            losses.append(loss.item())
            sched.step()
            opt.zero_grad()
        with trainstream.connect(socket=tsd.socket) as c:
            job = next(j for j in c.jobs() if j.name == session.client.job)
    finally:
        trainstream.unwrap(model)
    return dict(params=[p.detach().clone() for p in model.parameters()], norms=norms, losses=losses,
                speculated=job.speculated_commits, redone=job.redone_commits, busy=job.work_busy_s,
                share=job.work_busy_share)


def max_diff(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def test_speculation_that_never_bites_is_bit_identical_to_holding(tsd):
    """A limit far above the norm: every step after the first speculates and keeps its updates, and
    the run is the held run bit for bit (the scheduler's new lr each step causes no redo)."""
    fast = run_tsd(tsd, 1e3, True)
    held = run_tsd(tsd, 1e3, False)
    assert fast["losses"] == held["losses"]
    assert all(torch.equal(x, y) for x, y in zip(fast["params"], held["params"]))
    assert (fast["speculated"], fast["redone"]) == (STEPS - 1, 0)
    assert (held["speculated"], held["redone"]) == (0, 0)
    assert fast["busy"] > 0 and held["busy"] > 0  # the threads' time on the job's updates
    assert 0 < fast["share"] <= 1 and 0 < held["share"] <= 1  # and their share of it, lately
    ref, _ = run_torch(1e3)
    assert max_diff(fast["params"], ref) <= 1e-6


def test_speculation_redone_when_clipping_bites_stays_within_1e6_of_torch(tsd):
    """A limit above the usual norms, and two steps whose loss is scaled up (a spike): most steps
    speculate and keep, the spikes speculate and then bite (undone and redone at step()), the steps
    after them hold (the last norm was over 0.8x the limit). After 20 steps both tsd runs are within
    1e-6 of torch's clip_grad_norm_ + AdamW."""
    _, free = run_torch(float("inf"))
    limit = 1.3 * max(free)
    ref, norms = run_torch(limit, spikes=True)
    fast = run_tsd(tsd, limit, True, spikes=True)
    held = run_tsd(tsd, limit, False, spikes=True)
    # What the daemon did, from the norms it clipped by: a step speculates when the last was < 0.8x.
    spec = [i for i in range(1, STEPS) if fast["norms"][i - 1] < 0.8 * limit]
    bit_after = [i for i in spec if fast["norms"][i] > limit]
    assert fast["speculated"] == len(spec) > 0
    assert fast["redone"] == len(bit_after) == len(SPIKES), fast["norms"]
    assert (held["speculated"], held["redone"]) == (0, 0)
    assert any(n > limit for n in norms) and any(n < limit for n in norms)
    assert max_diff(held["params"], ref) <= 1e-6
    assert max_diff(fast["params"], ref) <= 1e-6
    print(f"max |param diff| vs torch: held {max_diff(held['params'], ref):.3g}, "
          f"speculated {max_diff(fast['params'], ref):.3g}")
    assert fast["norms"] == pytest.approx(norms, rel=1e-5)


@pytest.mark.parametrize("kept", [False, True])
def test_auto_speculates_except_in_a_kept_job(tsd, kept):
    """The default ("auto") speculates; in a kept job (keep_for=) it holds, so a crash inside a step
    resumes bit-identically."""
    kw = dict(job="spec-kept", keep_for="1m") if kept else {}
    got = run_tsd(tsd, 1e3, None, **kw)
    assert (got["speculated"], got["redone"]) == ((0, 0) if kept else (STEPS - 1, 0))


def test_clip_speculation_option_is_checked(tsd):
    model = make_gpt(0)
    opt = torch.optim.AdamW(model.parameters(), **HP)
    with pytest.raises(ValueError, match="clip_speculation must be True, False or"):
        trainstream.wrap(copy.deepcopy(model), opt, device="cpu", socket=tsd.socket, clip_speculation="yes")
