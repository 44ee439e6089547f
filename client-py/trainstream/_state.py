"""The daemon's optimizer state file (safetensors, format "tsd.optimizer.v1"), read and written
in place, without copies of the whole file on the process's heap.

The file is an unlinked temporary file (`new_file()`) in $TRAINSTREAM_STATE_DIR, else the system's
temporary directory: the daemon writes it (`SaveState`), `read()` maps it and returns tensors
that are views of the mapping (its pages are the file's page cache, which the kernel can write
back and drop, not the process's anonymous memory), and `write()` fills it one tensor at a time
for `LoadState`. On a tmpfs the file's pages are RAM: point $TRAINSTREAM_STATE_DIR at a disk for
large models.

Per bucket b the daemon writes "b<b>.master" (F32), "b<b>.exp_avg" and "b<b>.exp_avg_sq" (F32 or
BF16, the registered moment dtype) and "b<b>.step" (I64, one element); LoadState wants exactly
these tensors for exactly its layout. The names come from the one table both sides share,
proto/state_format.h, exported by the extension (`_C.STATE_FORMAT`, `_C.STATE_PARTS`)."""
import json
import mmap
import os
import struct
import tempfile

import torch

from . import _C  # type: ignore[attr-defined]  # the pybind11 extension

FORMAT: str = _C.STATE_FORMAT
# The entries of one bucket, in the order the daemon writes them.
PARTS: tuple = tuple(_C.STATE_PARTS)
# The metadata's name of each moment dtype.
MOMENT_TAGS = {"float32": "F32", "bfloat16": "BF16"}
_TO_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


def entry(bucket, part):
    """The name of one bucket's entry: entry(3, "exp_avg") == "b3.exp_avg"."""
    if part not in PARTS:
        raise ValueError(f"a state entry is one of {PARTS}, not {part!r}")
    return f"b{bucket}.{part}"


def bucket_states(tensors, buckets):
    """{bucket: (master, exp_avg, exp_avg_sq, step)} of `buckets` from a state file's tensors
    (`read()`'s): the tensors as they are (views), the step an int."""
    e = entry
    return {b: (tensors[e(b, "master")], tensors[e(b, "exp_avg")], tensors[e(b, "exp_avg_sq")],
                int(tensors[e(b, "step")][0])) for b in buckets}


def state_dir():
    """Where state files are made: $TRAINSTREAM_STATE_DIR, else the system's temporary directory."""
    return os.environ.get("TRAINSTREAM_STATE_DIR") or tempfile.gettempdir()


def new_file(name="trainstream-state"):
    """A new, empty, unlinked file for the daemon to write or read state in (a descriptor; the
    caller closes it). Its space goes back when the descriptor and every mapping of it are gone."""
    d = state_dir()
    try:
        return os.open(d, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    except (AttributeError, OSError):
        pass  # no O_TMPFILE here (or the file system lacks it): a named file, unlinked at once
    try:
        fd, path = tempfile.mkstemp(prefix=name + "-", dir=d)
    except OSError as e:
        raise OSError(f"cannot make a state file in {d!r} ({e.strerror}): set $TRAINSTREAM_STATE_DIR to a writable "
                      f"directory on a disk") from e
    os.unlink(path)
    return fd


def read(fd, copy=False):
    """{name: tensor} and the metadata of a state file. The tensors are views of a private
    mapping of the file (`copy`: independent copies on the heap instead). A view stays valid as
    long as it exists, whatever happens to the descriptor or the daemon afterwards (the mapping
    lives until the last view of it is dropped); writing into one changes that tensor only (the
    page is copied on write)."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError("the state file is too short to be safetensors")
    mm = mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE)
    (hlen,) = struct.unpack("<Q", mm[:8])
    if 8 + hlen > size:
        mm.close()
        raise ValueError(f"the state file's header length {hlen} is not plausible for a file of {size} bytes")
    header = json.loads(bytes(mm[8:8 + hlen]))
    meta = header.pop("__metadata__", {})
    data = 8 + hlen
    out = {}
    for name, t in header.items():
        begin, end = t["data_offsets"]
        dtype = _TO_TORCH[t["dtype"]]
        if not 0 <= begin <= end <= size - data:
            raise ValueError(f"the state file's entry {name!r} lies outside the file")
        if end > begin:
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=data + begin)  # keeps mm mapped
        else:
            raw = torch.empty(0, dtype=torch.uint8)
        if copy:
            raw = raw.clone()
        out[name] = raw.view(dtype).reshape(t["shape"])
    return out, meta


def write(fd, tensors, metadata):
    """Writes {name: tensor} as safetensors into `fd` (truncated first), in the given order. A
    value may also be (dtype, shape, make): `make()` is called when that entry is written, so at
    most one such tensor is alive at a time (a streaming write)."""
    header = {"__metadata__": metadata}
    offset = 0
    items = []
    for name, t in tensors.items():
        if isinstance(t, torch.Tensor):
            dtype, shape, make = t.dtype, tuple(t.shape), (lambda t=t: t)
        else:
            dtype, shape, make = t
        nbytes = _numel(shape) * dtype.itemsize
        header[name] = {"dtype": _FROM_TORCH[dtype], "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        items.append((make, dtype, shape, offset, nbytes))
        offset += nbytes
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-(8 + len(h)) % 8)
    total = 8 + len(h) + offset
    os.ftruncate(fd, 0)
    os.ftruncate(fd, total)
    with mmap.mmap(fd, total, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        mm[:8] = struct.pack("<Q", len(h))
        mm[8:8 + len(h)] = h
        dst = torch.frombuffer(mm, dtype=torch.uint8)
        base = 8 + len(h)
        for make, dtype, shape, off, nbytes in items:
            if nbytes:
                t = make().detach()
                if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                    raise ValueError(f"a state entry made {t.dtype} {tuple(t.shape)} where {dtype} {tuple(shape)} was "
                                     f"announced")
                dst[base + off:base + off + nbytes].copy_(t.contiguous().reshape(-1).view(torch.uint8))
                del t
        del dst
    return total


def _numel(shape):
    n = 1
    for s in shape:
        n *= int(s)
    return n
