"""Data parallel through tsd (`wrap(..., distributed=...)`, docs/distributed.md): N processes in a
gloo group share one tsd job's optimizer, and train as torch DDP + torch.optim.AdamW does.

Each test starts its ranks as processes (tests/python/dist_worker.py) and reads their JSON
results; a rank that hangs fails the test by its timeout, not the suite."""
from __future__ import annotations

import json
import os

import pytest
import torch

import trainstream
from conftest import Daemon

import dist_worker
from ranks import free_port, spawn_ranks

pytestmark = pytest.mark.skipif(not torch.distributed.is_available() or not torch.distributed.is_gloo_available(),
                                reason="torch.distributed with gloo is needed")


def _run(world: int, sockets: list[str], mode: str, out_dir: str, device: str = "cpu",
         timeout: float = 240) -> list[dict]:
    """Starts `world` ranks, waits for them (killing any left after `timeout`), returns the
    surviving ranks' results by rank."""
    port = free_port()
    spawn_ranks(dist_worker.main, lambda r: (r, world, port, sockets, mode, out_dir, device), world, timeout)
    out = []
    for r in range(world):
        path = os.path.join(out_dir, f"rank{r}.json")
        out.append(json.load(open(path)) if os.path.exists(path) else None)
    return out


def _daemon(directory) -> Daemon:
    directory.mkdir()
    return Daemon(directory)


def _check_parity(results: list[dict], world: int, nodes: int, out_dir=None) -> None:
    for r, res in enumerate(results):
        assert res is not None, f"rank {r} wrote no result"
        assert "exception" not in res, f"rank {r}: {res['exception']}"
        assert res["moved"] > 1e-3, "training changed nothing: the comparison would be vacuous"
        assert res["max_diff"] <= 1e-6, f"rank {r}: parameters differ from DDP + AdamW by {res['max_diff']}"
        # One job per node, holding every rank of the node as a session and one optimizer.
        assert res["jobs"] == 1 and res["nodes"] == nodes
        assert res["sessions"] == world // nodes == res["local_world"]
        assert res["used_bytes"] == res["state_bytes"], (res["used_bytes"], res["state_bytes"])
    assert len({res["job"] for res in results}) == 1
    # One checkpoint per node, written by its first rank, holding the trained parameters.
    writers = [res for res in results if "checkpoint_matches" in res]
    assert len(writers) == nodes and all(res["checkpoint_matches"] for res in writers)
    if out_dir is not None:
        assert sorted(f for f in os.listdir(out_dir) if f.endswith(".state")) == [f"node{i}.state" for i in range(nodes)]


@pytest.mark.parametrize("world", [2, 4])
def test_matches_ddp_adamw_one_tsd(tmp_path, world):
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(world, [d.socket] * world, "parity", str(out))
        _check_parity(results, world, nodes=1, out_dir=str(out))
        # The optimizer state exists once: one rank's plan (masters, 2 moments, slots) is all tsd holds.
        with trainstream.connect(socket=d.socket) as c:
            assert c.jobs() == []  # every rank unwrapped: the job is gone
        assert "optimizer_joined" in d.log() and d.log().count("event=optimizer_registered") == 1
    finally:
        d.stop()


@pytest.mark.parametrize("mode", ["parity", "parity-chunked"])  # streamed on the CPU; at step() in host chunks
def test_two_nodes_two_tsd_match_ddp(tmp_path, mode):
    a, b = _daemon(tmp_path / "a"), _daemon(tmp_path / "b")
    try:
        out = tmp_path / "out"
        out.mkdir()
        # Reduced in many small chunks (each a reduce in the node and an all-reduce between the nodes).
        results = _run(4, [a.socket, a.socket, b.socket, b.socket], mode, str(out))
        _check_parity(results, 4, nodes=2, out_dir=str(out))
        for d in (a, b):
            assert d.log().count("event=optimizer_registered") == 1
    finally:
        a.stop()
        b.stop()


def test_nodes_whose_states_diverge_stop_with_a_clear_error(tmp_path):
    a, b = _daemon(tmp_path / "a"), _daemon(tmp_path / "b")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(4, [a.socket, a.socket, b.socket, b.socket], "diverge", str(out))
        for r, res in enumerate(results):
            assert res is not None and "exception" not in res, (r, res)
            assert res["error"] is not None and "diverged at step 4" in res["error"], (r, res)
            assert res["step"] == 3
    finally:
        a.stop()
        b.stop()


def test_killed_rank_fails_the_others_quickly(tmp_path):
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(3, [d.socket] * 3, "kill", str(out), timeout=120)
        assert results[2] is None  # killed before it wrote anything
        for r in (0, 1):
            res = results[r]
            assert res is not None and "exception" not in res, res
            assert res["error"] is not None, f"rank {r} stepped on without its peer"
            assert res["step"] == 3
            assert res["seconds"] < 10, f"rank {r} took {res['seconds']:.1f} s to notice"
            # gloo's collective notices the dead peer, or tsd (which saw its session end) names it.
            assert "Connection closed by peer" in res["error"] or "rank 2 of job" in res["error"], res["error"]
            assert res["error"].startswith("TsdError: data-parallel step 4 failed on rank") or "tsd" in res["error"]
    finally:
        d.stop()


def test_rank_killed_inside_step_fails_the_others_through_tsd(tmp_path):
    """The dead rank's buckets were reduced but never delivered: the others wait on tsd, which saw
    the rank's session end, failed the job's optimizer and says which rank was lost."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(3, [d.socket] * 3, "kill-in-tsd", str(out), timeout=120)
        assert results[2] is None
        for r in (0, 1):
            res = results[r]
            assert res is not None and "exception" not in res, res
            assert res["error"] is not None and res["step"] == 3, res
            assert "rank 2 of job" in res["error"] and "ended (disconnected)" in res["error"], res["error"]
            assert res["seconds"] < 10, f"rank {r} took {res['seconds']:.1f} s to notice"
        assert "event=optimizer_failed" in d.log()
    finally:
        d.stop()


def _check_resumed(results: list[dict], rolled_back: bool) -> None:
    """A restarted group resumed the kept job at the step boundary the killed group reached and
    finished the run exactly as an uninterrupted one (and as DDP + AdamW, to rounding)."""
    for r, res in enumerate(results):
        assert res is not None and "exception" not in res, (r, res)
        assert res["error"] is None, (r, res["error"])
        assert res["steps"] == dist_worker.KILL_AT, res
        assert res["ahead"] == [], res
        assert (res["rolled_back"] != []) == rolled_back, res
        assert res["expected"] == res["bucket_steps"] == [dist_worker.KILL_AT] * len(res["bucket_steps"]), res
        assert res["moved"] > 1e-3
        assert res["final_steps"] == [dist_worker.RESUME_STEPS] * len(res["final_steps"]), res
        assert res["bit_equal"], f"rank {r}: the resumed run differs from an uninterrupted one by {res['straight_diff']}"
        assert res["ddp_diff"] <= 1e-6, f"rank {r}: parameters differ from DDP + AdamW by {res['ddp_diff']}"
    # Every rank got the same report: the node's one optimizer, settled once.
    assert results[0]["rolled_back"] == results[1]["rolled_back"]


def test_ranks_killed_between_steps_resume_as_if_uninterrupted(tmp_path):
    """Every rank of a kept job is killed between steps; a restarted group of as many ranks
    resumes (resume=True) and its parameters equal an uninterrupted run's bit for bit."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        assert _run(2, [d.socket] * 2, "kept-kill-between", str(out), timeout=120) == [None, None]
        with trainstream.connect(socket=d.socket) as c:
            assert [j.name for j in c.jobs()] == [dist_worker.KEPT_JOB]  # kept
        again = tmp_path / "again"
        again.mkdir()
        _check_resumed(_run(2, [d.socket] * 2, "kept-resume", str(again), timeout=180), rolled_back=False)
        assert "event=optimizer_revived" in d.log() and d.log().count("event=optimizer_rank_resumed") == 2
        with trainstream.connect(socket=d.socket) as c:
            assert c.jobs() == []  # the resumed group unwrapped: the job is gone
    finally:
        d.stop()


def test_rank_killed_inside_a_clipped_step_then_the_group_resumes(tmp_path):
    """A rank dies inside step() with clipping: the other gets a clear error within seconds; a
    single process cannot take the kept job over (another world); a restarted group resumes it,
    the cut step rolled back, and finishes as an uninterrupted run."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(2, [d.socket] * 2, "kept-kill-in-step", str(out), timeout=120)
        assert results[1] is None
        res = results[0]
        assert res is not None and "exception" not in res, res
        assert res["error"] is not None and res["step"] == dist_worker.KILL_AT, res
        assert "rank 1 of job" in res["error"] and "resume=True" in res["error"], res["error"]
        assert res["seconds"] < 10, f"rank 0 took {res['seconds']:.1f} s to notice"
        # One process is not the group that was kept: refused, changing nothing.
        model = dist_worker._model()
        opt = torch.optim.AdamW(model.parameters(), lr=dist_worker.LR, weight_decay=0.01)
        with pytest.raises(trainstream.FailedPrecondition, match="world of 2 data-parallel ranks"):
            trainstream.wrap(model, opt, device="cpu", socket=d.socket, job=dist_worker.KEPT_JOB, resume=True,
                             max_grad_norm=dist_worker.MAX_NORM, distributed=False)
        again = tmp_path / "again"
        again.mkdir()
        _check_resumed(_run(2, [d.socket] * 2, "kept-resume", str(again), timeout=180), rolled_back=True)
    finally:
        d.stop()


def test_ranks_killed_after_the_commit_then_the_group_resumes_after_the_step(tmp_path):
    """Every rank asked a clipped step's commit and died before it saw the step done: tsd finishes
    the step (it was asked by all), so the restarted group finds every bucket one step past the
    recorded boundary (`ahead`), delivers and commits nothing for that step, and the run ends as
    an uninterrupted one, bit for bit."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        assert _run(2, [d.socket] * 2, "kept-kill-after-commit", str(out), timeout=120) == [None, None]
        again = tmp_path / "again"
        again.mkdir()
        resumed = _run(2, [d.socket] * 2, "kept-resume", str(again), timeout=180)
        for r, res in enumerate(resumed):
            assert res is not None and "exception" not in res and res["error"] is None, (r, res)
            assert res["steps"] == dist_worker.KILL_AT and res["rolled_back"] == [], res
            assert res["bucket_steps"] == res["expected"] == [dist_worker.KILL_AT + 1] * len(res["bucket_steps"]), res
            assert len(res["ahead"]) == len(res["bucket_steps"]), res
            assert res["final_steps"] == [dist_worker.RESUME_STEPS] * len(res["final_steps"]), res
            assert res["bit_equal"], f"rank {r}: differs from an uninterrupted run by {res['straight_diff']}"
    finally:
        d.stop()


def test_rank_killed_inside_a_step_without_clipping_resumes_with_the_updated_buckets_ahead(tmp_path):
    """Without clipping, the surviving rank's buckets were updated in the cut step: the resumed
    group reports them `ahead`, skips their next delivery once, and runs on to the end (the run
    then differs slightly from an uninterrupted one, as a single trainer's does)."""
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(2, [d.socket] * 2, "kept-kill-in-step-noclip", str(out), timeout=120)
        assert results[1] is None and results[0] is not None and results[0]["error"] is not None, results
        again = tmp_path / "again"
        again.mkdir()
        resumed = _run(2, [d.socket] * 2, "kept-resume-noclip", str(again), timeout=180)
        for r, res in enumerate(resumed):
            assert res is not None and "exception" not in res, (r, res)
            assert res["error"] is None and res["steps"] == dist_worker.KILL_AT, res
            assert res["ahead"] != [] and res["rolled_back"] == [], res
            assert res["expected"] == res["bucket_steps"], res
            assert sorted(set(res["bucket_steps"])) == [dist_worker.KILL_AT, dist_worker.KILL_AT + 1], res
            # Every bucket took each step once (the ahead ones' redone delivery skipped, not doubled).
            assert res["final_steps"] == [dist_worker.RESUME_STEPS] * len(res["final_steps"]), res
            assert res["moved"] > 1e-3 and 0 < res["straight_diff"] < 5 * dist_worker.LR, res
        assert resumed[0]["ahead"] == resumed[1]["ahead"] and resumed[0]["bucket_steps"] == resumed[1]["bucket_steps"]
    finally:
        d.stop()


def test_a_group_cannot_resume_a_job_that_was_not_kept(tmp_path):
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        assert _run(2, [d.socket] * 2, "kept-kill-between-nokeep", str(out), timeout=120) == [None, None]
        again = tmp_path / "again"
        again.mkdir()
        for res in _run(2, [d.socket] * 2, "kept-resume", str(again), timeout=120):
            assert res is not None and "exception" not in res, res
            assert res["error"] is not None and "no job 'dp-kept' to resume" in res["error"], res
    finally:
        d.stop()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_two_ranks_one_gpu_gloo_match_ddp(tmp_path):
    d = _daemon(tmp_path / "tsd")
    try:
        out = tmp_path / "out"
        out.mkdir()
        results = _run(2, [d.socket] * 2, "parity", str(out), device="cuda")
        _check_parity(results, 2, nodes=1)
    finally:
        d.stop()


def test_distributed_option_is_checked(tsd):
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="distributed must be"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, distributed="yes")
    # True without a process group is refused; "auto" trains in one process.
    assert not torch.distributed.is_initialized()
    with pytest.raises(ValueError, match="distributed=True needs torch.distributed"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, distributed=True)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, distributed="auto")
    assert trainstream.unwrap_session(model).dp is None
    trainstream.unwrap(model)
