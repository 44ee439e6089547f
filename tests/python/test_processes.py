"""Several training processes and failures: two jobs at once, the daemon killed mid-training, a
training process killed."""
import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

import trainstream
from gpt import batches, make_gpt, train

HERE = os.path.dirname(os.path.abspath(__file__))


def worker(socket, job, *args):
    return subprocess.Popen([sys.executable, os.path.join(HERE, "worker.py"), "--socket", socket, "--job", job, *args],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_training_processes_at_once_are_both_correct(tsd):
    procs = [worker(tsd.socket, f"proc-{i}", "--seed", str(i), "--steps", "12") for i in range(2)]
    results = []
    for p in procs:
        out, err = p.communicate(timeout=300)
        assert p.returncode == 0, err
        results.append(json.loads(out.strip().splitlines()[-1]))
    for r in results:
        assert r["max_diff"] <= 1e-6, r
        assert r["losses"] == pytest.approx(r["ref_losses"], rel=1e-5)
    assert results[0]["losses"] != results[1]["losses"]  # two different runs, not one twice
    with trainstream.connect(socket=tsd.socket) as c:
        assert not [j for j in c.jobs() if j.name.startswith("proc-")]


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_daemon_killed_mid_training_raises_tsd_error_not_a_hang(own_tsd, sig):
    model = make_gpt()
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=own_tsd.socket)
    data = batches(4)
    train(model, opt, data[:2], 2)
    own_tsd.kill(sig)
    t0 = time.time()
    with pytest.raises(trainstream.TsdError) as e:
        train(model, opt, data[2:], 2)
    assert time.time() - t0 < 10
    assert isinstance(e.value, trainstream.DaemonUnavailable)
    msg = str(e.value)
    assert ("shutting down" in msg) if sig == signal.SIGTERM else ("killed" in msg or "exited" in msg), msg
    with pytest.raises(type(e.value)) as again:
        opt.step()  # stays failed, with the same error
    assert str(again.value) == msg
    trainstream.unwrap(model)  # does not hang either


def test_training_process_killed_releases_its_job(tsd):
    p = worker(tsd.socket, "doomed", "--hang-after", "2")
    line = p.stdout.readline()
    assert json.loads(line)["ready"] == 2, p.stderr.read()
    with trainstream.connect(socket=tsd.socket) as c:
        job = next(j for j in c.jobs() if j.name == "doomed")
        assert job.used_bytes > 0 and job.sessions == 1
        used = c.status().used_bytes
        p.kill()
        p.wait(30)
        deadline = time.time() + 10
        while any(j.name == "doomed" for j in c.jobs()) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(j.name == "doomed" for j in c.jobs())
        assert c.status().used_bytes == used - job.used_bytes
