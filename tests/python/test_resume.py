"""State that survives a crashed trainer (trainstream/resume.py, docs/python.md): a trainer
SIGKILLed between steps and restarted with resume=True equals an uninterrupted run bit for bit;
killed after backward with clipping, tsd rolls the held step back and the run is still exact;
killed in the middle of backward without clipping, it resumes without a hang and reports the
parameters already updated. And load_state_dict() refuses poison (issue 13, defect 8), changing
nothing."""
import copy
import json
import os
import subprocess
import sys

import pytest
import torch

import trainstream
from gpt import batches, loss_of, make_gpt, param_groups

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = 8


def run_trainer(tsd, tmp_path, name, *args, expect_killed=False):
    log, params = tmp_path / f"{name}.log", tmp_path / f"{name}.pt"
    cmd = [sys.executable, os.path.join(HERE, "resume_trainer.py"), "--socket", tsd.socket, "--steps", str(STEPS),
           "--log", str(log), "--params", str(params), *args]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
    if expect_killed:
        assert p.returncode == -9, (p.returncode, p.stderr)
        return None
    assert p.returncode == 0, p.stderr
    return json.loads(p.stdout.strip().splitlines()[-1])


def losses(tmp_path, name):
    with open(tmp_path / f"{name}.log") as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f)}


def params(tmp_path, name):
    return torch.load(tmp_path / f"{name}.pt", weights_only=True)


def job_sessions(tsd, job):
    with trainstream.connect(socket=tsd.socket) as c:
        return {j.name: j.sessions for j in c.jobs()}.get(job)


@pytest.mark.parametrize("where,clip", [("between", None), ("before-step", 1.0)])
def test_a_killed_trainer_resumes_bit_identically(tsd, tmp_path, where, clip):
    extra = ["--clip", str(clip)] if clip else []
    job = f"resume-{where}"
    run_trainer(tsd, tmp_path, "whole", "--job", f"{job}-whole", *extra)
    run_trainer(tsd, tmp_path, "cut", "--job", job, "--keep-for", "2m", "--kill-at", "5", "--kill-where", where, *extra,
                expect_killed=True)
    assert sorted(losses(tmp_path, "cut")) == list(range(5))
    assert job_sessions(tsd, job) == 0, "the job is kept after its trainer died"
    summary = run_trainer(tsd, tmp_path, "cut", "--job", job, "--resume", *extra)
    assert summary["resumed"] and summary["start"] == 5
    assert summary["ahead"] == []
    if where == "before-step":
        assert summary["rolled_back"], "the held final deliveries of step 5 were dropped"
    whole, cut = losses(tmp_path, "whole"), losses(tmp_path, "cut")
    assert cut == whole  # bit-identical losses, every step
    a, b = params(tmp_path, "whole"), params(tmp_path, "cut")
    for n in a:
        assert torch.equal(a[n], b[n]), n
    assert job_sessions(tsd, job) is None, "unwrap() released the resumed job"


def test_a_speculated_step_killed_before_step_is_undone_within_rounding(tsd, tmp_path):
    """clip_speculation=True in a kept job: the limit never bites, so step 5's updates are applied as
    backward delivers them; the trainer dies before step(). tsd undoes them (to within rounding) and
    the resumed run redoes step 5: its losses and weights stay within 1e-6 of an uninterrupted run's
    (clip_speculation="auto" holds in kept jobs, which keeps that bit-identical instead)."""
    extra = ["--clip", "100", "--clip-speculation"]
    job = "resume-speculated"
    run_trainer(tsd, tmp_path, "whole", "--job", f"{job}-whole", *extra)
    run_trainer(tsd, tmp_path, "cut", "--job", job, "--keep-for", "2m", "--kill-at", "5", "--kill-where", "before-step",
                *extra, expect_killed=True)
    summary = run_trainer(tsd, tmp_path, "cut", "--job", job, "--resume", *extra)
    assert summary["resumed"] and summary["start"] == 5 and summary["rolled_back"]
    whole, cut = losses(tmp_path, "whole"), losses(tmp_path, "cut")
    assert sorted(cut) == list(range(STEPS))
    assert all(cut[i] == whole[i] for i in range(5))
    assert all(abs(cut[i] - whole[i]) <= 1e-6 * abs(whole[i]) for i in range(5, STEPS)), (cut, whole)
    a, b = params(tmp_path, "whole"), params(tmp_path, "cut")
    worst = max((a[n] - b[n]).abs().max().item() for n in a)
    print(f"max |param diff| after the undone step: {worst:.3g}")
    assert worst <= 1e-6


def test_a_trainer_killed_mid_backward_resumes_and_reports(tsd, tmp_path):
    job = "resume-mid-backward"
    run_trainer(tsd, tmp_path, "cut", "--job", job, "--keep-for", "2m", "--kill-at", "3", "--kill-where", "backward",
                expect_killed=True)
    summary = run_trainer(tsd, tmp_path, "cut", "--job", job, "--resume")
    assert summary["start"] == 3
    assert summary["ahead"], "the last layers were updated before the kill"
    assert "ln.weight" in summary["ahead"], summary["ahead"]  # the final norm: its gradient comes early
    assert "blocks.0.qkv.weight" not in summary["ahead"] and "tok.weight" not in summary["ahead"], summary["ahead"]
    assert "were already updated in the interrupted step 4" in summary["describe"]
    got = losses(tmp_path, "cut")
    assert sorted(got) == list(range(STEPS))
    assert all(torch.isfinite(torch.tensor(v)) for v in got.values())
    assert all(torch.isfinite(p).all() for p in params(tmp_path, "cut").values())


def test_resume_is_refused_clearly(tsd, tmp_path):
    model = make_gpt()
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="need a job name of your own"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, keep_for="10m")
    with pytest.raises(ValueError, match="not a duration"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, job="x", keep_for="ten minutes")
    with pytest.raises(trainstream.TsdError, match="max_keep_for"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, job="x", keep_for="2h")
    with pytest.raises(trainstream.TsdError, match="no job 'never-ran' to resume"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, job="never-ran", resume=True)
    # A kept job of another model: the registration's mismatch is named; nothing changes.
    run_trainer(tsd, tmp_path, "cut", "--job", "resume-other", "--keep-for", "2m", "--kill-at", "1",
                expect_killed=True)
    small = torch.nn.Linear(4, 4)
    with pytest.raises(trainstream.FailedPrecondition, match="the kept job has 2 parameter groups, this registration 1"):
        trainstream.wrap(small, torch.optim.AdamW(small.parameters()), device="cpu", socket=tsd.socket,
                         job="resume-other", resume=True)
    summary = run_trainer(tsd, tmp_path, "cut", "--job", "resume-other", "--resume")
    assert summary["start"] == 1


# ---- load_state_dict() refuses poison (defect 8)

@pytest.fixture
def wrapped(tsd):
    model = make_gpt()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(param_groups(model, 0.1), lr=1e-3), device="cpu",
                                  socket=tsd.socket, offload=True, activation_offload=False)
    for t in batches(2):
        loss_of(model, t).backward()
        opt.step()
        opt.zero_grad()
    yield model, opt
    trainstream.unwrap(model)


def poisoned(sd, index, key, value):
    out = copy.deepcopy({"state": {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                                   for k, v in sd["state"].items()},
                         "param_groups": sd["param_groups"]})
    if key is None:
        del out["state"][index]
    elif key == "step":
        out["state"][index]["step"] = value
    else:
        out["state"][index][key].view(-1)[3] = value
    return out


@pytest.mark.parametrize("key,value,says", [
    ("exp_avg_sq", -1e-3, "'exp_avg_sq' holds -0.001.* can never be negative"),
    ("step", torch.tensor(-2.0), "'step' is -2.0; it must be >= 0"),
    ("step", torch.tensor(float("nan")), "'step' is nan; it must be finite"),
    ("step", torch.tensor(2.5), "must be a whole number"),
    ("exp_avg", float("inf"), "'exp_avg' holds inf at flat index 3; every value must be finite"),
    ("exp_avg_sq", float("nan"), "'exp_avg_sq' holds nan"),
    ("master", float("-inf"), "'master' holds -inf"),
    (None, None, r"no state for parameter {index} \(blocks\.0\.ln1\.weight\)"),
])
def test_load_state_dict_refuses_poison_and_changes_nothing(wrapped, key, value, says):
    model, opt = wrapped
    good = opt.state_dict()
    good = {"state": {k: {kk: (vv.clone() if torch.is_tensor(vv) else vv) for kk, vv in v.items()}
                      for k, v in good["state"].items()}, "param_groups": copy.deepcopy(good["param_groups"])}
    names = {id(p): n for n, p in model.named_parameters()}
    index = [i for i, p in enumerate(opt._index()) if names[id(p)] == "blocks.0.ln1.weight"][0]
    says = says.replace("{index}", str(index))
    bad = poisoned(good, index, key, value)
    bad["param_groups"][0]["lr"] = 0.5  # would be taken over by a successful load
    with pytest.raises(ValueError, match=says) as e:
        opt.load_state_dict(bad)
    if key is not None:
        assert "blocks.0.ln1.weight" in str(e.value), "the message names the parameter"
    assert opt.param_groups[0]["lr"] == 1e-3
    after = opt.state_dict()
    for k, st in good["state"].items():
        for part in ("exp_avg", "exp_avg_sq", "master"):
            assert torch.equal(after["state"][k][part], st[part]), (k, part)
        assert float(after["state"][k]["step"]) == float(st["step"])
    # The same state, intact, loads; a missing parameter loads as never stepped when asked.
    opt.load_state_dict(good)
    opt.load_state_dict(poisoned(good, index, None, None), allow_missing=True)
    assert index not in opt.state_dict()["state"]
