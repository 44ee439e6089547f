"""wrap(expandable_segments=): the CUDA caching allocator switches to expandable segments when a VRAM
budget makes tsd page, unless the user's PYTORCH_CUDA_ALLOC_CONF decides, and back when released.
The switch's rules run on the CPU with a recording setter; the CUDA test checks the allocator's
segments themselves and skips without a GPU."""
import pytest
import torch

import trainstream
from trainstream import allocator
from trainstream.allocator import SegmentSwitch, check_option, user_choice
from gpt import batches, loss_of, make_gpt


class Recorder:
    """The allocator calls a switch makes: setter values and cache releases."""

    def __init__(self, fail: bool = False) -> None:
        self.calls: list[object] = []
        self.fail = fail

    def set(self, on: bool) -> None:
        if self.fail:
            raise RuntimeError("no runtime allocator settings here")
        self.calls.append(on)

    def release(self) -> None:
        self.calls.append("release")


def switch(rec: Recorder, option="auto", env=None) -> SegmentSwitch:
    return SegmentSwitch(option, cuda=True, setter=rec.set, env=env or {}, release=rec.release)


def test_option_values_are_checked():
    for ok in (True, False, "auto"):
        assert check_option(ok) == ok
    for bad in ("yes", 1, None, "Auto"):
        with pytest.raises(ValueError, match="expandable_segments must be True, False or 'auto'"):
            check_option(bad)


def test_wrap_refuses_a_bad_value_before_anything_happens(tsd):
    model = make_gpt(0)
    opt = torch.optim.AdamW(model.parameters())
    with pytest.raises(ValueError, match="expandable_segments must be"):
        trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, expandable_segments="sometimes")
    with trainstream.connect(socket=tsd.socket) as c:
        assert c.jobs() == []


def test_user_choice_reads_the_allocator_configuration():
    assert user_choice({}) is None
    assert user_choice({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:128"}) is None
    assert user_choice({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:True"}) is True
    assert user_choice({"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64, expandable_segments:False"}) is False
    assert user_choice({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}) is True


def test_auto_switches_once_when_the_budget_binds_and_back_at_release():
    rec = Recorder()
    s = switch(rec)
    assert s.at_wrap() is None and rec.calls == []  # "auto" waits for a binding budget
    event = s.tight("the weights of 3 blocks are paged")
    assert rec.calls == [True, "release"]
    assert "the weights of 3 blocks are paged" in event and "expandable segments" in event
    assert s.tight("again") is None and rec.calls == [True, "release"]  # once per session
    s.restore()
    assert rec.calls == [True, "release", False]
    s.restore()
    assert rec.calls == [True, "release", False]


def test_the_last_of_two_sessions_switches_back():
    rec = Recorder()
    a, b = switch(rec), switch(rec)
    a.tight("a pages")
    b.tight("b pages")
    a.restore()
    assert rec.calls.count(False) == 0  # b still holds it
    b.restore()
    assert rec.calls[-1] is False and rec.calls.count(False) == 1


def test_the_users_configuration_stands():
    for value in ("True", "False"):
        rec = Recorder()
        s = switch(rec, env={"PYTORCH_CUDA_ALLOC_CONF": f"expandable_segments:{value}"})
        event = s.tight("activations of 2 blocks are paged")
        assert rec.calls == [] and f"keeps expandable_segments:{value == 'True'}" in event
        s.restore()
        assert rec.calls == []


def test_false_and_the_cpu_do_nothing_and_true_switches_at_wrap():
    rec = Recorder()
    assert switch(rec, option=False).tight("x") is None
    cpu = SegmentSwitch("auto", cuda=False, setter=rec.set, env={}, release=rec.release)
    assert cpu.tight("x") is None and cpu.at_wrap() is None
    assert rec.calls == []
    s = switch(rec, option=True)
    assert "expandable_segments=True" in s.at_wrap() and rec.calls == [True, "release"]
    assert s.tight("x") is None
    s.restore()
    assert rec.calls[-1] is False


def test_a_torch_without_the_runtime_setting_gets_the_environment_advice():
    rec = Recorder(fail=True)
    s = switch(rec)
    event = s.tight("x")
    assert "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True" in event and not s.switched
    s.restore()  # nothing to undo
    assert allocator._holders == 0


def test_the_weight_pager_reports_the_first_paging_to_the_switch(tsd):
    """The pager calls the switch when it goes from no block paged to some (the weight planner's
    plan, the head check, a refine), and not for moves between paged sets."""
    model = make_gpt(0, layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, offload=True, param_offload=[0])
    session = trainstream.unwrap_session(model)
    rec = Recorder()
    try:
        # On the CPU the switch had nothing to do at wrap(); on a GPU paging from the start switched
        # it (the CUDA test below). Here a recording switch sees the pager's later moves.
        assert not any(e.startswith("allocator:") for e in session.events), session.events
        session.segments = switch(rec)
        session.pager.move_to({1})  # paged to paged: the budget already bound
        assert rec.calls == []
        session.pager.move_to(set())
        session.pager.move_to({0, 2})
        assert rec.calls == [True, "release"]
        assert any("the weights of 2 blocks are paged" in e for e in session.events), session.events
        loss = loss_of(model, batches(1)[0])
        loss.backward()
        opt.step()
    finally:
        trainstream.unwrap(model)
    assert rec.calls[-1] is False and allocator._holders == 0  # unwrap() released the session


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_paging_makes_new_segments_expandable_and_unwrap_switches_back(tsd, monkeypatch):
    """On a GPU: paging from wrap() switches the real allocator (a segment made afterwards is
    expandable), training runs on it, and unwrap() switches back (the calls to torch's setting are
    watched; torch has no getter for it)."""
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    monkeypatch.delenv("PYTORCH_ALLOC_CONF", raising=False)
    real, calls = allocator._set_expandable, []

    def watched(on: bool) -> None:
        calls.append(on)
        real(on)

    monkeypatch.setattr(allocator, "_set_expandable", watched)

    def segments_of(t: torch.Tensor) -> list[bool]:
        addr = t.data_ptr()
        return [s.get("is_expandable", False) for s in torch.cuda.memory_snapshot()
                if s["address"] <= addr < s["address"] + s["total_size"]]

    model = make_gpt(0, layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cuda", socket=tsd.socket, offload=True, param_offload=[0, 2])
    session = trainstream.unwrap_session(model)
    try:
        assert any(e.startswith("allocator: the weights of 2 blocks are paged") for e in session.events), session.events
        assert calls == [True]
        t = torch.empty(64 << 20, dtype=torch.uint8, device="cuda")
        assert segments_of(t) == [True]
        for x in batches(2):
            loss_of(model, x.cuda()).backward()
            opt.step()
            opt.zero_grad()
        del t
    finally:
        trainstream.unwrap(model)
    assert calls == [True, False] and allocator._holders == 0


def test_paging_from_wrap_switches_there(tsd, monkeypatch):
    """An explicit param_offload pages its blocks in wrap(): the switch happens there, before the
    model's first step (the session's switch records instead of touching the allocator)."""
    import trainstream.engine as engine

    rec = Recorder()
    monkeypatch.setattr(engine, "SegmentSwitch", lambda option, cuda: switch(rec, option=option))
    model = make_gpt(0, layers=4)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket, offload=True, param_offload=[1, 3])
    events = list(trainstream.unwrap_session(model).events)
    trainstream.unwrap(model)
    assert rec.calls == [True, "release", False]
    assert any(e.startswith("allocator: the weights of 2 blocks are paged") for e in events), events
    rec.calls.clear()
    model = make_gpt(0, layers=4)
    model, opt = trainstream.wrap(model, torch.optim.AdamW(model.parameters()), device="cpu", socket=tsd.socket,
                                  offload=True, param_offload=[1], expandable_segments=False)
    trainstream.unwrap(model)
    assert rec.calls == []
