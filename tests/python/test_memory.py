"""Host memory lent by tsd: the HostArena, and the activation pager drawing from it (pages charged
to the job's quota, reused step after step, a clear error when the quota runs out)."""
import gc

import pytest
import torch

import trainstream
from gpt import batches, make_gpt, param_groups, train
from trainstream.memory import HostArena

KiB = 1 << 10
HP = dict(lr=1e-3, betas=(0.9, 0.95), eps=1e-8)


def used(c):
    return next(j for j in c.jobs() if j.name == c.job).used_bytes


def test_arena_places_reuses_and_coalesces(tsd):
    with trainstream.connect(socket=tsd.socket, job="arena", quota="8MiB") as c:
        arena = HostArena(c, chunk_bytes=64 * KiB)
        a, b, d = arena.alloc(1000), arena.alloc(5000), arena.alloc(100)
        assert arena.grows == 1 and arena.capacity_bytes == 64 * KiB == used(c)
        assert arena.in_use_bytes == 1024 + 5120 + 512  # 512-byte aligned
        assert [x.nbytes for x in (a, b, d)] == [1000, 5000, 100]
        b.data.fill_(7)
        region = arena.regions[0]
        assert torch.all(region.view(torch.uint8, 1024, 5000) == 7)  # blocks are views of the region
        a_ptr, b_ptr = a.data.data_ptr(), b.data.data_ptr()
        a.release()
        b.release()
        big = arena.alloc(6000)  # a and b freed side by side: merged, and the hole is reused
        assert big.data.data_ptr() == a_ptr and arena.grows == 1
        big.release()
        again = arena.alloc(5000)
        assert again.data.data_ptr() == a_ptr
        huge = arena.alloc(100 * KiB)  # larger than a chunk: a region of its own, the request's size
        assert arena.grows == 2 and arena.capacity_bytes == 64 * KiB + 100 * KiB == used(c)
        assert huge.data.data_ptr() != b_ptr
        for blk in (again, d, huge):
            blk.release()
        arena.reclaim()
        assert arena.in_use_bytes == 0
        arena.close()
        assert used(c) == 0 and arena.chunks == []
        with pytest.raises(trainstream.FailedPrecondition, match="closed"):
            arena.alloc(1)


def test_arena_shrinks_its_growth_to_a_tight_quota_then_says_what_to_do(tsd):
    with trainstream.connect(socket=tsd.socket, job="tight", quota="96KiB") as c:
        arena = HostArena(c, purpose="the test's buffers", advice="Ask for more.")  # 256 MiB chunks
        blk = arena.alloc(40 * KiB)  # 256 MiB does not fit the quota: the request does
        assert arena.capacity_bytes == 40 * KiB == used(c)
        with pytest.raises(trainstream.QuotaExceeded) as e:
            arena.alloc(80 * KiB)
        msg = str(e.value)
        assert "the test's buffers" in msg and "quota 96.00 KiB" in msg and "'tight'" in msg and msg.endswith(
            "Ask for more.") and isinstance(e.value, MemoryError)
        assert arena.capacity_bytes == 40 * KiB == used(c) and arena.grows == 1  # the refusal changed nothing
        blk.release()
        assert arena.alloc(40 * KiB).nbytes == 40 * KiB and arena.grows == 1  # reused, no growth
        arena.close()


def test_arena_close_keeps_regions_with_live_blocks(tsd):
    with trainstream.connect(socket=tsd.socket, job="live", quota="1MiB") as c:
        arena = HostArena(c, chunk_bytes=64 * KiB)
        blk = arena.alloc(100)
        with pytest.warns(UserWarning, match="still have blocks in use"):
            arena.close()
        assert used(c) == 64 * KiB  # not freed under a live block
        blk.data.fill_(1)  # still valid memory
        del blk
        gc.collect()


def test_arena_trim_gives_empty_regions_back_down_to_what_is_kept(tsd):
    """trim(keep): empty regions go back to tsd (the job's used bytes fall), the largest kept
    first until `keep` bytes remain; a region with a block in use, or a view still alive after
    its block was released, stays; later allocs grow the arena again."""
    with trainstream.connect(socket=tsd.socket, job="trim", quota="4MiB") as c:
        arena = HostArena(c, chunk_bytes=64 * KiB)
        small, big, huge = arena.alloc(1000), arena.alloc(100 * KiB), arena.alloc(200 * KiB)
        assert arena.capacity_bytes == (64 + 100 + 200) * KiB == used(c) and arena.grows == 3
        kept_view = small.data[:10]  # outlives its block's release
        big.release()
        huge.release()
        small.release()
        # Keep 150 KiB: the 200 KiB region (largest first) covers it; the 100 KiB one goes; the
        # 64 KiB one would go too but a view of it is alive.
        assert arena.trim(150 * KiB) == 100 * KiB
        assert sorted(r.size for r in arena.regions) == [64 * KiB, 200 * KiB] == sorted(
            r.size for r in c.regions() if r.name.startswith("trainstream/arena"))
        assert used(c) == 264 * KiB
        del kept_view
        gc.collect()
        busy = arena.alloc(300)  # best fit: the 64 KiB region, now in use
        # tsd failing on the free: raised, and the arena is whole (its region still serves blocks).
        def gone(region):
            raise trainstream.DaemonUnavailable("tsd is gone")

        c.free = gone
        with pytest.raises(trainstream.DaemonUnavailable):
            arena.trim(0)
        del c.free
        assert arena.capacity_bytes == 264 * KiB == used(c)
        probe = arena.alloc(150 * KiB)  # only the 200 KiB region fits it
        assert torch.all(probe.data.fill_(5) == 5)
        probe.release()
        assert arena.trim(0) == 200 * KiB and used(c) == 64 * KiB == arena.capacity_bytes
        busy.data.fill_(3)  # still valid memory
        busy.release()
        assert arena.trim(0) == 64 * KiB and used(c) == 0 and arena.regions == []
        again = arena.alloc(1000)  # grows again after a trim
        assert arena.capacity_bytes == 64 * KiB == used(c) and torch.all(again.data.fill_(1) == 1)
        again.release()
        arena.close()
        assert used(c) == 0


def wrap_paged(tsd, **kw):
    model = make_gpt(0, d=64)
    opt = torch.optim.AdamW(param_groups(model, 0.1, 3e-3), **HP)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, max_grad_norm=1.0, **kw)
    session = trainstream.unwrap_session(model)
    if session.act_pager is not None:
        session.act_pager.min_bytes = 1024  # 1 MiB would page nothing of this small model
    return model, opt, session


def test_activation_pages_are_charged_to_the_job_and_reused_every_step(tsd):
    data = batches(5)
    model, opt, s = wrap_paged(tsd, activation_offload=True, job="paged-job")
    try:
        with trainstream.connect(socket=tsd.socket) as c:
            job = next(j for j in c.jobs() if j.name == "paged-job")
            assert job.used_bytes == s.state_bytes  # nothing paged yet
            train(model, opt, data[:1], 1)
            assert s.act_pager.paged_bytes > 0 and s.arena.grows >= 1
            job = next(j for j in c.jobs() if j.name == "paged-job")
            assert job.used_bytes == s.state_bytes + s.arena.capacity_bytes  # tsctl jobs shows the pages
            # check_memory's second half counted them, as for activation_offload="auto"
            assert s.activation_host_bytes == s.arena.capacity_bytes > 0
            # the optimizer's five regions (fp32 parameters are their masters: no opt/params) and the arena's
            assert job.regions == 5 + len(s.arena.regions)
            capacity, grows = s.arena.capacity_bytes, s.arena.grows
            train(model, opt, data[1:], 4)
            s.arena.reclaim()
            assert (s.arena.capacity_bytes, s.arena.grows) == (capacity, grows)  # freed blocks reused
            assert s.arena.in_use_bytes == 0  # every page was given back after its backward
    finally:
        trainstream.unwrap(model)
    with trainstream.connect(socket=tsd.socket) as c:
        assert "paged-job" not in [j.name for j in c.jobs()]


def test_quota_exhausted_while_paging_is_a_clear_error_and_training_goes_on(tsd):
    data = batches(4)
    ref, ref_opt, _ = wrap_paged(tsd)  # unpaged: paging is bit-identical, so its losses are the reference
    try:
        want = train(ref, ref_opt, data, 4)
    finally:
        trainstream.unwrap(ref)

    model, opt, s = wrap_paged(tsd, activation_offload=True, job="exhausted", quota="32MiB")
    with trainstream.connect(socket=tsd.socket, job="exhausted") as other:
        hog = other.alloc("hog", 32 * 2**20 - used(other))  # the rest of the quota
        try:
            with pytest.raises(trainstream.QuotaExceeded) as e:
                train(model, opt, data[:1], 1)
            msg = str(e.value)
            assert "activation paging" in msg and "quota" in msg and "exhausted" in msg
            assert "activation_offload" in msg and "quota=" in msg  # what to do
            del e
            gc.collect()  # the failed forward's graph (and its pages) go with the traceback
            other.free(hog)
            losses = train(model, opt, data, 4)
        finally:
            trainstream.unwrap(model)
    assert losses == want  # the failed step changed nothing: model and optimizer went on exactly
