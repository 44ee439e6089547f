"""trainstream.progress: a progress line on a terminal (a pseudo-terminal here), nothing when the
output is not a terminal, $TRAINSTREAM_PROGRESS overriding both; and the lines of wrap()'s
registration, save_state, load_state, state_dict and load_state_dict against a real tsd."""
from __future__ import annotations

import io
import os
import pty
import sys

import pytest
import torch

import trainstream
from trainstream.progress import Progress, progress_enabled, track


class Pty:
    """A pseudo-terminal: `stream` is its terminal side (isatty() is True), `read()` what reached it."""

    def __init__(self) -> None:
        self.master, slave = pty.openpty()
        self.stream = os.fdopen(slave, "w", buffering=1)
        os.set_blocking(self.master, False)

    def read(self) -> str:
        out = b""
        while True:
            try:
                chunk = os.read(self.master, 65536)
            except (BlockingIOError, OSError):
                break
            if not chunk:
                break
            out += chunk
        return out.decode(errors="replace")

    def close(self) -> None:
        self.stream.close()
        os.close(self.master)


@pytest.fixture
def term(monkeypatch):
    monkeypatch.delenv("TRAINSTREAM_PROGRESS", raising=False)
    t = Pty()
    assert t.stream.isatty()
    yield t
    t.close()


@pytest.fixture
def quick(monkeypatch):
    """Lines from the first moment (the default waits half a second: short operations print nothing)."""
    monkeypatch.setitem(Progress.__init__.__kwdefaults__, "delay", 0.0)
    monkeypatch.setitem(Progress.__init__.__kwdefaults__, "interval", 0.01)


def test_prints_on_a_terminal(term):
    with Progress("copying", total=3, stream=term.stream, delay=0.0, interval=0.01) as bar:
        for _ in range(3):
            bar.advance()
    out = term.read()
    assert "copying: 3 of 3 (100%)" in out and out.rstrip().endswith("done")
    assert "\r" in out  # rewritten in place


def test_quiet_when_not_a_terminal(monkeypatch):
    monkeypatch.delenv("TRAINSTREAM_PROGRESS", raising=False)
    buf = io.StringIO()
    with Progress("copying", total=3, stream=buf, delay=0.0, interval=0.01) as bar:
        bar.advance(3)
    for _ in track([1, 2, 3], "again", stream=buf, delay=0.0):
        pass
    assert buf.getvalue() == ""
    assert not progress_enabled(buf)


def test_environment_overrides(monkeypatch, term):
    monkeypatch.setenv("TRAINSTREAM_PROGRESS", "0")
    with Progress("off", total=1, stream=term.stream, delay=0.0) as bar:
        bar.advance()
    assert term.read() == ""
    monkeypatch.setenv("TRAINSTREAM_PROGRESS", "1")
    buf = io.StringIO()
    with Progress("forced", total=1, stream=buf, delay=0.0) as bar:
        bar.advance()
    assert "forced: 1 of 1" in buf.getvalue()
    assert progress_enabled(term.stream, enabled=False) is False  # enabled= wins over both


def test_short_operations_print_nothing(term):
    with Progress("fast", total=1, stream=term.stream, delay=5.0) as bar:
        bar.advance()
    assert term.read() == ""


def test_bytes_poll_and_failure(term):
    with Progress("save", total=4 << 20, unit="bytes", poll=lambda: 4 << 20, stream=term.stream, delay=0.0):
        pass
    assert "save: 4.00 MiB of 4.00 MiB (100%)" in term.read()
    with pytest.raises(RuntimeError):
        for i in track([1, 2, 3], "items", stream=term.stream, delay=0.0):
            if i == 2:
                raise RuntimeError("stop")
    out = term.read()
    assert "items: 1 of 3" in out and out.rstrip().endswith("failed")
    with pytest.raises(ValueError, match="'items' or 'bytes'"):
        Progress("x", unit="MB")


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 8))


def _long_operations(tsd, tmp_path):
    """wrap(), a step, save_state, load_state, state_dict, load_state_dict, unwrap()."""
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = trainstream.wrap(model, opt, device="cpu", socket=tsd.socket)
    try:
        model(torch.randn(4, 64)).sum().backward()
        opt.step()
        opt.zero_grad()
        path = tmp_path / "state.safetensors"
        with open(path, "wb") as f:
            n = opt.save_state(f)
        assert n == os.path.getsize(path)
        with open(path, "rb") as f:
            opt.load_state(f)
        sd = opt.state_dict()
        opt.load_state_dict(sd)
    finally:
        trainstream.unwrap(model)


def test_long_operations_show_progress_on_a_terminal(tsd, tmp_path, term, quick, monkeypatch):
    monkeypatch.setattr(sys, "stderr", term.stream)
    _long_operations(tsd, tmp_path)
    out = term.read()
    for what in ("wrap: registering the optimizer in tsd", "wrap: parameters into tsd", "save_state:",
                 "load_state:", "state_dict:", "load_state_dict:"):
        assert what in out, (what, out)
    assert "wrap: parameters into tsd: 18.28 KiB of 18.28 KiB (100%)" in out  # (64*64+64+64*8+8) fp32 masters
    assert "load_state: 4 of 4 (100%)" in out  # one per parameter


def test_long_operations_are_quiet_without_a_terminal(tsd, tmp_path, quick, monkeypatch, capfd):
    monkeypatch.delenv("TRAINSTREAM_PROGRESS", raising=False)
    monkeypatch.setattr(sys, "stderr", io.StringIO())
    _long_operations(tsd, tmp_path)
    assert sys.stderr.getvalue() == ""
    assert "wrap:" not in capfd.readouterr().err
