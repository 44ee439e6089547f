"""Fixtures: a real tsd on a socket in a temporary directory (build/bin/tsd, or $TSD_BIN)."""
import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)


def pytest_addoption(parser):
    parser.addoption("--cuda-tests", action="store_true",
                     help="run only the tests that need CUDA (those with a skipif whose reason names CUDA): the "
                          "GPU machine's selection, the same set that is skipped on a CPU machine")


def pytest_collection_modifyitems(config, items):
    if not config.getoption("--cuda-tests"):
        return
    keep, drop = [], []
    for item in items:
        cuda = any("CUDA" in str(m.kwargs.get("reason", "")) for m in item.iter_markers("skipif"))
        (keep if cuda else drop).append(item)
    config.hook.pytest_deselected(items=drop)
    items[:] = keep


def _metrics_off(binary):
    """Turns the daemon's metrics endpoint off where it has one (its port is one per machine)."""
    helptext = subprocess.run([binary, "--help"], capture_output=True, text=True).stdout
    return ["--metrics-listen", ""] if "--metrics-listen" in helptext else []


def tsd_binary():
    path = os.environ.get("TSD_BIN", os.path.join(ROOT, "build", "bin", "tsd"))
    if not os.path.exists(path):
        pytest.fail(f"no tsd binary at {path}: build it first (scripts/build.sh) or set TSD_BIN")
    return path


class Daemon:
    """A tsd process of the test's own."""

    def __init__(self, directory, pool="1GiB", args=()):
        self.socket = os.path.join(str(directory), "tsd.sock")
        self.log_path = os.path.join(str(directory), "tsd.log")
        self._log = open(self.log_path, "w")
        binary = tsd_binary()
        self.proc = subprocess.Popen([binary, "--socket", self.socket, "--pool-size", pool, *_metrics_off(binary), *args],
                                     stdout=self._log, stderr=subprocess.STDOUT)
        deadline = time.time() + 20
        import trainstream
        while True:
            try:
                trainstream.connect(socket=self.socket).close()
                break
            except trainstream.DaemonUnavailable:
                if self.proc.poll() is not None or time.time() > deadline:
                    raise RuntimeError(f"tsd did not start: {self.log()}")
                time.sleep(0.05)

    def log(self):
        with open(self.log_path) as f:
            return f.read()

    def kill(self, sig=signal.SIGKILL):
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            self.proc.wait(30)

    def stop(self):
        self.kill(signal.SIGTERM)
        self._log.close()


@pytest.fixture(scope="module")
def tsd(tmp_path_factory):
    d = Daemon(tmp_path_factory.mktemp("tsd"))
    yield d
    d.stop()


@pytest.fixture
def own_tsd(tmp_path):
    """A daemon for one test (one that may kill it)."""
    d = Daemon(tmp_path)
    yield d
    d.stop()


@pytest.fixture(scope="module")
def one_thread():
    """One torch intra-op thread for a module's tests (`pytestmark = pytest.mark.usefixtures(
    "one_thread")`): tiny models run faster on one thread than on several, and far faster on a
    busy machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
