"""Kept jobs and resuming a crashed trainer (docs/python.md, "Surviving a crashed trainer").

`wrap(..., job="name", keep_for="10m")` asks tsd to keep the job (its memory, the optimizer's
masters, moments and step counts) for that long after its last session dies. A trainer started
again with `wrap(..., job="name", resume=True)` takes the kept optimizer over and continues from
it: the model's trainable parameters are set from tsd's state, not from the model it was given.

What a crash costs depends on where it struck:

* Between steps: nothing. The resumed run equals an uninterrupted one bit for bit (the trainer
  continues at `session.resumed.steps`, with the same data).
* During a step with `max_grad_norm`: nothing but the step. tsd holds a step's final deliveries
  until the commit at `step()`; a trainer that died before it finishes nothing, and tsd drops
  what it held (`rolled_back`), so the run resumes at the step boundary and redoes the step. A
  trainer that died after asking the commit has its step finished by tsd.
* During a step without clipping: buckets update while backward runs, so some buckets may hold
  step k+1 while others hold step k. Nothing is torn (an update in flight always completes in
  tsd). The resumed trainer redoes step k+1 and skips the deliveries of the buckets already
  there (`ahead`), so every bucket has taken k+1 steps afterwards; those buckets keep the update
  from the dead run's gradients, the others get the rerun's, computed with the `ahead` buckets
  already updated. From then on the run differs from an uninterrupted one (slightly).
* Half-accumulated gradients (`accumulation_steps`) are dropped: that step is redone.

To tell between steps from within a step without clipping, the client records, at the end of
every step, how many steps each bucket had taken, in a small region of the job
("trainstream/steps", a seqlock-guarded int64 array: [sequence, steps done, per bucket]).

Data parallel (`distributed=`, docs/distributed.md): the same, for a group. A rank that dies
fails the step on every rank of the job; tsd keeps the job (keep_for) and a restarted group of
as many ranks per node resumes it, every rank with resume=True. Each rank takes its rank of the
kept optimizer over, tsd settles it once for the node and gives every rank the same report; the
node's first rank keeps the step marks, settles from them and tells the node's other ranks, and
the ranks check that they all continue from the same step.
"""
from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable, Iterable, Optional

import torch

from .client import Client
from .durations import parse_duration
from .errors import FailedPrecondition, TsdError

# The region where a kept job's trainer records its step boundaries.
MARKS_REGION = "trainstream/steps"
_HEADER = 2  # [sequence (odd while a record is written), steps completed]


@dataclasses.dataclass
class ResumeInfo:
    """What `wrap(..., resume=True)` found: `unwrap_session(model).resumed`.

    steps: optimizer steps the dead trainer completed; continue the training loop from there.
    bucket_steps: tsd's step count of each bucket (in registration order: last layers first).
    ahead: names of the parameters updated in the interrupted step (their next delivery is skipped).
    rolled_back: names of the parameters whose held final gradient was dropped (clipping).
    dropped_partial: names of the parameters whose partial accumulation was dropped.
    orphaned_s: seconds the job had been without a trainer.
    marks: whether the dead trainer recorded its step boundaries (else `ahead` cannot be known).
    """

    steps: int
    bucket_steps: list[int]
    ahead: list[str]
    rolled_back: list[str]
    dropped_partial: list[str]
    orphaned_s: float
    marks: bool

    @property
    def mid_step(self) -> bool:
        """The trainer died inside a step that tsd could not finish or roll back cleanly."""
        return bool(self.ahead)

    def describe(self) -> str:
        out = f"resumed after {self.steps} completed steps (the job was without a trainer for {self.orphaned_s:.1f} s)"
        if self.rolled_back:
            out += f"; {len(self.rolled_back)} held gradients of the interrupted step were dropped (nothing applied)"
        if self.dropped_partial:
            out += f"; {len(self.dropped_partial)} partial accumulations were dropped"
        if self.ahead:
            out += (f"; {len(self.ahead)} parameters ({', '.join(self.ahead[:4])}{', ...' if len(self.ahead) > 4 else ''})"
                    f" were already updated in the interrupted step {self.steps + 1}: their gradients of the redone "
                    f"step are skipped, so the run differs slightly from an uninterrupted one from there")
        if not self.marks:
            out += "; the dead trainer kept no step marks, so updates of an interrupted step cannot be told apart"
        return out


class StepMarks:
    """The job's record of step boundaries (see the module's docstring)."""

    def __init__(self, region: Any, buckets: int) -> None:
        if region.size < 8 * (_HEADER + buckets):
            raise TsdError(f"the job's {MARKS_REGION} region holds {region.size} bytes, too few for {buckets} buckets")
        self.region = region  # keeps the mapping alive
        self.view = region.view(torch.int64, 0, _HEADER + buckets)
        self._index: Optional[tuple[tuple[int, ...], torch.Tensor]] = None

    @classmethod
    def create(cls, client: Client, buckets: int) -> "StepMarks":
        region = client.alloc(MARKS_REGION, 8 * (_HEADER + buckets))
        marks = cls(region, buckets)
        marks.view.zero_()
        return marks

    def record(self, steps: int, finaled: Iterable[int]) -> None:
        """Called at the end of each step, once every bucket of it is updated."""
        v = self.view
        key = tuple(sorted(finaled))
        if self._index is None or self._index[0] != key:
            self._index = (key, torch.tensor(key, dtype=torch.int64) + _HEADER)
        v[0] += 1  # odd: a record is being written
        v[1] = steps
        if key:
            v.index_add_(0, self._index[1], torch.ones(len(key), dtype=torch.int64))
        v[0] += 1

    def read(self) -> tuple[int, list[int], bool]:
        """(steps completed, per-bucket steps at that boundary, whether the record was whole)."""
        v = self.view.clone()
        return int(v[1]), [int(x) for x in v[_HEADER:]], int(v[0]) % 2 == 0


def settle(client: Client, report: dict[str, Any], names: list[str]) -> tuple[ResumeInfo, Optional[StepMarks], set[int]]:
    """From tsd's report and the job's step marks: the ResumeInfo, the marks (to keep recording)
    and the buckets whose next delivery must be skipped."""
    bucket_steps = [int(s) for s in report["bucket_steps"]]
    marks: Optional[StepMarks]
    try:
        marks = StepMarks(client.map(MARKS_REGION), len(bucket_steps))
    except TsdError:
        marks = None
    ahead: set[int] = set()
    if marks is not None:
        steps, at_boundary, whole = marks.read()
        if not whole:
            # The dead trainer died while recording the end of a step: every bucket of that step
            # was updated by then, so tsd's counts are the boundary.
            at_boundary = list(bucket_steps)
        for b, (now, then) in enumerate(zip(bucket_steps, at_boundary)):
            if now == then + 1:
                ahead.add(b)
            elif now != then:
                warnings.warn(f"trainstream resume: bucket {b} ({names[b]}) has taken {now} steps in tsd but {then} by "
                              f"the job's step marks; continuing from tsd's state")
        # Start the new record from the boundary (the ahead buckets catch up in the next step).
        with torch.no_grad():
            marks.view[_HEADER:] = torch.tensor(at_boundary, dtype=torch.int64)
            marks.view[1] = steps
            marks.view[0] = 0
    else:
        steps = int(report["committed"]) if report["committed"] else max(bucket_steps, default=0)
    info = ResumeInfo(steps=steps, bucket_steps=bucket_steps, ahead=[names[b] for b in sorted(ahead)],
                      rolled_back=[names[b] for b in report["rolled_back"]],
                      dropped_partial=[names[b] for b in report["dropped_partial"]],
                      orphaned_s=float(client._c.orphaned_s), marks=marks is not None)
    return info, marks, ahead


def restore_parameter(p: torch.nn.Parameter, master: torch.Tensor, param_slot: torch.Tensor, stepped: bool) -> None:
    """Sets a parameter (in the model's dtype and device) from tsd's state: the last update's
    output where the bucket has stepped (what an uninterrupted run copied into the model), else
    the fp32 master (which a step-0 registration took from the parameter)."""
    src = param_slot if stepped else master
    with torch.no_grad():
        p.view(-1).copy_(src.view(-1))


def check_options(opts: dict[str, Any]) -> None:
    """wrap()'s keep_for= and resume=, checked (and keep_for parsed to seconds) in place."""
    opts["keep_for"] = parse_duration(opts["keep_for"], "keep_for")
    if not isinstance(opts["resume"], bool):
        raise TypeError(f"resume must be True or False, not {opts['resume']!r}")
    if (opts["keep_for"] or opts["resume"]) and not opts["job"]:
        raise ValueError("keep_for= and resume= need a job name of your own (job='my-run'): the default name carries the "
                         "process id, so a restarted trainer could never find its job again")
    if opts["resume"]:
        if opts["param_offload"] == "auto":
            opts["param_offload"] = False  # the default: a resumed run pages no weights (not supported yet)
        if opts["param_offload"] not in (False, None):
            raise ValueError("resume=True does not support param_offload= yet; resume without weight paging")
        opts["check_memory"] = False  # the optimizer's state is in tsd already, charged to the job


def register(client: Client, request: Callable[[str], dict[str, Any]], moment_dtype: str,
             auto: bool, dp: Any = None) -> tuple[Any, dict[str, Any], str]:
    """Takes over the kept optimizer: (handle, tsd's report, the moment dtype). With
    moment_dtype="auto" the kept job's moment dtype is the one that matches. `dp` (data
    parallel, distributed.DataParallel): every rank of the restarted group resumes, as its rank
    of the node's optimizer; if one cannot, every rank raises."""
    choices = [moment_dtype] + ([m for m in ("float32", "bfloat16") if m != moment_dtype] if auto else [])

    def take_over() -> tuple[Any, dict[str, Any], str]:
        for i, md in enumerate(choices):
            try:
                spec = request(md) if dp is None else dp.rank_spec(request(md))
                handle, report = client._resume_optimizer(**spec)
                return handle, report, md
            except FailedPrecondition as e:
                if i + 1 == len(choices) or "moments are" not in str(e):
                    raise
        raise AssertionError("unreachable")

    return take_over() if dp is None else dp.everyone(take_over, "resume the job's kept optimizer")


def start(session: Any, client: Client, buckets: list[tuple[torch.nn.Parameter, int, int]],
          report: Optional[dict[str, Any]], keep: bool, dp: Any = None) -> Optional[ResumeInfo]:
    """Sets up the session's step marks (a kept or resumed job) and, on resume, what the
    trainer that died left: `session.resumed`, the steps completed, the buckets to skip once.
    Data parallel (`dp`): the node's first rank keeps the marks (they are the node's), settles
    from them and tells the other ranks (DataParallel.settle_resume), so every rank continues
    from the same step."""
    keeps_marks = dp is None or dp.writes_masters
    if report is None:
        if keep and keeps_marks:
            session.marks = StepMarks.create(client, len(buckets))
        return None
    names = [session.param_names.get(id(p), f"parameter {index}") for p, _, index in buckets]
    if dp is None:
        info, marks, ahead = settle(client, report, names)
    else:
        info, marks, ahead = dp.settle_resume(lambda: settle(client, report, names))
    if keeps_marks:
        session.marks = marks if marks is not None else StepMarks.create(client, len(buckets))
    session.skip = ahead
    session.steps = info.steps
    session.resumed = info
    session.events.append(f"resume: {info.describe()}")
    if info.ahead or not info.marks:
        warnings.warn(f"trainstream: {info.describe()}")
    return info
