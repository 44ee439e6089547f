"""One table per fact across the C++/Python line: sizes read as tsd reads them (checked against
the daemon itself), dtypes and the control page's size from the extension."""
import re
import subprocess

import pytest
import torch

import trainstream
from conftest import tsd_binary
from trainstream import units

SIZES = ["4096", "1G", "1g", "1GB", "1GiB", "1.5G", "1.5GB", "2 GiB", "512MiB", "512 mib", "512MB", "100KB", "300k",
         "300KiB", "7M", ".5G", "3000000.", "8192b", "0.001T", "0.001TB"]


def daemon_reads(size):
    """The bytes tsd reads `size` as (its --pool-size, through --print-config; a pool is whole
    pages, so rounded down to one)."""
    out = subprocess.run([tsd_binary(), "--pool-size", size, "--print-config"], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    return int(re.search(r"pool_size resolves to (\d+) bytes", out.stdout).group(1))


@pytest.mark.parametrize("size", SIZES)
def test_sizes_read_the_same_on_both_sides(size):
    assert trainstream.parse_bytes(size) // units.PAGE_BYTES * units.PAGE_BYTES == daemon_reads(size)


def test_iec_and_si_units_mean_what_they_say():
    assert trainstream.parse_bytes("8GiB") == 8 << 30
    assert trainstream.parse_bytes("1G") == 1 << 30          # a bare G is GiB, as tsd reads it
    assert trainstream.parse_bytes("1GB") == 10**9
    assert trainstream.parse_bytes("2MB") == 2 * 10**6
    assert trainstream.parse_bytes("2M") == trainstream.parse_bytes("2MiB") == 2 << 20
    assert trainstream.parse_bytes("1.5G") == 3 << 29
    assert trainstream.parse_bytes("1TB") == 10**12 and trainstream.parse_bytes("1t") == 1 << 40
    assert trainstream.parse_bytes(4096) == 4096 and trainstream.parse_bytes(None) == 0


@pytest.mark.parametrize("bad", ["lots", "1.2.3G", "5 parsecs", "G", "1e3", "-1G", "60%"])
def test_unreadable_sizes_say_what_is_accepted(bad):
    with pytest.raises(ValueError, match="GiB"):
        trainstream.parse_bytes(bad)


def test_wrong_types_and_negative_sizes_are_refused():
    with pytest.raises(ValueError, match="negative"):
        trainstream.parse_bytes(-1)
    with pytest.raises(TypeError):
        trainstream.parse_bytes(True)
    with pytest.raises(TypeError):
        trainstream.parse_bytes(1.5)
    with pytest.raises(ValueError, match="too large"):
        trainstream.parse_bytes("20000000TB")


def test_dtypes_come_from_the_extension_and_match_torch():
    assert set(units.DTYPE_BYTES) == {"float32", "bfloat16", "float16"}
    for name, size in units.DTYPE_BYTES.items():
        assert getattr(torch, name).itemsize == size
        assert units.TSD_DTYPES[getattr(torch, name)] == name
    assert units.tsd_dtype("bf16") == "bfloat16" and units.tsd_dtype(torch.float16) == "float16"
    with pytest.raises(ValueError, match="param_dtype must be one of float32, bfloat16, float16"):
        units.tsd_dtype(torch.int8, "param_dtype")


def test_page_and_control_page_sizes_come_from_the_headers(tsd):
    assert units.PAGE_BYTES == 4096
    one = units.control_page_bytes(1, 1)
    more = units.control_page_bytes(3, 100)
    assert 0 < one < more
    # The daemon's dry run charges the control page rounded up to pages: the same figure.
    with trainstream.connect(socket=tsd.socket) as c:
        hyper = {"lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}
        layout = c.plan_optimizer([hyper] * 3, [(0, 10, "float32", "float32")] * 100)
    assert layout.control_bytes == units.round_up(more, units.PAGE_BYTES)
