"""trainstream.connect(): status, the socket's fallbacks, errors that say what to do."""
import os

import pytest

import trainstream


def test_connect_status_and_jobs(tsd):
    with trainstream.connect(socket=tsd.socket) as c:
        st = c.status()
        assert st.pool_bytes == 1 << 30 and st.used_bytes == 0 and st.pid == tsd.proc.pid
        assert st.version and st.free_bytes == st.pool_bytes
        assert not c.attached and c.job is None
        assert c.socket_path == tsd.socket
    with trainstream.connect(socket=tsd.socket, job="connect-test", quota="64MiB") as c:
        assert c.attached and c.job == "connect-test" and c.quota_bytes == 64 << 20
        jobs = {j.name: j for j in c.jobs()}
        assert jobs["connect-test"].sessions == 1 and jobs["connect-test"].quota_bytes == 64 << 20
    with trainstream.connect(socket=tsd.socket) as c:
        assert "connect-test" not in {j.name for j in c.jobs()}  # released with its last session


def test_socket_falls_back_to_env(tsd, monkeypatch):
    monkeypatch.setenv("TSD_SOCKET", tsd.socket)
    with trainstream.connect() as c:
        assert c.socket_path == tsd.socket
        assert c.status().pid == tsd.proc.pid


def test_no_daemon_says_which_path_and_how_to_start(tmp_path, monkeypatch):
    path = str(tmp_path / "none.sock")
    with pytest.raises(trainstream.DaemonUnavailable) as e:
        trainstream.connect(socket=path)
    assert path in str(e.value) and "tsd --socket" in str(e.value)
    assert isinstance(e.value, trainstream.TsdError) and isinstance(e.value, ConnectionError)
    monkeypatch.setenv("TSD_SOCKET", path)
    with pytest.raises(trainstream.DaemonUnavailable, match="none.sock"):
        trainstream.connect()


def test_daemon_errors_are_tsd_error_subclasses(tsd):
    with trainstream.connect(socket=tsd.socket, job="errs") as c:
        with pytest.raises(trainstream.FailedPrecondition, match="already attached"):
            c.attach("other")
        with pytest.raises(trainstream.InvalidRequest):
            trainstream.connect(socket=tsd.socket, job="/bad name")
        with pytest.raises(ValueError, match="size"):
            c.attach("x", quota="lots")


def test_parse_bytes():
    assert trainstream.parse_bytes("8GiB") == 8 << 30
    assert trainstream.parse_bytes("512 MiB") == 512 << 20
    assert trainstream.parse_bytes(4096) == 4096
    assert trainstream.parse_bytes(None) == 0


def test_request_timeout_is_checked_and_a_shutdown_notice_is_read(own_tsd):
    """set_request_timeout refuses nonsense; a client idle while tsd stops reads its SHUTDOWN notice."""
    import signal

    c = trainstream.connect(socket=own_tsd.socket, job="notice-job")
    assert c.last_notice() is None
    for bad in (0, -1.0, float("nan")):
        with pytest.raises(trainstream.InvalidRequest, match="positive number of seconds"):
            c.set_request_timeout(bad)
    c.set_request_timeout(5)
    c.jobs()  # still served after the refusals and the new timeout
    own_tsd.kill(signal.SIGTERM)
    notice = c.last_notice()
    assert notice is not None and notice.kind == "shutdown", notice
    assert notice.message
