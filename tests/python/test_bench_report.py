"""The benchmark pipeline: records appended by the benchmarks (bench/benchlib.py) and the docs
generated from them (bench/report.py). docs/benchmarks.md must be exactly what bench/results/
gives, so a figure typed into it by hand fails here."""
import copy
import json
import os
import random
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.join(ROOT, "bench"))
import benchlib  # noqa: E402
import finetune_bench  # noqa: E402
import finetune_child  # noqa: E402
import report  # noqa: E402
import stream  # noqa: E402

RESULTS = os.path.join(ROOT, "bench", "results")
DOCS = os.path.join(ROOT, "docs", "benchmarks.md")


def docs_text():
    with open(DOCS) as f:
        return f.read()


def test_committed_docs_are_what_the_results_give(capsys):
    assert report.main(["--check"]) == 0, capsys.readouterr()


def test_report_is_deterministic_whatever_the_order_of_the_records(tmp_path):
    records = benchlib.read_results_dir(RESULTS)
    assert records, "bench/results/ holds the transcribed runs at least"
    img = str(tmp_path / "img")
    first, plots = report.generate(docs_text(), records, img)
    again, _ = report.generate(docs_text(), records, img)
    shuffled = copy.deepcopy(records)
    random.Random(7).shuffle(shuffled)
    # The same records split over other files, in another order, give the same page.
    for i, part in enumerate((shuffled[::2], shuffled[1::2])):
        with open(tmp_path / f"part{i}.jsonl", "w") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    other, _ = report.generate(docs_text(), benchlib.read_results_dir(str(tmp_path)), img)
    assert first == again == other == docs_text()
    names = sorted(os.path.basename(p.path) for p in plots)
    assert "finetune-1.5b-8x512-stop7.png" in names and "finetune-1.5b-8x512-clip.png" in names
    for name in names:  # every plot the page shows is committed beside it
        assert os.path.exists(os.path.join(ROOT, "docs", "img", name)), name


def test_a_figure_typed_into_a_generated_block_fails_the_check_and_prose_is_kept(tmp_path, capsys):
    doc = docs_text()
    assert "| 0.523 |" in doc
    edited = tmp_path / "benchmarks.md"
    edited.write_text(doc.replace("| 0.523 |", "| 0.500 |", 1))
    assert report.main(["--check", "--docs", str(edited), "--img-dir", os.path.join(ROOT, "docs", "img")]) == 1
    out = capsys.readouterr()
    assert "-| `tsd_bf16_act`" in out.out and "0.500" in out.out and "figures are generated" in out.err
    # Rewriting restores the figure; hand-written prose outside the blocks stays as written.
    prose = doc.replace("Every figure on this page is generated", "Every figure here is generated", 1)
    edited.write_text(prose.replace("| 0.523 |", "| 0.500 |", 1))
    assert report.main(["--docs", str(edited), "--no-plots"]) == 0
    assert edited.read_text() == prose


def rec(run, order, mode, step, vram=10.0, status="ok"):
    return benchlib.validate_record({
        "schema": 1, "benchmark": "finetune", "run_id": run, "order": order, "repeat": 0, "mode": mode,
        "status": status, "workload": {"arch": "x", "batch": 1}, "values": {"step_s_median": step, "vram_torch_peak_gib": vram},
        "commit": None, "time_utc": "2026-01-01T00:00:00Z", "host": {"gpu": None, "cpus": 2}, "command": "bench x",
        "source": "measured"})


def table(records, **extra):
    attrs = {"benchmark": ["finetune"], "modes": ["a,b"], "cols": ["step"], "ratio": ["step:b"], **extra}
    return report.render_modes(report.Block("t", "modes", attrs, 1), records)


def row(text, mode):
    return next(ln for ln in text.splitlines() if ln.startswith(f"| `{mode}`"))


def test_a_ratio_within_10_percent_needs_the_median_of_3_interleaved_runs():
    one = [rec("r", 0, "a", 0.95), rec("r", 1, "b", 1.0)]
    assert row(table(one), "a").endswith("| 0.95 (not established) |")
    assert "not established" in table(one)
    # Far from 1, one run is enough.
    assert row(table([rec("r", 0, "a", 0.5), rec("r", 1, "b", 1.0)]), "a").endswith("| 0.50 |")
    # Three interleaved runs: the ratio of the medians stands.
    a, b = [0.90, 1.00, 0.94], [1.0, 1.02, 0.99]
    inter = [rec("r", 2 * i + j, m, x) for i in range(3) for j, (m, x) in enumerate((("a", a[i]), ("b", b[i])))]
    text = table(inter)
    assert row(text, "a").endswith(f"| {0.94 / 1.0:.2f} |") and "| 3 |" in row(text, "a")
    assert "not established" not in text
    # Three runs each, but A A A B B B: not interleaved, not established.
    blocked = [rec("r", i, "a", a[i]) for i in range(3)] + [rec("r", 3 + i, "b", b[i]) for i in range(3)]
    assert row(table(blocked), "a").endswith("(not established) |")
    # Runs from different invocations are not interleaved either.
    split = [rec(f"r{i}", 0, "a", a[i]) for i in range(3)] + [rec(f"r{i}", 1, "b", b[i]) for i in range(3)]
    assert not report.interleaved([r for r in split if r["mode"] == "a"], [r for r in split if r["mode"] == "b"])


def test_a_target_is_met_only_when_established():
    single = [rec("r", 0, "a", 0.58), rec("r", 1, "b", 1.0)]
    text = table(single, target=["a:step:b<=0.6"])
    assert "Target `a` s/step ≤ 0.6x `b`'s: 0.58, not established (margin 3% from 0.6 with 1 and 1 run)" in text
    inter = [rec("r", 2 * i + j, m, x) for i in range(3) for j, (m, x) in enumerate((("a", 0.58), ("b", 1.0)))]
    assert "0.58, met (margin 3%, 3 and 3 runs)" in table(inter, target=["a:step:b<=0.6"])
    assert "0.58, not met" in table(inter, target=["a:step:b<=0.5"])
    with pytest.raises(report.ReportError, match="MODE:COL:REFMODE"):
        table(single, target=["a<=0.6"])
    # The reference may be a variant of a mode (the same configuration uncapped, in the same run).
    variant = [rec("r", 0, "a", 1.2), rec("r", 1, "b:uncapped", 1.0)]
    text = table(variant, modes=["a,b:uncapped"], ratio=["step:b:uncapped"], target=["a:step:b:uncapped<=1.5"])
    assert row(text, "a").endswith("| 1.20 |") and "Target `a` s/step ≤ 1.5x `b:uncapped`'s: 1.20, met" in text


def test_latest_run_skipped_and_failed_modes_are_shown():
    old = [rec("old", 0, "a", 0.5), rec("old", 1, "b", 1.0)]
    new = [rec("new", 0, "a", 0.4), rec("new", 1, "b", 1.0)]
    for r in new:
        r["time_utc"] = "2026-02-01T00:00:00Z"
    new[1] = dict(new[1], status="skipped", reason="deepspeed is not installed", values={})
    text = table(old + new)
    assert text.startswith("Run `new`")
    assert "skipped: deepspeed is not installed" in row(text, "b")
    assert row(text, "a").endswith("| — |")  # no reference, no ratio
    assert "Run `old`" in table(old + new, run=["old"])


def test_finetune_runs_modes_interleaved():
    assert finetune_bench.schedule(["a", "b", "c"], 3, frozenset({"c"})) == [
        (0, "a"), (0, "b"), (0, "c"), (1, "a"), (1, "b"), (2, "a"), (2, "b")]
    assert finetune_bench.schedule(["a"], 1) == [(0, "a")]
    # A continued run's rounds follow the earlier ones; the --once modes ran in its first round.
    assert finetune_bench.schedule(["a", "c"], 2, frozenset({"c"}), first=1) == [(1, "a"), (2, "a")]


def test_bad_results_and_markers_are_refused_with_what_to_fix(tmp_path):
    bad = tmp_path / "x.jsonl"
    good = rec("r", 0, "a", 1.0)
    bad.write_text(json.dumps(good) + "\n{not json\n")
    with pytest.raises(benchlib.RecordError, match=r"x.jsonl:2: not JSON"):
        benchlib.read_results(str(bad))
    bad.write_text(json.dumps({**good, "status": "skipped"}) + "\n")
    with pytest.raises(benchlib.RecordError, match="needs a 'reason'"):
        benchlib.read_results(str(bad))
    with pytest.raises(report.ReportError, match="no closing"):
        report.generate("<!-- report:x kind=modes benchmark=f -->\n", [], str(tmp_path))
    with pytest.raises(report.ReportError, match="kind='table'"):
        report.generate("<!-- report:x kind=table benchmark=f -->\n<!-- /report:x -->\n", [], str(tmp_path))
    doc = "<!-- report:x kind=modes benchmark=f howto=\"run it\" -->\nold\n<!-- /report:x -->\n"
    out, _ = report.generate(doc, [], str(tmp_path))
    assert "No results recorded" in out and "run it" in out and "old" not in out


def test_record_lines_records_a_shell_benchmark(tmp_path):
    lines = '{"bench": "engine", "moments": "fp32", "params": 1000, "gparam_per_s": 1.5}\nplain text\n' \
            '{"bench": "torch_adamw_cpu", "skipped": "python3 has no torch"}\n'
    out = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "benchlib.py"), "record-lines", "--benchmark",
                          "optimizer", "--results", str(tmp_path / "o.jsonl"), "--command", "bench/x.sh 1000",
                          "--mode-keys", "bench,moments,impl", "--workload-keys", "params", "--workload", "build=b"],
                         input=lines, capture_output=True, text=True, check=True)
    assert out.stdout == lines  # echoed
    a, b = benchlib.read_results(str(tmp_path / "o.jsonl"))
    assert (a["mode"], a["workload"], a["values"], a["command"]) == (
        "engine/fp32", {"build": "b", "params": 1000}, {"gparam_per_s": 1.5}, "bench/x.sh 1000")
    assert (b["mode"], b["status"], b["reason"]) == ("torch_adamw_cpu", "skipped", "python3 has no torch")
    assert a["run_id"] == b["run_id"] and (a["order"], b["order"]) == (0, 1)


def test_plots_are_the_same_bytes_every_time(tmp_path):
    pytest.importorskip("matplotlib")
    p = report.Plot(str(tmp_path / "a.png"), "t", {"tsd": [(10.0, 0.5), (20.0, 0.4)], "stock": [(40.0, 0.15)]})
    report.write_plot(p)
    first = (tmp_path / "a.png").read_bytes()
    report.write_plot(p)
    assert first[:8] == b"\x89PNG\r\n\x1a\n" and (tmp_path / "a.png").read_bytes() == first


def test_a_budget_sweep_in_one_run_is_one_line_of_the_plot():
    """MODE:cap=G entries of one run are the points of one line (the mode's), at their caps; an
    uncapped entry sits at its measured peak; the table lists each point with its run."""
    def rec(mode, cap, step, peak):
        return {"schema": 1, "benchmark": "finetune", "run_id": "r1", "order": 0, "repeat": 0, "mode": mode,
                "status": "ok", "workload": {"arch": "qwen1.5b", "vram_cap_gib": cap},
                "values": {"step_s_median": step, "vram_device_peak_gib": peak}, "time_utc": "2026-12-05T00:00:00Z"}

    records = [rec("tsd_bf16_act:cap=8", 8.0, 0.9, 7.5), rec("tsd_bf16_act:cap=16:gpu=auto", 16.0, 0.5, 15.0),
               rec("tsd_bf16_act:cap=16", 16.0, 0.6, 15.2), rec("stock", 0, 0.15, 43.0)]
    assert report.series_name("tsd_bf16_act:cap=16:gpu=auto") == "tsd_bf16_act:gpu=auto"
    assert report.series_name("tsd_bf16m_act:uncapped") == "tsd_bf16m_act"
    block = report.parse_attrs("p", " kind=plot benchmark=finetune arch=qwen1.5b img=p.png ", 1)
    assert report.plot_points(block, records) == {
        "stock": [(43.0, 0.15, "r1")], "tsd_bf16_act": [(8.0, 0.9, "r1"), (16.0, 0.6, "r1")],
        "tsd_bf16_act:gpu=auto": [(16.0, 0.5, "r1")]}
    block = report.parse_attrs("p", " kind=plot benchmark=finetune modes=tsd_bf16_act,stock img=p.png ", 1)
    assert list(report.plot_points(block, records)) == ["tsd_bf16_act", "stock"]


def test_profile_files_are_named_with_characters_the_device_tool_brings_back():
    assert finetune_child.safe_name("tsd_bf16_act:cap=16:gpu=auto") == "tsd_bf16_act_cap_16_gpu_auto"
    assert finetune_child.safe_name("stock") == "stock"


def test_tiny_cpu_finetune_run_appends_well_formed_records(tsd, tmp_path):
    results = tmp_path / "finetune.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "finetune_bench.py"), "--device", "cpu", "--arch", "tiny",
           "--batch", "2", "--seq", "16", "--steps", "3", "--modes", "tsd,stock", "--socket", tsd.socket,
           "--results", str(results), "--sample-interval", "0.05", "--save-restore", "--profile-step", "3"]
    env = dict(os.environ, TSD_BENCH_PROFILE_DIR=str(tmp_path / "profile"))
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    ok, skipped = benchlib.read_results(str(results))
    assert ok["benchmark"] == "finetune" and ok["mode"] == "tsd" and ok["status"] == "ok", ok.get("reason")
    assert ok["workload"]["arch"] == "tiny" and ok["workload"]["clip"] == 1.0 and ok["workload"]["batch"] == 2
    assert ok["workload"]["params"] > 0 and ok["workload"]["device"] == "cpu"
    v = ok["values"]
    assert len(v["step_s"]) == 2 and v["step_s_median"] > 0  # the profiled third step is left out
    assert v.get("step_s_window") is None  # the profiled step is in the window: no drained mean
    # tsd's norm of every step (what it clipped by), and where setup's time went
    assert len(v["grad_norms"]) == 3 and all(n > 0 for n in v["grad_norms"])
    assert v["wrap_s"] > 0 and v["build_s"] > 0 and "registration in tsd" in ok["raw"]["wrap_event"]
    assert "Self CPU" in (tmp_path / "profile" / "profile-tsd.txt").read_text()
    assert "--profile-step: tsd; by CPU time" in out.stderr  # relayed into the run's log
    assert (tmp_path / "profile" / "profile-tsd.json.gz").stat().st_size > 0
    assert v["tsd_used_gib"] > 0 and v["host_pss_peak_gib"] >= v["trainer_pss_peak_gib"] > 0 and v["tsd_pss_peak_gib"] > 0
    # The host bound check_memory implied (the trainer before wrap(), tsd before the run, the
    # host_bytes it computed) is recorded beside the sampled peak.
    assert v["check_memory_host_gib"] > 0 and v["host_pss_before_wrap_gib"] > 0
    assert v["host_check_bound_gib"] > v["check_memory_host_gib"] and v["host_within_check"] in (0, 1)
    assert v["rss_peak_gib"] > 0 and "vram_torch_peak_gib" not in v  # no GPU: no VRAM figure rather than a zero
    # --save-restore: the two steps trained again after restoring gave the same losses, bit for bit.
    assert v["resume_exact"] == 1 and v["saved_gib"] > 0 and v["save_s"] > 0 and v["restore_s"] > 0
    assert "finetune_bench.py --device cpu --arch tiny" in ok["command"] and ok["host"]["cpus"] >= 1
    assert ok["time_utc"].endswith("Z") and ok["source"] == "measured"
    assert skipped["mode"] == "stock" and skipped["status"] == "skipped" and "needs a GPU" in skipped["reason"]
    assert ok["run_id"] == skipped["run_id"] and (ok["order"], skipped["order"]) == (0, 1)
    assert "| `tsd`" in out.stdout  # the run's table, printed at the end
    # --run-id continues the run (another call to the GPU machine): its order and rounds go on, and
    # the table at the end shows every round; a different workload is refused before anything runs.
    more = cmd[:cmd.index("--save-restore")]
    more[more.index("tsd,stock")] = "tsd"
    again = subprocess.run(more + ["--run-id", "last", "--prior", str(results)], capture_output=True, text=True,
                           timeout=300, cwd=ROOT)
    assert again.returncode == 0, again.stderr[-3000:]
    *_, cont = benchlib.read_results(str(results))
    assert (cont["run_id"], cont["order"], cont["repeat"], cont["status"]) == (ok["run_id"], 2, 1, "ok")
    # Without a profiled step, the window (third step to the drained end) gives a mean per step.
    assert cont["values"]["step_s_window"] > 0 and len(cont["values"]["step_s"]) == 3
    # The CPU run makes no "auto" decision: settled after its first step, its figures from the third.
    assert cont["values"]["settled_after"] == 1 and cont["values"]["first_settled_step"] == 3
    assert f"2 round(s); run {ok['run_id']}" in again.stdout
    other = subprocess.run(more + ["--run-id", ok["run_id"], "--batch", "4"], capture_output=True, text=True,
                           timeout=60, cwd=ROOT)
    assert other.returncode != 0 and "measured arch tiny, batch 2" in other.stderr and "batch 4" in other.stderr
    assert len(benchlib.read_results(str(results))) == 3


def test_peer_output_becomes_values_and_a_missing_package_a_skip():
    """The GPU path's parsing, on the lines peers.py and offload_peers.py print."""
    run = benchlib.ChildRun()
    run.stdout = 'loading\n@@{"mode": "ds_offload", "params": 10, "step_s_median": 1.08, "steps": [3.0, 1.1, 1.08], ' \
                 '"peak_gib": 21.4, "clip": 1.0, "grad_norms": [6.5, 6.4], "peak_rss_gib": 30.0}\n'
    run.rss_peak_bytes, run.device_baseline, run.device_peak = 2 << 30, 1 << 30, 25 << 30
    status, reason, values, raw = finetune_bench.outcome(run)
    assert (status, reason, raw["mode"]) == ("ok", None, "ds_offload")
    assert values["step_s_median"] == 1.08 and values["step_s"] == [3.0, 1.1, 1.08]
    assert values["vram_torch_peak_gib"] == 21.4 and values["vram_device_peak_gib"] == 24.0
    assert values["rss_peak_gib"] == 2.0 and values["grad_norms"] == [6.5, 6.4]
    gone = benchlib.ChildRun()
    gone.returncode, gone.stderr = 1, "Traceback ...\nModuleNotFoundError: No module named 'deepspeed'\n"
    assert finetune_bench.outcome(gone)[:2] == ("skipped", "deepspeed is not installed")
    broke = benchlib.ChildRun()
    broke.returncode, broke.stderr = 1, "Traceback ...\nRuntimeError: CUDA out of memory\n"
    assert finetune_bench.outcome(broke)[:2] == ("failed", "Traceback ...\nRuntimeError: CUDA out of memory")


def test_peers_get_the_same_workload_and_clipping():
    a = finetune_bench.parse_args(["--clip", "1.0", "--cap-gib", "32", "--batch", "4"])
    a.peers, a.offload_peers, a.socket = "/p/peers.py", "/p/offload_peers.py", "/s"
    stock = finetune_bench.child_argv("stock", a)
    assert stock[1:3] == ["/p/peers.py", "stock"] and stock[-4:] == ["--clip", "1.0", "--cap-gib", "32.0"]
    assert "--batch" in stock and stock[stock.index("--batch") + 1] == "4"
    ds = finetune_bench.child_argv("ds_offload", a)  # offload_peers.py has no --cap-gib: capped by the launcher
    assert ds[2:5] == ["--run-capped", "32.0", "/p/offload_peers.py"] and ds[-2:] == ["--clip", "1.0"]
    tsd = finetune_bench.child_argv("tsd_bf16_act", a)
    assert tsd[2:4] == ["--mode", "tsd_bf16_act"] and tsd[tsd.index("--clip") + 1] == "1.0"
    with pytest.raises(SystemExit):
        finetune_bench.parse_args(["--modes", "tsd,nonsense"])


def test_transcribed_runs_say_so():
    """The figures typed by hand before the pipeline are marked as such, with the page they came from."""
    records = benchlib.read_results_dir(RESULTS)
    stop7 = [r for r in records if r["run_id"].startswith("stop7-")]
    assert stop7
    for r in stop7:
        assert r["source"] == "transcribed from docs/benchmarks.md before the pipeline (stop 7)"
        assert r["transcribed_at"] and r["time_utc"] is None and r["commit"] is None
    assert all(r["source"] == "measured" for r in records if not r["run_id"].startswith("stop7-"))


def test_bars_show_each_modes_step_and_peak_of_one_run(tmp_path):
    records = [rec("r", 0, "a", 0.5, vram=10.0), rec("r", 1, "b", 1.0, vram=20.0), rec("r", 2, "a", 0.7, vram=10.0)]
    records[1]["values"]["vram_device_peak_gib"] = 22.0
    plots = []
    block = report.Block("t", "bars", {"benchmark": ["finetune"], "modes": ["a,b"], "img": ["x.png"]}, 1)
    text = report.render_bars(block, records, str(tmp_path), plots)
    assert "| `a` | 0.600 | 10.0 |" in text  # the median of its runs; torch's peak where no device peak
    assert "| `b` | 1.000 | 22.0 |" in text  # the whole-device peak by default
    assert plots[0].kind == "bars" and plots[0].series == {"a": [(0.6, 10.0)], "b": [(1.0, 22.0)]}
    torch_only = report.Block("t", "bars", {"benchmark": ["finetune"], "modes": ["a,b"], "img": ["x.png"],
                                           "vram": ["torch"]}, 1)
    assert "| `b` | 1.000 | 20.0 |" in report.render_bars(torch_only, records, str(tmp_path), [])
    with pytest.raises(report.ReportError, match="vram= is device or torch"):
        report.render_bars(report.Block("t", "bars", {"benchmark": ["finetune"], "img": ["x.png"], "vram": ["gpu"]}, 1),
                           records, str(tmp_path), [])


def test_tiny_cpu_stores_run_records_four_jobs_on_one_store(tmp_path):
    """bench/stores_bench.py on the CPU (a tiny Qwen2, its own tsd): four jobs load the base through
    one store, train alone and then together with equal losses, and the record holds what issue
    12's benchmark compares (tsd's bytes with one and four jobs, each load's seconds, each
    trainer's own PSS). The targets are for the 14B on the GPU machine, not checked here."""
    from conftest import tsd_binary

    results = tmp_path / "stores.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "stores_bench.py"), "--device", "cpu", "--tiny", "--seq", "16",
           "--steps", "1", "--pool", "2GiB", "--tsd-bin", tsd_binary(), "--workdir", str(tmp_path),
           "--results", str(results)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    ok = benchlib.read_results(str(results))[0]
    assert ok["benchmark"] == "stores" and ok["mode"] == "four_jobs_host_store" and ok["status"] == "ok", \
        out.stdout[-2000:] + out.stderr[-2000:]
    v = ok["values"]
    assert v["losses_equal"] == 1
    assert len(v["load_s"]) == 4 and all(x > 0 for x in v["load_s"])
    assert 0 < v["tsd_one_job_gib"] <= v["tsd_four_jobs_gib"]
    assert len(v["trainer_own_pss_gib"]) == 4 and all(x > 0 for x in v["trainer_own_pss_gib"])
    assert ok["workload"]["jobs"] == 4 and ok["workload"]["device"] == "cpu"


def test_mode_variants_set_the_entrys_settings():
    """A --modes entry's variants change only that entry's settings: :uncapped drops the cap,
    :alloc=expandable runs the child with torch's expandable segments (and the record says so)."""
    import finetune_bench as fb

    a = fb.parse_args(["--cap-gib", "4", "--device", "cpu"])
    name, s = fb.mode_settings("tsd_bf16m_act:uncapped:alloc=expandable", a)
    assert name == "tsd_bf16m_act" and s.cap_gib == 0 and s.alloc_conf == "expandable_segments:True"
    assert a.cap_gib == 4 and not hasattr(a, "alloc_conf")  # the run's own settings are untouched
    assert fb.workload("tsd_bf16m_act:alloc=expandable", a, {})["alloc_conf"] == "expandable_segments:True"
    assert "alloc_conf" not in fb.workload("tsd_bf16m_act", a, {})
    with pytest.raises(ValueError, match="alloc=expandable"):
        fb.mode_settings("tsd:alloc=bogus", a)
    # A budget sweep and both clippings in one run: each entry's record carries its own cap and clip.
    name, s = fb.mode_settings("tsd_bf16_act:cap=12.5:clip=1000", a)
    assert (name, s.cap_gib, s.clip) == ("tsd_bf16_act", 12.5, 1000.0) and (a.cap_gib, a.clip) == (4, 1.0)
    w = fb.workload("tsd_bf16_act:cap=12.5:clip=1000", a, {})
    assert (w["vram_cap_gib"], w["clip"]) == (12.5, 1000.0)
    argv = fb.child_argv("stock:cap=24:clip=0", a)
    assert argv[argv.index("--cap-gib") + 1] == "24.0" and "--clip" not in argv  # clip 0: the peers' flag off
    # :ckpt: gradient checkpointing for that entry alone (the child's --grad-ckpt, the record's grad_ckpt).
    name, s = fb.mode_settings("tsd_bf16_act:cap=12:ckpt", a)
    assert s.grad_ckpt and not a.grad_ckpt and "--grad-ckpt" in fb.child_argv("tsd_bf16_act:cap=12:ckpt", a)
    assert fb.workload("tsd_bf16_act:ckpt", a, {})["grad_ckpt"] and "grad_ckpt" not in fb.workload("tsd_bf16_act", a, {})
    assert "--grad-ckpt" not in fb.child_argv("tsd_bf16_act:cap=12", a)
    # :recompute=V: wrap(activation_recompute=V) for an *_act entry.
    name, s = fb.mode_settings("tsd_bf16_act:cap=12:recompute=auto", a)
    argv = fb.child_argv("tsd_bf16_act:cap=12:recompute=auto", a)
    assert s.activation_recompute == "auto" and argv[argv.index("--activation-recompute") + 1] == "auto"
    assert fb.workload("tsd_bf16_act:recompute=auto", a, {"activation_recompute": "auto"})["activation_recompute"] == "auto"
    assert "activation_recompute" not in fb.workload("tsd_bf16_act", a, {"activation_recompute": False})
    for bad, says in (("tsd:recompute=auto", r"the \*_act modes"), ("tsd_bf16_act:recompute=x", "could not convert"),
                      ("stock:ckpt", "peers' script"), ("ds_offload:ckpt", "peers' script"), ("tsd:ckpt=1", "unknown variant"),
                      ("tsd:cap=0", "not a VRAM budget"), ("tsd:cap=x", "needs a number"),
                      ("tsd:clip=-1", "finite number >= 0"), ("tsd:cap", "unknown variant")):
        with pytest.raises(ValueError, match=says):
            fb.mode_settings(bad, a)


def test_a_threads_variant_runs_against_a_tsd_of_its_own(tmp_path):
    """MODE:threads=N: the bench starts a second tsd with --optimizer-threads N for that entry, the
    other entry runs on the run's default tsd, and each record says how many threads served it."""
    from conftest import tsd_binary

    results = tmp_path / "finetune.jsonl"
    cmd = [sys.executable, os.path.join(ROOT, "bench", "finetune_bench.py"), "--device", "cpu", "--arch", "tiny",
           "--batch", "2", "--seq", "16", "--steps", "3", "--modes", "tsd,tsd:threads=1", "--tsd-bin", tsd_binary(),
           "--pool-size", "1GiB", "--daemon-args", "--optimizer-threads 3 --optimizer-nice 5",
           "--results", str(results), "--sample-interval", "0.05"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    records = {r["mode"]: r for r in benchlib.read_results(str(results))}
    assert records["tsd"]["status"] == "ok" and records["tsd:threads=1"]["status"] == "ok"
    assert records["tsd"]["workload"]["tsd_threads"] == 3  # --daemon-args' count
    assert records["tsd:threads=1"]["workload"]["tsd_threads"] == 1  # its own tsd's, replacing that flag
    assert records["tsd"]["values"]["tsd_pss_peak_gib"] > 0 and records["tsd:threads=1"]["values"]["tsd_pss_peak_gib"] > 0
    # The threads' time on the job's updates over the settled window, per step and thread, and the rest.
    v = records["tsd:threads=1"]["values"]
    assert 0 < v["tsd_busy_s"] < v["step_s_window"] and v["tsd_idle_s"] == pytest.approx(v["step_s_window"] - v["tsd_busy_s"])
    # Where no update was under way, from tsd's stamps of each update (tsd_timeline.py).
    g = records["tsd:threads=1"]["raw"]["tsd_gaps"]  # the whole breakdown is in the child's line
    assert g["updates"] > 0 and set(g["per_step_ms"]) == {"forward", "backward", "step", "drain"}
    assert 0 <= v["tsd_gap_ms"] == g["total_ms"] <= v["step_s_window"] * 1e3 + 0.1
    assert v["tsd_gap_forward_ms"] == g["per_step_ms"]["forward"]


def test_threads_variant_settings_and_refusals():
    import finetune_bench as fb
    import finetune_daemons

    a = fb.parse_args(["--device", "cpu"])
    assert fb.mode_settings("tsd_bf16_act:threads=14", a)[1].daemon_threads == 14
    assert not hasattr(fb.mode_settings("tsd_bf16_act", a)[1], "daemon_threads")
    for bad, says in (("stock:threads=4", "does not use tsd"), ("tsd:threads=0", "not a thread count"),
                      ("tsd:threads=x", "not a thread count"), ("tsd:threads=", "not a thread count")):
        with pytest.raises(ValueError, match=says):
            fb.mode_settings(bad, a)
    assert finetune_daemons.daemon_args("--optimizer-threads 16 --optimizer-nice 5", 14) == [
        "--optimizer-nice", "5", "--optimizer-threads", "14"]
    assert finetune_daemons.daemon_args("--optimizer-threads=16", 2) == ["--optimizer-threads", "2"]
    assert finetune_daemons.daemon_args("--optimizer-threads=16", None) == ["--optimizer-threads=16"]


def test_the_host_bound_is_the_trainer_before_wrap_plus_tsd_before_plus_what_check_memory_counted():
    run = benchlib.ChildRun()
    raw = {"step_s_median": 1.0, "host_pss_before_wrap_gib": 15.0, "check_memory_host_gib": 98.0}
    run.stdout = "@@" + json.dumps(raw)
    run.host_pss_peak = int(112.7 * 2**30)
    status, _, values, _ = finetune_bench.outcome(run, tsd_pss_before=2**30 // 4)
    assert status == "ok" and values["host_check_bound_gib"] == 15.0 + 0.25 + 98.0
    assert values["host_within_check"] == 1
    run.host_pss_peak = int(114 * 2**30)
    assert finetune_bench.outcome(run, tsd_pss_before=2**30 // 4)[2]["host_within_check"] == 0
    # Without tsd's baseline (a peer, or an old record) no bound is claimed.
    assert "host_check_bound_gib" not in finetune_bench.outcome(run)[2]


def test_a_tsd_modes_bound_is_its_host_bytes_at_stream_speed_or_stocks_forward_and_backward():
    """The bound finetune_bench prints, as columns: max(stock's forward + backward in the run (else
    the mode's own), host bytes per step / the run's STREAM bandwidth), and the step over it."""
    stream = rec("r", 0, "stream", None)
    stream["values"] = {"bandwidth_gbs": 100.0}
    tsd = rec("r", 1, "a", 0.55)
    tsd["values"].update(host_bytes_per_step=50e9, gpu_forward_ms=300.0, gpu_backward_ms=150.0)
    stock = rec("r", 2, "stock", 0.2)
    stock["values"].update(gpu_forward_ms=60.0, gpu_backward_ms=120.0)
    got = {r["mode"]: r["values"] for r in report.add_bounds([stream, tsd, stock])}
    assert got["a"]["host_s"] == pytest.approx(0.5) and got["a"]["bound_s"] == pytest.approx(0.5)
    assert got["a"]["step_over_bound"] == pytest.approx(1.1)
    assert "bound_s" not in got["stock"]  # a peer has no host bytes: no bound
    text = table(report.add_bounds([stream, tsd, stock]), modes=["a"], cols=["step,host_time,bound,of_bound"], ratio=[])
    assert row(text, "a") == "| `a` | 1 | 0.550 | 0.500 | 0.500 | 1.10 |"
    # Where stock's forward and backward are longer than the host's part, they are the bound; without
    # stock in the run, the mode's own forward and backward (which include waits for the host) are.
    stock["values"].update(gpu_forward_ms=300.0, gpu_backward_ms=400.0)
    assert report.add_bounds([stream, tsd, stock])[1]["values"]["bound_s"] == pytest.approx(0.7)
    assert report.add_bounds([stream, tsd])[1]["values"]["bound_s"] == pytest.approx(0.5)
    # Stock timed as a whole step only (peers.py): that step stands for its forward and backward.
    slow = rec("r", 2, "stock", 0.8)
    assert report.add_bounds([stream, tsd, slow])[1]["values"]["bound_s"] == pytest.approx(0.8)
    # A run without STREAM claims no bound.
    assert "bound_s" not in report.add_bounds([tsd])[0]["values"]
    # Measured twice (before and after the modes): the higher figure, the lower bound.
    again = rec("r", 3, "stream", None)
    again["values"] = {"bandwidth_gbs": 125.0}
    assert report.add_bounds([stream, tsd, again])[1]["values"]["host_s"] == pytest.approx(0.4)
    import stream as stream_mod
    best = stream_mod.best_of([stream["values"], None, again["values"]])
    assert best is not None and best["bandwidth_gbs"] == 125.0 and best["samples_gbs"] == [100.0, 125.0]
    assert stream_mod.best_of([None]) is None


def test_the_pcie_term_is_the_steps_copies_at_the_measured_bandwidths():
    """With the run's PCIe figures (pcie_bench), a record's copies each way, or both at once, give
    its PCIe time; the bound with that term is the longer of it and the bound without."""
    import finetune_bench as fb

    stream_rec = rec("r", 0, "stream", None)
    stream_rec["values"] = {"bandwidth_gbs": 100.0}
    link = rec("r", 1, "pcie", None)
    link["values"] = {"h2d_gbs": 50.0, "d2h_gbs": 50.0, "both_gbs": 80.0}
    tsd = rec("r", 2, "a", 0.9)
    tsd["values"].update(host_bytes_per_step=50e9, gpu_forward_ms=300.0, gpu_backward_ms=150.0,
                         pcie_h2d_bytes_per_step=40e9, pcie_d2h_bytes_per_step=24e9)
    v = report.add_bounds([stream_rec, link, tsd])[2]["values"]
    # 40 GB up at 50 GB/s: 0.8 s; 24 down: 0.48 s; 64 both ways at 80: 0.8 s.
    assert v["pcie_s"] == pytest.approx(0.8) and v["bound_s"] == pytest.approx(0.5)
    assert v["bound_pcie_s"] == pytest.approx(0.8) and v["step_over_bound_pcie"] == pytest.approx(0.9 / 0.8)
    link["values"]["both_gbs"] = 40.0  # the pair shares the link: 64 GB at 40 GB/s
    assert report.add_bounds([stream_rec, link, tsd])[2]["values"]["pcie_s"] == pytest.approx(1.6)
    assert "pcie_s" not in report.add_bounds([stream_rec, tsd])[1]["values"]  # no PCIe measured: no term
    printed = copy.deepcopy(tsd)
    printed["mode"] = "tsd_bf16_act"
    printed["values"]["host_bytes_per_param"] = 32
    line = fb.bound_lines([stream_rec, link, printed], stream_rec["values"], link["values"])[1]
    assert "PCIe 1.600 s, with it the bound is 1.600 s" in line, line
    # Where no update was under way (tsd_timeline.py), on a line of its own under the mode's.
    printed["values"].update(tsd_gap_ms=85.0, tsd_gap_forward_ms=30.0, tsd_gap_backward_ms=40.0,
                             tsd_gap_step_ms=10.0, tsd_gap_between_ms=5.0)
    lines = fb.bound_lines([stream_rec, link, printed], stream_rec["values"], link["values"])
    assert lines[2] == "    no update under way 85 ms/step: forward 30, backward 40, step 10, between 5", lines
    with pytest.raises(ValueError, match="h2d_gbs must be > 0"):
        stream.pcie_s(1.0, 1.0, {"h2d_gbs": 0, "d2h_gbs": 1, "both_gbs": 1})


def test_how_often_clipping_bit_comes_from_the_norms_and_the_limit():
    a = rec("r", 0, "a", 0.5)
    a["workload"]["clip"] = 1.0
    a["values"]["grad_norms"] = [6.9, 0.8, 1.0, 2.5]  # a norm equal to the limit does not clip
    b = rec("r", 1, "b", 0.6)  # no clipping: nothing claimed
    b["values"]["grad_norms"] = [6.9]
    got = report.add_clip_counts([a, b])
    assert got[0]["values"]["clip_bit_share"] == 0.5 and "clip_bit_share" not in got[1]["values"]
    assert "| 0.50 |" in row(table(got, modes=["a"], cols=["clip_bit"], ratio=[]), "a")


def test_a_run_is_settled_once_every_auto_decision_is_made():
    """finetune_child's figures start after tsd's last decision from measured steps: the weight
    plan settled, the activation profiler replaced by its decision, the GPU share chosen."""
    from types import SimpleNamespace

    import finetune_child
    from trainstream.paging.activations import ActivationProfiler

    profiler = ActivationProfiler.__new__(ActivationProfiler)  # only its type is read
    done = SimpleNamespace(planner=SimpleNamespace(done=True), act_pager=None, act_refine=None, auto_share=None)
    assert finetune_child.decisions_made(None) and finetune_child.decisions_made(done)
    assert finetune_child.decisions_made(SimpleNamespace(planner=None, act_pager=object(), auto_share=None))
    for pending in (dict(planner=SimpleNamespace(done=False)), dict(act_pager=profiler), dict(act_refine=object()),
                    dict(auto_share=object())):
        assert not finetune_child.decisions_made(SimpleNamespace(**{**vars(done), **pending})), pending


def test_a_mode_with_few_settled_steps_is_told_how_many_to_run():
    six = [0.5] * 6
    assert finetune_bench.few_settled([{"step_s": six, "first_settled_step": 3}]) == ""  # steps 3-6
    warn = finetune_bench.few_settled([{"step_s": six, "first_settled_step": 5}])
    assert "only 2 settled step(s)" in warn and "until step 4" in warn and "--steps 8" in warn
    assert finetune_bench.few_settled([{"step_s": six}]) == ""  # a record from before the field
