"""Each example in examples/ runs on the CPU with tiny settings against a real tsd, as a user would
start it (a subprocess), exits 0 and prints PASS with what it checked; bad arguments are refused
with what to do. On a GPU machine the examples pick CUDA by themselves; these runs pin the CPU,
and `test_examples_on_cuda` runs each on the GPU (skipped without one)."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT

EXAMPLES = os.path.join(ROOT, "examples")


def run(tsd, name: str, *args: str, socket: bool = True, timeout: int = 600,
        cuda: bool = False) -> subprocess.CompletedProcess:
    import trainstream
    pkg = os.path.dirname(os.path.dirname(os.path.abspath(trainstream.__file__)))  # the package the tests import
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([pkg, os.environ.get("PYTHONPATH", "")]),
               OMP_NUM_THREADS="1", TRAINSTREAM_PROGRESS="0")
    if not cuda:
        env["CUDA_VISIBLE_DEVICES"] = ""
    cmd = [sys.executable, os.path.join(EXAMPLES, name), *args, *(["--socket", tsd.socket] if socket else [])]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)


def passed(r: subprocess.CompletedProcess) -> str:
    out = r.stdout + r.stderr
    assert r.returncode == 0, out
    lines = r.stdout.strip().splitlines()
    assert lines and lines[-1].startswith("PASS"), out
    assert "FAIL" not in r.stdout, out
    return r.stdout


def test_train_bigger_than_vram_pages_on_the_cpu(tsd):
    out = passed(run(tsd, "train_bigger_than_vram.py", "--device", "cpu", "--width", "32", "--blocks", "3",
                     "--steps", "4", "--seq", "16"))
    assert "a VRAM cap needs a CUDA GPU" in out  # says what the capped run needs
    assert "PASS: the paged run's losses equal the unpaged run's exactly" in out
    assert "PASS: the loss falls" in out
    assert "are paged from tsd's memory" in out


def test_train_bigger_than_vram_asks_for_cuda_when_told_to_use_it(tsd):
    r = run(tsd, "train_bigger_than_vram.py", "--device", "cuda")
    assert r.returncode == 1 and "no CUDA device is visible" in r.stdout, r.stdout + r.stderr


def test_lora_large_model_equals_stock_peft(tsd):
    out = passed(run(tsd, "lora_large_model.py", "--compare", "--steps", "3", "--seq", "16", "--rank", "4"))
    assert "PASS: the losses equal the stock Trainer's" in out
    assert "PASS: only the adapters are trained in tsd" in out
    assert "stock Trainer + peft: losses" in out and "TrainStreamTrainer: losses" in out


def test_lora_large_model_on_an_nf4_base(tsd):
    out = passed(run(tsd, "lora_large_model.py", "--quantize", "nf4", "--prefer", "speed", "--steps", "2",
                     "--seq", "16", "--rank", "4"))
    assert "base: nf4 while loading" in out
    assert "PASS: the frozen base is unchanged" in out


def test_lora_large_model_refuses_an_architecture_without_weights(tsd):
    r = run(tsd, "lora_large_model.py", "--model", "qwen32b", socket=False)
    assert r.returncode == 2 and "--random-weights" in r.stderr, r.stdout + r.stderr
    r = run(tsd, "lora_large_model.py", "--model", "/nonexistent", socket=False)
    assert r.returncode != 0 and "config.json" in r.stdout + r.stderr


def test_verify_ram_offload_stays_true(tsd):
    out = passed(run(tsd, "verify_ram_offload.py", "--device", "cpu", "--width", "64", "--layers", "2",
                     "--steps", "2"))
    assert "PASS" in out


def test_hf_finetune_compares_with_the_stock_trainer(tsd):
    out = passed(run(tsd, "hf_finetune.py", "--device", "cpu", "--steps", "2", "--batch", "2", "--seq", "16",
                     "--compare"))
    assert "PASS" in out


def test_finetune_tiny_the_main_job(tsd):
    r = run(tsd, "finetune_tiny.py", "--device", "cpu", "--steps", "4")
    assert r.returncode == 0 and "finetune_tiny: OK" in r.stdout, r.stdout + r.stderr


# Each example on the GPU, with what its output must say there.
ON_CUDA = [
    ("lora_large_model.py", ["--device", "cuda", "--compare", "--steps", "3", "--seq", "16", "--rank", "4"],
     ["PASS: the losses equal the stock Trainer's", "PASS: only the adapters are trained in tsd"]),
    ("lora_large_model.py", ["--device", "cuda", "--quantize", "nf4", "--prefer", "speed", "--steps", "2", "--seq",
                             "16", "--rank", "4"], ["base: nf4 while loading", "PASS: the frozen base is unchanged"]),
    ("verify_ram_offload.py", ["--device", "cuda"], []),
    ("hf_finetune.py", ["--device", "cuda", "--steps", "4", "--compare"], []),
    ("hf_finetune.py", ["--device", "cuda", "--steps", "4", "--compare", "--lora", "--bf16",
                        "--gradient-checkpointing"], []),
]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
@pytest.mark.parametrize("name,args,says", ON_CUDA, ids=lambda v: v if isinstance(v, str) else None)
def test_examples_on_cuda(tsd, name, args, says):
    out = passed(run(tsd, name, *args, cuda=True))
    for text in says:
        assert text in out, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
def test_train_bigger_than_vram_with_its_defaults_on_cuda(tmp_path):
    """The example as a user runs it: 16 blocks of width 1024 (516 MiB of fp32 weights) under a
    cap of 60% of them, beside its own tsd with a pool for their optimizer state (about 2 GiB).
    At width 512 the cap (116 MiB) was mostly the 64 MiB of cuBLAS workspaces a Hopper step makes,
    and its 8 MiB blocks came in the allocator's 20 MiB segments: the H100 ran out on fragments."""
    from conftest import Daemon

    d = Daemon(tmp_path, pool="4GiB")
    try:
        out = passed(run(d, "train_bigger_than_vram.py", "--device", "cuda", cuda=True))
    finally:
        d.stop()
    for text in ("are larger than the VRAM cap", "PASS: the loss falls", "stays under the cap"):
        assert text in out, out


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA required")
def test_finetune_tiny_the_main_job_on_cuda(tsd):
    r = run(tsd, "finetune_tiny.py", "--device", "cuda", "--steps", "8", cuda=True)
    assert r.returncode == 0 and "finetune_tiny: OK" in r.stdout, r.stdout + r.stderr
