"""Regions of tsd memory through the binding: Client.alloc / map / free and Region's tensor views."""
import pytest
import torch

import trainstream


def job_of(c):
    return next(j for j in c.jobs() if j.name == c.job)


def test_alloc_view_map_and_free(tsd):
    with trainstream.connect(socket=tsd.socket, job="regions", quota="64MiB") as c, \
            trainstream.connect(socket=tsd.socket, job="regions") as other:
        r = c.alloc("buf", 10_000)
        assert r.name == "buf" and r.size == 12_288 and not r.freed  # page-rounded, as charged
        assert r.cuda_registered == torch.cuda.is_available()
        assert job_of(c).used_bytes == 12_288 and job_of(c).regions == 1
        assert [(x.name, x.size) for x in c.regions()] == [("buf", 12_288)]
        v = r.view(torch.float32, offset=4096, numel=100)
        assert v.shape == (100,) and v.dtype == torch.float32
        v.copy_(torch.arange(100, dtype=torch.float32))
        # The same memory seen from another session of the job, without a copy.
        seen = other.map("buf")
        assert torch.equal(seen.view(torch.float32, 4096, 100), torch.arange(100, dtype=torch.float32))
        seen.view(torch.bfloat16, 0, 4).fill_(1.5)
        assert torch.equal(r.view(torch.bfloat16, 0, 4), torch.full((4,), 1.5, dtype=torch.bfloat16))
        assert r.view().numel() == r.size  # whole region, as bytes
        del seen
        with pytest.raises(trainstream.FailedPrecondition, match="tensor view"):
            c.free(r)  # v is alive: freed memory would read zeros under it
        assert not r.freed and job_of(c).used_bytes == 12_288  # the refusal changed nothing
        del v
        c.free(r)
        assert r.freed and job_of(c).used_bytes == 0
        with pytest.raises(trainstream.FailedPrecondition, match="was freed"):
            r.view()


def test_views_are_checked(tsd):
    with trainstream.connect(socket=tsd.socket, job="views") as c:
        r = c.alloc("v", 4096)
        with pytest.raises(ValueError, match="multiple"):
            r.view(torch.float32, offset=2)
        with pytest.raises(ValueError, match="outside region"):
            r.view(torch.float32, offset=4092, numel=2)
        with pytest.raises(ValueError, match="numel"):
            r.view(torch.float32, numel=-1)
        c.free(r)


def test_quota_and_names_are_enforced_by_tsd(tsd):
    with trainstream.connect(socket=tsd.socket, job="small", quota="64KiB") as c:
        with pytest.raises(trainstream.QuotaExceeded) as e:
            c.alloc("big", "1MiB")
        assert "quota" in str(e.value) and isinstance(e.value, MemoryError)
        with pytest.raises(trainstream.InvalidRequest):
            c.alloc("/bad", 4096)
        with pytest.raises(trainstream.NotFound):
            c.map("nothing")
    with trainstream.connect(socket=tsd.socket) as c:
        with pytest.raises(trainstream.FailedPrecondition, match="attach"):
            c.alloc("x", 4096)
