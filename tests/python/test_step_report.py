"""What a wrapped model reports to tsd after each step (`trainstream._report`): the wait in
`step()` and the pagers' traffic, which `tsctl top` and `tsctl jobs --json` show."""
import json
import os
import subprocess
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import trainstream
from trainstream import _C, _report
from conftest import tsd_binary


class FakeHandle:
    def __init__(self):
        self.calls = []

    def report_step(self, wait_s, h2d_bytes, d2h_bytes):
        self.calls.append((wait_s, h2d_bytes, d2h_bytes))


class FakeSession:
    """What report_step reads of an engine.Session."""

    def __init__(self, pager=None, act_pager=None):
        self.handle, self.pager, self.act_pager = FakeHandle(), pager, act_pager


def session(pager=None, act_pager=None):
    return FakeSession(pager, act_pager)


def test_a_steps_traffic_is_the_weights_step_and_the_growth_of_the_activations_counter():
    weights = SimpleNamespace(last_step_h2d_bytes=None)
    acts = SimpleNamespace(paged_bytes=0)
    s = session(weights, acts)
    started = time.perf_counter()
    weights.last_step_h2d_bytes, acts.paged_bytes = 1000, 300
    _report.report_step(s, started)
    weights.last_step_h2d_bytes, acts.paged_bytes = 500, 700
    _report.report_step(s, started)
    weights.last_step_h2d_bytes, acts.paged_bytes = 200, 50  # reset_stats() restarted the counter
    _report.report_step(s, started)
    # Weights move host to device only; paged activations go out and come back.
    assert [c[1:] for c in s.handle.calls] == [(1300, 300), (900, 400), (250, 50)]
    assert all(c[0] >= 0 for c in s.handle.calls)


def test_no_pagers_no_traffic():
    s = session()
    _report.report_step(s, time.perf_counter())
    assert s.handle.calls[0][1:] == (0, 0)


def tsctl():
    path = os.environ.get("TSCTL_BIN", os.path.join(os.path.dirname(tsd_binary()), "tsctl"))
    if not os.path.exists(path):
        pytest.skip(f"no tsctl at {path} (set TSCTL_BIN)")
    return path


@pytest.mark.skipif(not hasattr(_C.Optimizer, "report_step"),
                    reason="the installed extension predates Optimizer.report_step: rebuild it")
def test_wrap_reports_each_step_to_tsctl(tsd):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket)
    try:
        x = torch.randn(4, 8)
        for _ in range(3):
            model(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
        out = subprocess.run([tsctl(), "--socket", tsd.socket, "jobs", "--json"], capture_output=True,
                             text=True, check=True).stdout
        jobs = [j for j in json.loads(out) if j["activity"] is not None]
        assert len(jobs) == 1, out
        a = jobs[0]["activity"]
        assert a["steps"] == 3 and a["client_reports"] == 3, a
        assert a["params"] == sum(p.numel() for p in model.parameters()), a
        assert a["step_wait_s"] > 0 and a["h2d_bytes_per_step"] == 0 and a["d2h_bytes_per_step"] == 0, a
        assert a["moment_dtype"] == "F32", a
    finally:
        trainstream.unwrap(model)
