"""The daemon's optimizer state file (safetensors, format "tsd.optimizer.v1"), read and written
in place through a memfd, without copies of the whole file.

Per bucket b the daemon writes "b<b>.master" (F32), "b<b>.exp_avg" and "b<b>.exp_avg_sq" (F32 or
BF16, the registered moment dtype) and "b<b>.step" (I64, one element); LoadState wants exactly
these tensors for exactly its layout. `entry()` and `PARTS` are the one table of these names on
the Python side (the daemon's is daemon/optimizer/job_optimizer_state.cc; the tests save and load
through the daemon, so the two cannot drift apart unnoticed)."""
import json
import mmap
import os
import struct

import torch

FORMAT = "tsd.optimizer.v1"
# The entries of one bucket, in the order the daemon writes them.
PARTS = ("master", "exp_avg", "exp_avg_sq", "step")
# The metadata's name of each moment dtype.
MOMENT_TAGS = {"float32": "F32", "bfloat16": "BF16"}
_TO_TORCH = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16, "I64": torch.int64}
_FROM_TORCH = {v: k for k, v in _TO_TORCH.items()}


def entry(bucket, part):
    """The name of one bucket's entry: entry(3, "exp_avg") == "b3.exp_avg"."""
    if part not in PARTS:
        raise ValueError(f"a state entry is one of {PARTS}, not {part!r}")
    return f"b{bucket}.{part}"


def new_file(name="trainstream-state"):
    return os.memfd_create(name, os.MFD_CLOEXEC)


def read(fd):
    """{name: tensor} (copies, independent of the file) and the metadata of a state file."""
    size = os.fstat(fd).st_size
    if size < 8:
        raise ValueError("the state file is too short to be safetensors")
    with mmap.mmap(fd, size, mmap.MAP_PRIVATE, mmap.PROT_READ | mmap.PROT_WRITE) as mm:
        (hlen,) = struct.unpack("<Q", mm[:8])
        header = json.loads(bytes(mm[8:8 + hlen]))
        meta = header.pop("__metadata__", {})
        data = 8 + hlen
        out = {}
        for name, t in header.items():
            begin, end = t["data_offsets"]
            dtype = _TO_TORCH[t["dtype"]]
            raw = torch.frombuffer(mm, dtype=torch.uint8, count=end - begin, offset=data + begin) if end > begin \
                else torch.empty(0, dtype=torch.uint8)
            out[name] = raw.clone().view(dtype).reshape(t["shape"])
            del raw
    return out, meta


def write(fd, tensors, metadata):
    """Writes {name: tensor} as safetensors into `fd` (truncated first), in the given order."""
    header = {"__metadata__": metadata}
    offset = 0
    items = []
    for name, t in tensors.items():
        t = t.detach().contiguous().cpu()
        nbytes = t.numel() * t.element_size()
        header[name] = {"dtype": _FROM_TORCH[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + nbytes]}
        items.append((t, offset, nbytes))
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
        for t, off, nbytes in items:
            if nbytes:
                dst[base + off:base + off + nbytes].copy_(t.reshape(-1).view(torch.uint8))
        del dst
    return total
