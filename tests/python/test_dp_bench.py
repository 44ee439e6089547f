"""bench/dp_bench.py (issue 17's data-parallel benchmark) on a CPU: a smoke run of the modes a CPU
can train (tsd_dp and fsdp2_dp, 2 ranks over gloo, a tiny Qwen2 written by the test, no download),
the argument handling of the GPU-only settings (--gpus, --scaling, the NCCL modes), the sampler's
several devices and steps window, and report.py's scaling block."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from types import SimpleNamespace
from typing import Optional

import pytest

from conftest import ROOT, tsd_binary

sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchlib  # noqa: E402
import dp_bench  # noqa: E402
import dp_modes  # noqa: E402
import report  # noqa: E402

TINY_PEERS = '''ARCH = {"tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=256, tie_word_embeddings=False)}
'''


def test_cpu_run_of_tsd_dp_and_fsdp2_dp_records_both_and_skips_deepspeed(tmp_path):
    peers = tmp_path / "peers.py"
    peers.write_text(TINY_PEERS)
    results = tmp_path / "dp.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "dp_bench.py"), "--device", "cpu", "--arch", "tiny",
           "--peers", str(peers), "--tsd-bin", tsd_binary(), "--pool-size", "1GiB", "--batch", "2", "--seq", "16",
           "--steps", "3", "--modes", "tsd_dp,fsdp2_dp,ds_offload_dp", "--results", str(results),
           "--sample-interval", "0.05", "--overlap", "--gpu-fraction", "0.3"]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")  # the model comes from the config alone
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=240, cwd=ROOT, env=env)
    assert out.returncode == 0, (out.stdout + out.stderr)[-3000:]
    tsd, fsdp2, ds = benchlib.read_results(str(results))
    assert [r["mode"] for r in (tsd, fsdp2, ds)] == ["tsd_dp", "fsdp2_dp", "ds_offload_dp"]
    assert len({r["run_id"] for r in (tsd, fsdp2, ds)}) == 1 and [r["order"] for r in (tsd, fsdp2, ds)] == [0, 1, 2]
    for rec in (tsd, fsdp2):
        assert rec["status"] == "ok", rec.get("reason")
        w, v = rec["workload"], rec["values"]
        assert (w["placement"], w["gpus"], w["ranks"], w["backend"], w["clip"]) == ("cpu", 0, 2, "gloo", 1.0)
        assert v["step_s"] == v["step_s_median"] > 0 and len(v["step_s_all"]) == 3
        assert v["tokens_per_s"] == pytest.approx(2 * 16 * 2 / v["step_s"])
        assert len(v["step_s_median_per_rank"]) == 2 and v["params"] > 0
        # The breakdown, as finetune_bench's: forward, backward, the rest of the step (the CPU's wall time)
        parts = [v["gpu_forward_ms"], v["gpu_backward_ms"], v["step_wait_ms"]]
        assert all(x > 0 for x in parts) and sum(parts) <= max(v["step_s_all"]) * 1e3 * 1.05
        assert v["host_pss_peak_gib"] >= v["trainer_pss_peak_gib"] > 0
        assert v["host_pss_peak_gib"] >= v["host_pss_steps_peak_gib"] > 0  # the steps window was sampled
        assert "vram_device_peak_gib" not in v and "vram_torch_peak_gib" not in v  # no GPU: no VRAM figure
        assert rec["raw"]["world"] == 2 and len(rec["raw"]["losses"]) == 3
    assert tsd["values"]["tsd_pss_peak_gib"] > 0 and "tsd_pss_peak_gib" not in fsdp2["values"]
    assert tsd["workload"]["weights"] == "fp32" and "in tsd" in tsd["workload"]["precision"]
    # tsd_dp's own options reach wrap(): the GPU share, the overlap, the reduction over gloo in backward.
    assert tsd["workload"]["overlap"] is True and tsd["workload"]["gpu_fraction"] == 0.3
    assert "overlap" not in fsdp2["workload"] and "gpu_fraction" not in fsdp2["workload"]
    events = "\n".join(tsd["raw"]["events"])
    assert "tensors of them in the GPU share" in events and "overlap_forward:" in events, events
    assert "gradients reduced on cpu through gloo, bucket by bucket" in events, events
    # The same model (seed 0) and data: the first losses agree to bf16 rounding.
    assert abs(tsd["values"]["first_loss"] - fsdp2["values"]["first_loss"]) < 1e-2
    assert ds["status"] == "skipped" and "needs CUDA" in ds["reason"]
    assert "tsd_dp: " in out.stdout and "ds_offload_dp: skipped: needs CUDA" in out.stdout


def _args(*argv: str):
    return dp_bench.parse_args(list(argv))


@pytest.mark.parametrize("argv, message", [
    (["--device", "cpu", "--gpus", "2"], "need --device cuda"),
    (["--device", "cpu", "--scaling", "1,2"], "need --device cuda"),
    (["--gpus", "2", "--scaling", "1,2"], "not both"),
    (["--gpus", "2", "--ranks", "3"], "one rank per GPU"),
    (["--scaling", "1,2", "--ranks", "2"], "leave --ranks out"),
    (["--scaling", "1,x"], "give GPU counts"),
    (["--scaling", "2,2"], "distinct GPU counts"),
    (["--gpus", "0"], "--gpus must be >= 1"),
    (["--modes", "tsd_dp,nonsense"], "unknown mode(s) nonsense"),
])
def test_bad_arguments_are_refused_with_what_to_change(capsys, argv, message):
    with pytest.raises(SystemExit):
        _args(*argv)
    assert message in capsys.readouterr().err


def test_gpu_counts_the_machine_lacks_are_skipped_or_refused(capsys):
    a = _args("--scaling", "1,2,4,8", "--modes", "tsd_dp,fsdp2_dp")
    assert a.ranks == 2 and a.scaling == [1, 2, 4, 8]
    counts, beyond = dp_bench.configurations(a, available=2)
    assert counts == [1, 2, 4, 8] and beyond == {4: "the machine has 2 GPUs", 8: "the machine has 2 GPUs"}
    assert "skipping 4 GPUs: the machine has 2 GPUs" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="--gpus 4: this machine has 2 visible CUDA devices"):
        dp_bench.configurations(_args("--gpus", "4"), available=2)
    with pytest.raises(SystemExit, match="no CUDA device is visible"):
        dp_bench.configurations(_args("--gpus", "2"), available=0)
    assert dp_bench.configurations(_args("--gpus", "2"), available=8) == ([2], {})
    assert dp_bench.configurations(_args(), available=1) == ([None], {})  # issue 16's ranks on one GPU
    assert dp_bench.configurations(_args("--device", "cpu"), available=0) == ([None], {})


def test_modes_that_need_cuda_or_a_gpu_per_rank_say_so():
    assert "needs CUDA" in dp_modes.skip_reason("ds_offload_dp", "cpu", None)
    assert "needs CUDA" in dp_modes.skip_reason("fsdp2_offload_dp", "cpu", None)
    assert "needs CUDA" in dp_modes.skip_reason("torchao_dp", "cpu", None)
    for mode in dp_modes.NCCL_MODES:
        assert "needs one GPU per rank (--gpus N" in dp_modes.skip_reason(mode, "cuda", None)
    assert dp_modes.skip_reason("fsdp2_dp", "cuda", 2) is None and dp_modes.skip_reason("fsdp2_dp", "cpu", None) is None
    ds = dp_modes.skip_reason("ds_offload_dp", "cuda", 2)
    import importlib.util
    assert ds == (None if importlib.util.find_spec("deepspeed") else "deepspeed is not installed")


def test_one_rank_per_gpu_runs_nccl_and_says_so_in_its_records():
    a = _args("--gpus", "2", "--arch", "qwen7b", "--batch", "4", "--modes", "tsd_dp,ds_offload_dp", "--weights", "bf16",
              "--grad-ckpt")
    assert a.ranks == 2 and dp_bench.world_of(a) == 2 and dp_bench.placement(a) == "per_gpu"
    argv = dp_bench.child_argv(a, "ds_offload_dp", 2, None, "/tmp/phase")
    assert argv[argv.index("--gpus") + 1] == "2" and "--ranks" not in argv and "--grad-ckpt" in argv
    assert argv[argv.index("--phase-file") + 1] == "/tmp/phase" and argv[argv.index("--clip") + 1] == "1.0"
    child = dp_bench.parse_args(argv[2:])  # the launched process reads the same settings back
    assert (child.mode, child.gpus, child.ranks, child.batch, child.weights) == ("ds_offload_dp", 2, 2, 4, "bf16")
    w = dp_bench.workload(a, "tsd_dp", 2)
    assert (w["placement"], w["gpus"], w["ranks"], w["backend"]) == ("per_gpu", 2, 2, "cpu:gloo,cuda:nccl")
    assert w["weights"] == "bf16" and w["grad_ckpt"] is True and w["precision"].startswith("bf16 weights")
    assert dp_bench.workload(a, "ds_offload_dp", 2)["weights"] is None  # --weights is tsd_dp's
    shared = dp_bench.workload(_args("--ranks", "3"), "tsd_dp", None)
    assert (shared["placement"], shared["gpus"], shared["ranks"], shared["backend"]) == ("one_gpu", 1, 3, "gloo")


def test_deepspeed_gets_offload_peers_config_at_the_world_size():
    conf = dp_modes.ds_config(4, 2, 1.0)
    assert conf["train_micro_batch_size_per_gpu"] == 4 and conf["train_batch_size"] == 8
    assert conf["zero_optimization"]["stage"] == 2 and conf["bf16"] == {"enabled": True}
    assert conf["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert conf["gradient_clipping"] == 1.0 and conf["optimizer"]["params"] == {"lr": 1e-5, "weight_decay": 0.01}


def test_a_run_split_over_commands_continues_its_order(tmp_path):
    path = tmp_path / "dp.jsonl"
    rec = benchlib.Recorder("dp", str(path), command="x", run_id="r1")
    rec.record("tsd_dp", {}, {"step_s": 1.0})
    rec.record("ds_offload_dp", {}, {"step_s": 2.0})
    assert dp_bench.continued_order([str(path), str(tmp_path / "none.jsonl")], "r1") == 2
    with pytest.raises(SystemExit, match="no record of that run"):
        dp_bench.continued_order([str(path)], "r2")


class _FakeNvml:
    """Two devices whose used memory grows with every read (GPU 1 twice as fast)."""

    def __init__(self) -> None:
        self.reads = [0, 0]

    def used_bytes(self, index: int = 0) -> Optional[int]:
        self.reads[index] += 1
        return (1 + index) * self.reads[index] << 20


def test_the_sampler_reads_every_gpu_and_the_steps_window(tmp_path):
    phase = tmp_path / "steps"
    child = (f"import os, time; time.sleep(0.3); open({str(phase)!r}, 'w').close(); time.sleep(0.3); "
             f"os.unlink({str(phase)!r}); time.sleep(0.2)")
    nvml = _FakeNvml()
    run = benchlib.run_sampled([sys.executable, "-c", child], 0.02, nvml=nvml, gpu_indices=[0, 1],  # type: ignore[arg-type]
                               phase_file=str(phase))
    assert run.returncode == 0 and run.steps_samples > 0
    v = run.values()
    per_gpu = v["vram_device_peak_gib_per_gpu"]
    assert len(per_gpu) == 2 and per_gpu[1] > per_gpu[0] > 0 and v["vram_device_peak_gib"] == per_gpu[1]
    steps = v["vram_device_steps_peak_gib_per_gpu"]
    assert 0 < steps[0] < per_gpu[0] and 0 < steps[1] < per_gpu[1]  # the window closed before the last reads
    assert v["host_pss_peak_gib"] >= v["host_pss_steps_peak_gib"] > 0
    one = benchlib.run_sampled([sys.executable, "-c", "pass"], 0.02, nvml=_FakeNvml())  # type: ignore[arg-type]
    assert "vram_device_peak_gib_per_gpu" not in one.values() and "vram_device_steps_peak_gib" not in one.values()


def _scaling_records(run_id: str, when: str, points: dict[str, dict[int, Optional[float]]]) -> list[dict]:
    out: list[dict] = []
    for mode, by_gpus in points.items():
        for gpus, step in by_gpus.items():
            rec = {"schema": 1, "benchmark": "dp", "run_id": run_id, "order": len(out), "repeat": 0, "mode": mode,
                   "status": "ok" if step else "skipped", "workload": {"arch": "qwen7b", "gpus": gpus,
                                                                       "placement": "per_gpu", "ranks": gpus},
                   "values": {"step_s_median": step, "tokens_per_s": 2048 * gpus / step} if step else {},
                   "host": {"gpu": "NVIDIA H100 80GB HBM3", "cpus": 64}, "command": "python3 bench/dp_bench.py --scaling 1,2,4,8",
                   "source": "measured", "time_utc": when}
            if not step:
                rec["reason"] = "the machine has 2 GPUs"
            out.append(rec)
    return out


def test_the_scaling_block_plots_tokens_per_second_against_gpus(tmp_path):
    records = _scaling_records("r-scaling", "2026-12-06T00:00:00Z",
                               {"tsd_dp": {1: 2.0, 2: 2.5, 4: None}, "fsdp2_dp": {1: 1.0, 2: 1.0}})
    records += _scaling_records("r-later-one-count", "2026-12-07T00:00:00Z", {"tsd_dp": {2: 9.0}})  # not a scaling run
    doc = ("<!-- report:s kind=scaling benchmark=dp arch=qwen7b placement=per_gpu img=s.png title=\"tokens/s\" -->\n"
           "<!-- /report:s -->\n")
    new, plots = report.generate(doc, records, str(tmp_path))
    assert "Run `r-scaling`" in new and "r-later-one-count" not in new
    assert "![tokens/s](" + tmp_path.name + "/s.png)" in new
    assert "| `tsd_dp` | 1 | 1 | 2.000 | 1024 | 1.00 | 1.00 |" in new
    assert "| `tsd_dp` | 2 | 1 | 2.500 | 1638 | 1.60 | 0.80 |" in new
    assert "| `tsd_dp` | 4 | 0 | skipped: the machine has 2 GPUs |" in new
    assert "| `fsdp2_dp` | 2 | 1 | 1.000 | 4096 | 2.00 | 1.00 |" in new
    assert len(plots) == 1 and plots[0].kind == "scaling"
    assert plots[0].series == {"tsd_dp": [(1.0, 1024.0), (2.0, 1638.4)], "fsdp2_dp": [(1.0, 2048.0), (2.0, 4096.0)]}
    pinned = doc.replace("title=", "run=r-later-one-count title=")
    assert "Run `r-later-one-count`" in report.generate(pinned, records, str(tmp_path))[0]
    # The PNG is the same bytes every time (no date in it).
    report.write_plot(plots[0])
    first = (tmp_path / "s.png").read_bytes()
    time.sleep(1.1)
    report.write_plot(plots[0])
    assert (tmp_path / "s.png").read_bytes() == first


def test_a_scaling_block_without_a_run_says_so_and_how_to_make_one(tmp_path):
    doc = ("<!-- report:s kind=scaling benchmark=dp arch=qwen7b img=s.png howto=\"scripts/gpu.sh dp --scaling 1,2\" -->\n"
           "<!-- /report:s -->\n")
    one_count = _scaling_records("r", "2026-12-06T00:00:00Z", {"tsd_dp": {2: 2.0}})
    new, plots = report.generate(doc, one_count, str(tmp_path))
    assert plots == []
    assert ("_No results recorded for this workload yet: no run at two or more GPU counts, so no plot._ "
            "Produce them with:\n\n    scripts/gpu.sh dp --scaling 1,2\n") in new
    with pytest.raises(report.ReportError, match="img=NAME.png"):
        report.generate(doc.replace("img=s.png ", ""), [], str(tmp_path))


def test_values_of_a_run_hold_every_ranks_peak_and_tokens_per_second():
    run = benchlib.ChildRun()
    run.rss_peak_bytes = 1 << 30
    raw = {"step_s_median": 2.0, "steps": [5.0, 2.1, 2.0], "losses": [12.0, 11.5, 11.0], "setup_s": 3.0, "params": 10,
           "peak_vram_gib": 30.0, "torch_peak_gib_per_rank": [30.0, 31.0], "step_s_median_per_rank": [2.0, 2.01],
           "gpu_forward_ms": 400.0, "gpu_backward_ms": 900.0, "step_rest_ms": 650.0}
    v = dp_bench.values_of(run, raw, SimpleNamespace(batch=4, seq=512), 2)
    assert v["tokens_per_s"] == 4 * 512 * 2 / 2.0 and v["step_s"] == v["step_s_median"] == 2.0
    assert v["vram_torch_peak_gib"] == 31.0 and v["vram_torch_peak_gib_per_rank"] == [30.0, 31.0]
    assert v["peak_vram_gib"] == 30.0 and v["first_loss"] == 12.0 and v["last_loss"] == 11.0
    assert (v["gpu_forward_ms"], v["gpu_backward_ms"], v["step_wait_ms"]) == (400.0, 900.0, 650.0)
    benchlib.validate_record({"schema": 1, "benchmark": "dp", "run_id": "r", "order": 0, "repeat": 0, "mode": "tsd_dp",
                              "status": "ok", "workload": {}, "values": v, "host": {}, "command": "c",
                              "source": "measured"})
    json.dumps(v)


@pytest.mark.parametrize("tie", [True, False])
def test_drawn_model_is_the_model_transformers_builds(tie):
    """bench/finetune_model.drawn_model (the benchmarks' models drawn on the GPU) has the
    parameters, the tying and the initialisation's shape of Qwen2ForCausalLM(cfg): untied, the
    1.5B benchmark model had 233M more parameters than the peers' (tie_word_embeddings)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from finetune_model import drawn_model

    cfg = Qwen2Config(vocab_size=1000, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                      attn_implementation="sdpa", tie_word_embeddings=tie)
    ref = Qwen2ForCausalLM(cfg)
    model = drawn_model(cfg, torch.float32, "cpu", "cpu")
    assert [(n, p.shape) for n, p in model.named_parameters()] == [(n, p.shape) for n, p in ref.named_parameters()]
    assert (model.lm_head.weight is model.model.embed_tokens.weight) == tie
    for (name, p), (_, q) in zip(model.named_parameters(), ref.named_parameters()):
        if name.endswith("norm.weight") or name.endswith(".bias"):
            assert torch.equal(p, q), name
        else:
            assert abs(p.std().item() - 0.02) < 0.002, name
    assert all(torch.equal(a, b) for a, b in zip(model.buffers(), ref.buffers()))
