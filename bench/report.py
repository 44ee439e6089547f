"""The benchmark pipeline's reporting half: turns bench/results/*.jsonl (written through
bench/benchlib.py) into the tables and plots of docs/benchmarks.md, so no figure there is typed
by hand.

    python3 bench/report.py              rewrite the generated blocks of docs/benchmarks.md (and docs/img/*.png)
    python3 bench/report.py --check      exit 1, with a diff, if the docs differ from what the results give
    python3 bench/report.py --list       the runs in the results files

The docs keep hand-written prose; what is generated sits between markers (each at the start of
a line) that name a block and say what it shows:

    <!-- report:NAME kind=modes benchmark=finetune arch=qwen1.5b batch=8 ratio=step:fsdp2_offload -->
    ...generated, rewritten on every run...
    <!-- /report:NAME -->

Kinds (attributes; any attribute not listed is a filter on the records' workload, e.g. batch=8):
  modes   one row per mode of one run: `run=RUN_ID|latest` (default latest: the newest run that
          matches the filters and holds every mode of `modes=`), `modes=a,b,c` (rows, in order),
          `cols=step,vram,...` (aliases below or values' keys), `ratio=COL:REFMODE` (repeatable),
          `target=MODE:COL:REFMODE<=X` (repeatable), `howto="command"` (shown while no run matches),
          `header=short` (name the run without repeating its command, for a second table of it)
  runs    one row per matching run and mode, oldest first (a sweep over settings): `by=KEY,...`
          (workload keys shown beside the run), `modes=`, `cols=`
  raw     the benchmark's own output lines of one run (`run=`, filters)
  plot    step time against VRAM budget, one line per mode, from every matching run (the newest
          run for each mode and budget; `run=` restricts it to one): `img=NAME.png` (written to
          docs/img/), `modes=`, `title=`.
          The budget is the run's VRAM cap, or its measured peak where it ran uncapped.
  bars    step time and peak VRAM side by side, one bar per mode of one run (selected as `modes`
          selects it): `img=NAME.png`, `modes=`, `title=`, `vram=device|torch` (default device:
          the whole-device peak where the run measured it, else torch's).
  scaling tokens per second against the GPU count (the records' workload `gpus`), one line per
          mode, from one run: `run=RUN_ID` or, by default, the newest matching run that holds two
          or more GPU counts (a `dp_bench.py --scaling` run); `img=NAME.png`, `modes=`, `title=`.
          The table beside it gives each count's s/step, tokens/s, the speedup over the mode's
          fewest GPUs and the scaling efficiency (speedup / GPU ratio); skipped counts say why.

Medians and ratios: a mode's figure is the median over the runs of it in the selected run (a
benchmark's --repeats); a ratio is the ratio of two such medians. A ratio whose margin (its
distance from the target, or from 1 without one, relative to that) is under 10% counts only as
the median of at least 3 runs of each mode with the modes interleaved (A B A B A B); otherwise
it is printed as "not established".
"""
from __future__ import annotations

import argparse
import difflib
import json
import os
import re
import shlex
import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import benchlib  # noqa: E402
import stream  # noqa: E402

DOCS = os.path.join(benchlib.ROOT, "docs", "benchmarks.md")
MARGIN = 0.10
MIN_RUNS = 3

ALIASES = {"step": "step_s_median", "vram": "vram_torch_peak_gib", "vram_device": "vram_device_peak_gib",
           "host": "host_pss_peak_gib", "tsd": "tsd_used_gib", "tsd_peak": "tsd_used_peak_gib", "rss": "rss_peak_gib",
           "fwd": "gpu_forward_ms", "bwd": "gpu_backward_ms", "wait": "step_wait_ms", "paged": "paged_gib_per_step",
           "host_bound": "host_check_bound_gib", "host_ok": "host_within_check",
           "bound": "bound_s", "host_time": "host_s", "of_bound": "step_over_bound", "clip_bit": "clip_bit_share",
           "window": "step_s_window", "window_of_bound": "window_over_bound", "busy": "tsd_busy_s",
           "idle": "tsd_idle_s", "pcie": "pcie_s", "bound_pcie": "bound_pcie_s", "of_bound_pcie": "step_over_bound_pcie",
           "window_of_bound_pcie": "window_over_bound_pcie", "gap": "tsd_gap_ms", "gap_fwd": "tsd_gap_forward_ms",
           "gap_bwd": "tsd_gap_backward_ms", "gap_step": "tsd_gap_step_ms", "gap_between": "tsd_gap_between_ms"}
HEADERS = {"step_s_median": "s/step", "step_s_window": "s/step, window drained",
           "window_over_bound": "window x the bound", "vram_torch_peak_gib": "peak VRAM GiB (torch)",
           "vram_device_peak_gib": "peak VRAM GiB (device)", "host_pss_peak_gib": "host PSS GiB (trainer + tsd)",
           "tsd_used_gib": "tsd used GiB", "tsd_used_peak_gib": "tsd used GiB (peak)", "rss_peak_gib": "peak RSS GiB",
           "gpu_forward_ms": "GPU forward ms", "gpu_backward_ms": "GPU backward ms", "step_wait_ms": "step() waits ms",
           "paged_gib_per_step": "paged GiB/step", "gparam_per_s": "Gparam/s", "copy_gb_per_s": "copy GB/s",
           "triad_gb_per_s": "triad GB/s", "doorbell_p50_us": "doorbell p50 µs", "doorbell_p99_us": "doorbell p99 µs",
           "grpc_unary_p50_us": "gRPC unary p50 µs", "grpc_unary_p99_us": "gRPC unary p99 µs",
           "share_of_bound": "share of the bound", "bound_gparam_per_s": "bound Gparam/s", "note": "note",
           "save_s": "save s", "restore_s": "restore s", "saved_gib": "saved GiB", "unwrap_s": "unwrap() s",
           "resume_exact": "resumed bit-identically (1 = yes)", "save_rss_anon_growth_mib": "RssAnon growth, save MiB",
           "restore_rss_anon_growth_mib": "RssAnon growth, restore MiB",
           "host_check_bound_gib": "check_memory's host bound GiB", "host_within_check": "host peak within it (1 = yes)",
           "bound_s": "bound s", "host_s": "host s (bytes / STREAM)", "step_over_bound": "x the bound",
           "clip_bit_share": "share of steps clipping bit", "tokens_per_s": "tokens/s",
           "vram_device_steps_peak_gib": "peak VRAM GiB (device, steps)",
           "host_pss_steps_peak_gib": "host PSS GiB (steps)",
           "tsd_busy_s": "tsd threads busy s/step", "tsd_idle_s": "window less busy s/step",
           "pcie_s": "PCIe s (bytes / measured)", "bound_pcie_s": "bound with PCIe s",
           "step_over_bound_pcie": "x the bound with PCIe", "window_over_bound_pcie": "window x the bound with PCIe",
           "tsd_gap_ms": "no update under way ms/step", "tsd_gap_forward_ms": "of it in forward",
           "tsd_gap_backward_ms": "in backward", "tsd_gap_step_ms": "in step()", "tsd_gap_between_ms": "between steps"}
LABELS = {"tsd": "fp32 weights on the GPU, AdamW in tsd",
          "tsd_bf16": "bf16 weights on the GPU, fp32 masters and moments in tsd",
          "tsd_bf16m": "bf16 weights, bf16 moments in tsd",
          "tsd_bf16_act": "bf16 weights, fp32 moments, activation paging",
          "tsd_bf16m_act": "bf16 weights, bf16 moments, activation paging",
          "tsd_lora": "peft LoRA r=16 on a bf16 base, AdamW in tsd",
          "stock": "stock fused AdamW in VRAM", "fsdp2_offload": "FSDP2 + CPUOffloadPolicy",
          "lora_stock": "stock peft LoRA r=16", "ds_offload": "DeepSpeed ZeRO-2, offload_optimizer=cpu",
          "torchao_offload": "torchao CPUOffloadOptimizer"}
DEFAULT_COLS = "step,vram,vram_device,host,tsd"
KNOWN_ATTRS = {"kind", "benchmark", "run", "modes", "cols", "ratio", "target", "howto", "img", "title", "by", "header", "vram"}
BLOCK = re.compile(r"^<!-- report:(?P<name>[A-Za-z0-9_.-]+)(?P<attrs>[^\n]*?)-->\n(?P<body>.*?)<!-- /report:(?P=name) -->",
                   re.S | re.M)
OPEN = re.compile(r"^<!-- report:([A-Za-z0-9_.-]+)", re.M)
KINDS = ("modes", "runs", "raw", "plot", "bars", "scaling")
# MODE and REFMODE may name variants (MODE:uncapped, tsd_bf16_act:gpu=0.15); COL is a plain name.
TARGET = re.compile(r"^(.+?):([a-z_0-9]+):(.+?)(<=|>=)([0-9.]+)$")


class ReportError(ValueError):
    """A marker or a results file that cannot be turned into a report; says what to fix."""


@dataclass
class Block:
    """One generated block of the docs: its name, its attributes (lists for repeated ones) and its line."""

    name: str
    kind: str
    attrs: dict[str, list[str]]
    line: int

    def get(self, key: str, default: Optional[str] = None) -> Optional[str]:
        v = self.attrs.get(key)
        return v[-1] if v else default

    def filters(self) -> dict[str, str]:
        return {k: v[-1] for k, v in self.attrs.items() if k not in KNOWN_ATTRS}

    def where(self) -> str:
        return f"docs block {self.name!r} (line {self.line})"


@dataclass
class Plot:
    """A plot to write: where, its title, and for each mode its (budget GiB, s/step) points
    (`kind` "lines"), its one (s/step, peak VRAM GiB) pair (`kind` "bars"), or its (GPUs,
    tokens/s) points (`kind` "scaling")."""

    path: str
    title: str
    series: dict[str, list[tuple[float, float]]] = field(default_factory=dict)
    kind: str = "lines"


def parse_attrs(name: str, text: str, line: int) -> Block:
    try:
        words = shlex.split(text)
    except ValueError as e:
        raise ReportError(f"docs block {name!r} (line {line}): cannot read its attributes: {e}") from None
    attrs: dict[str, list[str]] = {}
    for w in words:
        k, eq, v = w.partition("=")
        if not eq or not k:
            raise ReportError(f"docs block {name!r} (line {line}): {w!r} is not KEY=VALUE")
        attrs.setdefault(k, []).append(v)
    kind = attrs.get("kind", [""])[-1]
    if kind not in KINDS:
        raise ReportError(f"docs block {name!r} (line {line}): kind={kind!r}; use one of {', '.join(KINDS)}")
    if "benchmark" not in attrs:
        raise ReportError(f"docs block {name!r} (line {line}): name the benchmark (benchmark=finetune)")
    return Block(name, kind, attrs, line)


def col_key(c: str) -> str:
    return ALIASES.get(c, c)


FORMATS = {"tsd_busy_s": "{:.3f}", "tsd_idle_s": "{:.3f}", "pcie_s": "{:.3f}", "bound_pcie_s": "{:.3f}",
           "step_over_bound_pcie": "{:.2f}", "window_over_bound_pcie": "{:.2f}", "tokens_per_s": "{:.0f}", "gparam_per_s": "{:.2f}", "bound_gparam_per_s": "{:.2f}", "share_of_bound": "{:.2f}", "step_over_bound": "{:.2f}", "window_over_bound": "{:.2f}", "step_s_window": "{:.3f}", "clip_bit_share": "{:.2f}",
           "paged_gib_per_step": "{:.2f}"}
SUFFIX_FORMATS = (("_gib", "{:.1f}"), ("_mib", "{:.1f}"), ("gb_per_s", "{:.1f}"), ("_ms", "{:.0f}"), ("_s_median", "{:.3f}"),
                  ("_s", "{:.3f}"), ("_us", "{:.3g}"))


def fmt_value(key: str, v: Any) -> str:
    """A figure as the tables print it: the precision follows the key's unit."""
    if v is None:
        return "—"
    fmt = FORMATS.get(key) or next((f for suffix, f in SUFFIX_FORMATS if key.endswith(suffix)), None)
    if fmt is not None:
        return fmt.format(v)
    return f"{v:.4g}" if isinstance(v, float) else str(v)


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def matches(rec: dict[str, Any], benchmark: str, filters: dict[str, str]) -> bool:
    if rec["benchmark"] != benchmark:
        return False
    for k, want in filters.items():
        if k not in rec["workload"]:
            return False
        have = rec["workload"][k]
        try:
            if float(want) != float(have):
                return False
        except (TypeError, ValueError):
            if str(have) != want:
                return False
    return True


def run_key(recs: Any) -> tuple[str, str]:
    """Orders runs by time (transcribed runs, without a time, first), then by id."""
    return (max((r.get("time_utc") or "") for r in recs), recs[0]["run_id"])


def select_run(block: Block, records: list[dict[str, Any]], modes: list[str],
               eligible: Optional[Callable[[list[dict[str, Any]]], bool]] = None) -> list[dict[str, Any]]:
    """The records of the run the block shows (empty if none matches): `run=`, else the newest
    matching run that holds every mode of `modes` (and that `eligible` accepts, when given)."""
    bench = block.get("benchmark") or ""
    cand = [r for r in records if matches(r, bench, block.filters())]
    run = block.get("run", "latest")
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in cand:
        by_run.setdefault(r["run_id"], []).append(r)
    if run != "latest":
        return sorted(by_run.get(run or "", []), key=lambda r: r["order"])
    runs = [rs for rs in by_run.values() if (not modes or set(modes) <= {r["mode"] for r in rs})
            and (eligible is None or eligible(rs))]
    if not runs:
        return []
    return sorted(max(runs, key=run_key), key=lambda r: r["order"])


def mode_median(recs: list[dict[str, Any]], key: str) -> Optional[float]:
    xs = [r["values"][key] for r in recs if r["status"] == "ok" and isinstance(r["values"].get(key), (int, float))]
    return benchlib.median(xs) if xs else None


def interleaved(a: list[dict[str, Any]], b: list[dict[str, Any]]) -> bool:
    """Whether the runs of two modes alternate (A B A B ...) within one invocation."""
    if not a or not b or len({r["run_id"] for r in a + b}) != 1:
        return False
    seq = [r["mode"] for r in sorted(a + b, key=lambda r: r["order"])]
    return all(x != y for x, y in zip(seq, seq[1:]))


@dataclass
class Ratio:
    """A ratio of two modes' medians and whether it stands (see the module's doc)."""

    value: float
    threshold: float
    runs: tuple[int, int]
    interleaved: bool

    @property
    def margin(self) -> float:
        return abs(self.value - self.threshold) / self.threshold

    @property
    def established(self) -> bool:
        return self.margin >= MARGIN or (min(self.runs) >= MIN_RUNS and self.interleaved)

    def why_not(self) -> str:
        return (f"margin {self.margin:.0%} from {self.threshold:g} with {self.runs[0]} and {self.runs[1]} "
                f"run{'s' if self.runs[1] != 1 else ''}{'' if self.interleaved else ', not interleaved'}")


def ratio(run: list[dict[str, Any]], mode: str, ref: str, key: str, threshold: float = 1.0) -> Optional[Ratio]:
    a = [r for r in run if r["mode"] == mode and r["status"] == "ok"]
    b = [r for r in run if r["mode"] == ref and r["status"] == "ok"]
    x, y = mode_median(a, key), mode_median(b, key)
    if x is None or y is None or y == 0:
        return None
    n = (sum(key in r["values"] for r in a), sum(key in r["values"] for r in b))
    return Ratio(x / y, threshold, n, interleaved(a, b))


def parse_targets(block: Block) -> dict[tuple[str, str, str], tuple[str, float]]:
    out = {}
    for t in block.attrs.get("target", []):
        m = TARGET.match(t)
        if not m:
            raise ReportError(f"{block.where()}: target {t!r}: write MODE:COL:REFMODE<=X (or >=)")
        out[(m.group(1), col_key(m.group(2)), m.group(3))] = (m.group(4), float(m.group(5)))
    return out


def run_header(run: list[dict[str, Any]]) -> str:
    r = run[0]
    host = r["host"]
    where = ", ".join(x for x in (host.get("gpu") or "no GPU", f"{host['cpus']} CPUs" if host.get("cpus") else "") if x)
    bits = [f"Run `{r['run_id']}`"]
    if r["source"] != "measured":
        bits.append(r["source"])
    bits.append(where)
    if r.get("commit"):
        bits.append(f"commit `{r['commit'][:10]}`{' (with local changes)' if r.get('dirty') else ''}")
    if r.get("time_utc"):
        bits.append(r["time_utc"])
    return "; ".join(bits) + ". Command:\n\n    " + r["command"] + "\n"


def label(mode: str) -> str:
    return f"`{mode}` ({LABELS[mode]})" if mode in LABELS else f"`{mode}`"


def empty(block: Block, note: str = "") -> str:
    """What a block without matching records shows: that there are none (`note` says what more
    is missing), and the `howto=` command that produces them."""
    howto = block.get("howto")
    text = "_No results recorded for this workload yet" + (f": {note}" if note else "") + "._"
    return text + (f" Produce them with:\n\n    {howto}\n" if howto else "\n")


def render_modes(block: Block, records: list[dict[str, Any]]) -> str:
    want = [m for m in (block.get("modes") or "").split(",") if m]
    run = select_run(block, records, want)
    if not run:
        return empty(block)
    modes = want or list(dict.fromkeys(r["mode"] for r in run))
    cols = [col_key(c) for c in (block.get("cols") or DEFAULT_COLS).split(",") if c]
    ratios = []
    for spec in block.attrs.get("ratio", []):
        key, _, ref = spec.partition(":")
        if not ref:
            raise ReportError(f"{block.where()}: ratio {spec!r}: write COL:REFMODE, e.g. step:fsdp2_offload")
        ratios.append((col_key(key), ref))
    targets = parse_targets(block)
    head = ["mode", "runs"] + [HEADERS.get(c, c) for c in cols] + [
        f"x `{ref}` {HEADERS.get(k, k)}" for k, ref in ratios]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    notes = []
    shaky = False
    for mode in modes:
        recs = [r for r in run if r["mode"] == mode]
        ok = [r for r in recs if r["status"] == "ok"]
        if not ok:
            why = recs[0] if recs else None
            text = f"{why['status']}: {why.get('reason', '')}" if why else "not in this run"
            text = text.strip().splitlines()[-1] if text.strip() else text
            lines.append("| " + " | ".join([label(mode), "0", cell(text)] + [""] * (len(head) - 3)) + " |")
            continue
        row = [label(mode), str(len(ok))]
        for c in cols:
            if c == "note":
                row.append(cell("; ".join(dict.fromkeys(r["note"] for r in ok if r.get("note")))) or "")
            else:
                row.append(fmt_value(c, mode_median(ok, c)))
        for key, ref in ratios:
            if ref == mode:
                row.append("1.00")
                continue
            t = targets.get((mode, key, ref))
            r = ratio(run, mode, ref, key, t[1] if t else 1.0)
            if r is None:
                row.append("—")
            elif r.established:
                row.append(f"{r.value:.2f}")
            else:
                shaky = True
                row.append(f"{r.value:.2f} (not established)")
        lines.append("| " + " | ".join(row) + " |")
    if shaky:
        notes.append(f"_not established_: within {MARGIN:.0%} of 1 (or of its target) with fewer than {MIN_RUNS} runs "
                     f"of each mode, interleaved; it needs the median of at least {MIN_RUNS} interleaved runs "
                     f"(`--repeats {MIN_RUNS}`).")
    for (mode, key, ref), (op, x) in targets.items():
        r = ratio(run, mode, ref, key, x)
        what = f"`{mode}` {HEADERS.get(key, key)} {'≤' if op == '<=' else '≥'} {x:g}x `{ref}`'s"
        if r is None:
            notes.append(f"Target {what}: no figure (a mode did not run).")
            continue
        met = r.value <= x if op == "<=" else r.value >= x
        if not r.established:
            verdict = f"not established ({r.why_not()})"
        else:
            verdict = f"{'met' if met else 'not met'} (margin {r.margin:.0%}, {r.runs[0]} and {r.runs[1]} runs)"
        notes.append(f"Target {what}: {r.value:.2f}, {verdict}.")
    head_text = f"Run `{run[0]['run_id']}` (above).\n" if block.get("header") == "short" else run_header(run)
    out = head_text + "\n" + "\n".join(lines) + "\n"
    if notes:
        out += "\n" + "\n".join(f"- {n}" for n in notes) + "\n"
    return out


def render_runs(block: Block, records: list[dict[str, Any]]) -> str:
    """One row per matching run and mode (a sweep over settings: `by=` names the workload keys
    that differ between the runs); oldest run first."""
    bench = block.get("benchmark") or ""
    want = [m for m in (block.get("modes") or "").split(",") if m]
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        if matches(r, bench, block.filters()) and (not want or r["mode"] in want):
            by_run.setdefault(r["run_id"], []).append(r)
    if not by_run:
        return empty(block)
    by = [k for k in (block.get("by") or "").split(",") if k]
    cols = [col_key(c) for c in (block.get("cols") or DEFAULT_COLS).split(",") if c]
    head = ["run", "mode"] + by + ["runs"] + [HEADERS.get(c, c) for c in cols]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    commands = []
    for recs in sorted(by_run.values(), key=run_key):
        commands.append(f"- `{recs[0]['run_id']}`: `{recs[0]['command']}`")
        for mode in dict.fromkeys(r["mode"] for r in sorted(recs, key=lambda r: r["order"])):
            ok = [r for r in recs if r["mode"] == mode and r["status"] == "ok"]
            first = next(r for r in recs if r["mode"] == mode)
            row = [f"`{first['run_id']}`", f"`{mode}`"] + [
                cell(str(first["workload"].get(k, "—")) or "(none)") for k in by] + [str(len(ok))]
            for c in cols:
                if c == "note":
                    row.append(cell("; ".join(dict.fromkeys(r["note"] for r in ok if r.get("note")))))
                else:
                    row.append(fmt_value(c, mode_median(ok, c)))
            lines.append("| " + " | ".join(row) + " |")
    src = {r["source"] for rs in by_run.values() for r in rs}
    out = "\n".join(lines) + "\n\nCommands" + (f" ({'; '.join(sorted(src - {'measured'}))})" if src - {"measured"} else "")
    return out + ":\n\n" + "\n".join(commands) + "\n"


def render_raw(block: Block, records: list[dict[str, Any]]) -> str:
    run = select_run(block, records, [])
    if not run:
        return empty(block)
    rows = [json.dumps(r["raw"]) for r in run if "raw" in r]
    return "```\n" + "\n".join(rows) + "\n```\n"


def series_name(mode: str) -> str:
    """The line a --modes entry belongs to in a plot of step time against budget: the entry
    without its budget variants (:cap=G, :uncapped), so that tsd_bf16_act:cap=8 and
    tsd_bf16_act:cap=16 are two points of one line, tsd_bf16_act's."""
    name, *variants = mode.split(":")
    return ":".join([name, *(v for v in variants if v != "uncapped" and not v.startswith("cap="))])


def plot_points(block: Block, records: list[dict[str, Any]]) -> dict[str, list[tuple[float, float, str]]]:
    """For each line (`series_name`), its (budget GiB, s/step, run id) points: the newest run of
    each budget. The block's modes= names lines (or entries); its run= one run or several,
    comma-separated (default: every run)."""
    bench = block.get("benchmark") or ""
    want = [m for m in (block.get("modes") or "").split(",") if m]
    groups: dict[tuple[str, float], dict[str, list[dict[str, Any]]]] = {}
    runs = [x for x in (block.get("run") or "").split(",") if x]  # a plot may draw from several runs
    for r in records:
        line = series_name(r["mode"])
        if r["status"] == "ok" and matches(r, bench, block.filters()) and (
                not want or line in want or r["mode"] in want) and (not runs or r["run_id"] in runs):
            cap = float(r["workload"].get("vram_cap_gib") or 0.0)
            groups.setdefault((line, cap), {}).setdefault(r["run_id"], []).append(r)
    out: dict[str, list[tuple[float, float, str]]] = {}
    for (mode, cap), runs in sorted(groups.items()):
        recs = max(runs.values(), key=run_key)
        y = mode_median(recs, "step_s_median")
        x = cap or mode_median(recs, "vram_device_peak_gib") or mode_median(recs, "vram_torch_peak_gib")
        if x is not None and y is not None:
            out.setdefault(mode, []).append((x, y, recs[0]["run_id"]))
    order = want or sorted(out)
    return {m: sorted(out[m]) for m in order if m in out}


def block_image(block: Block) -> str:
    """The block's img= (a PNG's file name in docs/img); a clear error without a valid one."""
    img = block.get("img")
    if not img or not re.fullmatch(r"[A-Za-z0-9_.-]+\.png", img):
        raise ReportError(f"{block.where()}: give img=NAME.png (letters, digits, '_', '-', '.')")
    return img


def render_plot(block: Block, records: list[dict[str, Any]], img_dir: str, plots: list[Plot]) -> str:
    img = block_image(block)
    points = plot_points(block, records)
    if not points:
        return empty(block)
    title = block.get("title") or block.name
    plots.append(Plot(os.path.join(img_dir, img), title, {m: [(x, y) for x, y, _ in p] for m, p in points.items()}))
    rel = os.path.basename(img_dir) + "/" + img
    lines = [f"![{title}]({rel})", "", "| mode | VRAM budget GiB | s/step | run |", "|---|---|---|---|"]
    for mode, pts in points.items():
        for x, y, run in pts:
            lines.append(f"| `{mode}` | {x:.1f} | {y:.3f} | `{run}` |")
    return "\n".join(lines) + "\n"


def render_bars(block: Block, records: list[dict[str, Any]], img_dir: str, plots: list[Plot]) -> str:
    img = block_image(block)
    which = block.get("vram", "device")
    if which not in ("device", "torch"):
        raise ReportError(f"{block.where()}: vram= is device or torch, not {which!r}")
    modes = [m for m in (block.get("modes") or "").split(",") if m]
    run = select_run(block, records, modes)
    if not run:
        return empty(block)
    series: dict[str, list[tuple[float, float]]] = {}
    rows = []
    for mode in modes or list(dict.fromkeys(r["mode"] for r in run)):
        recs = [r for r in run if r["mode"] == mode]
        step = mode_median(recs, "step_s_median")
        vram = (mode_median(recs, "vram_device_peak_gib") if which == "device" else None) \
            or mode_median(recs, "vram_torch_peak_gib")
        if step is None or vram is None:
            continue
        series[mode] = [(step, vram)]
        rows.append(f"| `{mode}` | {step:.3f} | {vram:.1f} |")
    if not series:
        return empty(block)
    title = block.get("title") or block.name
    plots.append(Plot(os.path.join(img_dir, img), title, series, kind="bars"))
    rel = os.path.basename(img_dir) + "/" + img
    head = "peak VRAM GiB (device)" if which == "device" else "peak VRAM GiB (torch)"
    return "\n".join([f"![{title}]({rel})", "", f"Run `{run[0]['run_id']}`.", "", f"| mode | s/step | {head} |",
                      "|---|---|---|", *rows]) + "\n"


def gpu_count(rec: dict[str, Any]) -> Optional[int]:
    """The GPUs a record's run used (its workload's `gpus`), or None where it does not say."""
    n = rec["workload"].get("gpus")
    return int(n) if isinstance(n, (int, float)) and not isinstance(n, bool) else None


def scaling_run(block: Block, records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The records a scaling block shows: those of `run=`, else of the newest matching run that
    holds two or more GPU counts (a single-count run of the same workload is not a scaling run)."""
    want = [m for m in (block.get("modes") or "").split(",") if m]
    shown = [r for r in records if (not want or r["mode"] in want) and gpu_count(r) is not None]
    return select_run(block, shown, [], eligible=lambda rs: len({gpu_count(r) for r in rs}) >= 2)


def render_scaling(block: Block, records: list[dict[str, Any]], img_dir: str, plots: list[Plot]) -> str:
    img = block_image(block)
    run = scaling_run(block, records)
    if not run:
        return empty(block, "no run at two or more GPU counts, so no plot")
    want = [m for m in (block.get("modes") or "").split(",") if m]
    counts = sorted({n for r in run if (n := gpu_count(r)) is not None})
    head = ["mode", "GPUs", "runs", "s/step", "tokens/s", "x its fewest GPUs' tokens/s", "scaling efficiency"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    series: dict[str, list[tuple[float, float]]] = {}
    for mode in want or list(dict.fromkeys(r["mode"] for r in run)):
        base: Optional[tuple[int, float]] = None
        for n in counts:
            recs = [r for r in run if r["mode"] == mode and gpu_count(r) == n]
            ok = [r for r in recs if r["status"] == "ok"]
            if not recs:
                continue
            tps, step = mode_median(ok, "tokens_per_s"), mode_median(ok, "step_s_median")
            if tps is None or step is None:
                why = next((r for r in recs if r["status"] != "ok"), recs[0])
                text = f"{why['status']}: {why.get('reason', '')}".strip().splitlines()[-1]
                lines.append("| " + " | ".join([f"`{mode}`", str(n), "0", cell(text), "", "", ""]) + " |")
                continue
            base = base or (n, tps)
            speedup = tps / base[1]
            series.setdefault(mode, []).append((float(n), tps))
            lines.append("| " + " | ".join([f"`{mode}`", str(n), str(len(ok)), fmt_value("step_s_median", step),
                                            fmt_value("tokens_per_s", tps), f"{speedup:.2f}",
                                            f"{speedup / (n / base[0]):.2f}"]) + " |")
    out = run_header(run) + "\n"
    if series:
        title = block.get("title") or block.name
        plots.append(Plot(os.path.join(img_dir, img), title, series, kind="scaling"))
        out += f"![{title}]({os.path.basename(img_dir)}/{img})\n\n"
    return out + "\n".join(lines) + "\n"


def add_bounds(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `records` in which each record of a run that measured STREAM (the highest
    `bandwidth_gbs` of its `stream` records: stream.best_of) and carries host bytes per step also
    carries its bound, as finetune_bench
    prints it: `host_s` (host bytes per step / STREAM), `bound_s` (the longer of that and the GPU's
    forward + backward: the median of stock's in the same run where it ran (its whole step where
    only that was timed), else the record's own)
    and `step_over_bound` (its step / the bound; `window_over_bound` for the drained window). Where
    the run also measured PCIe (its `pcie` record) and the record carries its PCIe bytes, it carries
    `pcie_s` (those copies at the measured bandwidths), `bound_pcie_s` (the bound with that term)
    and `step_over_bound_pcie` / `window_over_bound_pcie`."""
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_run.setdefault(r["run_id"], []).append(r)
    per_run: dict[str, tuple[Optional[float], Optional[float]]] = {}  # run -> (STREAM GB/s, stock's GPU part)
    links: dict[str, dict[str, Any]] = {}  # run -> its PCIe figures
    for run_id, run in by_run.items():
        ok = [x for x in run if x["status"] == "ok"]
        best = stream.best_of([x["values"] for x in ok if x["mode"] == "stream" and x["values"].get("bandwidth_gbs")])
        bw = best["bandwidth_gbs"] if best else None
        per_run[run_id] = (bw, stream.stock_gpu_s([x["values"] for x in ok if x["mode"] == "stock"]))
        link = next((x["values"] for x in ok if x["mode"] == "pcie"), None)
        if link:
            links[run_id] = link
    out = []
    for r in records:
        bw, stock_s = per_run[r["run_id"]]
        v = r["values"]
        if not bw or r["status"] != "ok" or not isinstance(v.get("host_bytes_per_step"), (int, float)):
            out.append(r)
            continue
        own = (v.get("gpu_forward_ms", 0.0) + v.get("gpu_backward_ms", 0.0)) / 1e3
        host_s = stream.host_s(v["host_bytes_per_step"], float(bw))
        bound = max(stock_s if stock_s is not None else own, host_s)
        extra = {"host_s": host_s, "bound_s": bound}
        if bound > 0 and isinstance(v.get("step_s_median"), (int, float)):
            extra["step_over_bound"] = v["step_s_median"] / bound
        if bound > 0 and isinstance(v.get("step_s_window"), (int, float)):
            extra["window_over_bound"] = v["step_s_window"] / bound
        link = links.get(r["run_id"])
        if link and isinstance(v.get("pcie_h2d_bytes_per_step"), (int, float)):
            pcie = stream.pcie_s(v["pcie_h2d_bytes_per_step"], v.get("pcie_d2h_bytes_per_step", 0.0), link)
            extra.update(pcie_s=pcie, bound_pcie_s=max(bound, pcie))
            for key, over in (("step_s_median", "step_over_bound_pcie"), ("step_s_window", "window_over_bound_pcie")):
                if isinstance(v.get(key), (int, float)) and extra["bound_pcie_s"] > 0:
                    extra[over] = v[key] / extra["bound_pcie_s"]
        out.append({**r, "values": {**v, **extra}})
    return out


def add_clip_counts(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Copies of `records` in which each record with `grad_norms` (a norm per step, before
    clipping) and a clipping limit (`workload.clip`) also carries `clip_bit_share`: the share of
    its steps whose norm was above the limit, so that clipping scaled their gradients."""
    out = []
    for r in records:
        norms, clip = r["values"].get("grad_norms"), r["workload"].get("clip")
        if isinstance(norms, list) and isinstance(clip, (int, float)) and clip > 0:
            bit = sum(1 for n in norms if isinstance(n, (int, float)) and n > clip)
            r = {**r, "values": {**r["values"], "clip_bit_share": bit / len(norms) if norms else 0.0}}
        out.append(r)
    return out


def generate(doc: str, records: list[dict[str, Any]], img_dir: str) -> tuple[str, list[Plot]]:
    """The docs with every generated block rewritten from `records`, and the plots they show."""
    records = add_clip_counts(add_bounds(records))
    plots: list[Plot] = []
    found = {m.group("name") for m in BLOCK.finditer(doc)}
    for m in OPEN.finditer(doc):
        if m.group(1) not in found:
            raise ReportError(f"docs block {m.group(1)!r} (line {doc.count(chr(10), 0, m.start()) + 1}) has no "
                              f"closing <!-- /report:{m.group(1)} --> marker")
    names: set[str] = set()

    def sub(m: re.Match[str]) -> str:
        line = doc.count("\n", 0, m.start()) + 1
        block = parse_attrs(m.group("name"), m.group("attrs"), line)
        if block.name in names:
            raise ReportError(f"{block.where()}: another block has this name; names must be unique")
        names.add(block.name)
        if block.kind == "modes":
            body = render_modes(block, records)
        elif block.kind == "runs":
            body = render_runs(block, records)
        elif block.kind == "raw":
            body = render_raw(block, records)
        elif block.kind == "bars":
            body = render_bars(block, records, img_dir, plots)
        elif block.kind == "scaling":
            body = render_scaling(block, records, img_dir, plots)
        else:
            body = render_plot(block, records, img_dir, plots)
        return f"<!-- report:{block.name}{m.group('attrs')}-->\n{body}<!-- /report:{block.name} -->"

    return BLOCK.sub(sub, doc), plots


def write_plot(plot: Plot) -> None:
    """Draws one plot as a PNG with matplotlib's Agg backend (no date in the file: reruns give the same bytes)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if plot.kind == "bars":
        write_bars(plot, plt)
        return
    if plot.kind == "scaling":
        write_scaling(plot, plt)
        return
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    for mode, pts in plot.series.items():
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=mode)
    finish_lines(fig, ax, plot, plt, "VRAM budget GiB (the cap, or the measured peak where uncapped)", "s/step (median)")


def finish_lines(fig: Any, ax: Any, plot: Plot, plt: Any, xlabel: str, ylabel: str) -> None:
    """A line plot's labels, title, axes from 0, grid and legend; then writes it (save_figure)."""
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.set_title(plot.title, fontsize=10)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, plot.path, plt)


def save_figure(fig: Any, path: str, plt: Any) -> None:
    """Lays `fig` out and writes it to `path` as a PNG without a software tag (the same bytes
    every time), then closes it."""
    fig.tight_layout()
    os.makedirs(os.path.dirname(path), exist_ok=True)
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)


def write_bars(plot: Plot, plt: Any) -> None:
    """Two bar charts side by side: each mode's s/step and its peak VRAM."""
    modes = list(plot.series)
    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.8), dpi=100)
    for ax, k, name in ((left, 0, "s/step (median)"), (right, 1, "peak VRAM GiB")):
        vals = [plot.series[m][0][k] for m in modes]
        bars = ax.bar(range(len(modes)), vals, color=["C0" if m.startswith("tsd") else "C7" for m in modes])
        ax.set_xticks(range(len(modes)))
        ax.set_xticklabels(modes, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel(name)
        ax.set_ylim(bottom=0)
        ax.grid(True, axis="y", alpha=0.3)
        for b, v in zip(bars, vals):
            ax.annotate(f"{v:.2f}" if k == 0 else f"{v:.1f}", (b.get_x() + b.get_width() / 2, v), ha="center",
                        va="bottom", fontsize=7)
    fig.suptitle(plot.title, fontsize=10)
    save_figure(fig, plot.path, plt)


def write_scaling(plot: Plot, plt: Any) -> None:
    """Tokens per second against the GPU count, one line per mode, each with a dotted line of
    linear scaling from its fewest GPUs."""
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=100)
    counts: set[float] = set()
    for k, (mode, pts) in enumerate(plot.series.items()):
        color = f"C{k % 10}"
        xs, ys = [p[0] for p in pts], [p[1] for p in pts]
        counts.update(xs)
        ax.plot(xs, ys, marker="o", color=color, label=mode)
        if len(pts) > 1:
            ax.plot(xs, [ys[0] * x / xs[0] for x in xs], linestyle=":", color=color, alpha=0.6)
    ax.set_xticks(sorted(counts))
    finish_lines(fig, ax, plot, plt, "GPUs (one rank each); dotted: linear scaling", "tokens/s (median step)")


def list_runs(records: list[dict[str, Any]]) -> str:
    by_run: dict[str, list[dict[str, Any]]] = {}
    for r in records:
        by_run.setdefault(r["run_id"], []).append(r)
    lines = []
    for rs in sorted(by_run.values(), key=run_key):
        w = rs[0]["workload"]
        modes = ",".join(dict.fromkeys(r["mode"] for r in rs))
        desc = " ".join(f"{k}={w[k]}" for k in ("arch", "batch", "seq", "clip", "vram_cap_gib", "params") if k in w)
        lines.append(f"{rs[0]['run_id']}  {rs[0]['benchmark']}  {len(rs)} records  {desc}  modes={modes}")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--results", default=benchlib.RESULTS_DIR, help="folder of *.jsonl results (default bench/results)")
    ap.add_argument("--docs", default=DOCS, help="the markdown file to rewrite (default docs/benchmarks.md)")
    ap.add_argument("--img-dir", default=None, help="where plots go (default: img/ beside the docs)")
    ap.add_argument("--check", action="store_true", help="change nothing; exit 1 with a diff if the docs are stale")
    ap.add_argument("--no-plots", action="store_true", help="rewrite the markdown only")
    ap.add_argument("--list", action="store_true", help="list the runs in the results and exit")
    a = ap.parse_args(argv)
    try:
        records = benchlib.read_results_dir(a.results)
        if a.list:
            print(list_runs(records))
            return 0
        with open(a.docs) as f:
            doc = f.read()
        img_dir = a.img_dir or os.path.join(os.path.dirname(os.path.abspath(a.docs)), "img")
        new, plots = generate(doc, records, img_dir)
    except (ReportError, benchlib.RecordError, OSError) as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    if a.check:
        stale = new != doc
        if stale:
            sys.stdout.writelines(difflib.unified_diff(doc.splitlines(True), new.splitlines(True), a.docs,
                                                       a.docs + " (from the results)"))
            print(f"report.py: {a.docs} differs from what bench/results gives: figures are generated, not typed; "
                  f"run python3 bench/report.py", file=sys.stderr)
        missing = [p.path for p in plots if not os.path.exists(p.path)]
        for path in missing:
            print(f"report.py: {path} is missing: run python3 bench/report.py (needs matplotlib)", file=sys.stderr)
        return 1 if stale or missing else 0
    if new != doc:
        with open(a.docs, "w") as f:
            f.write(new)
        print(f"report.py: rewrote {a.docs}", file=sys.stderr)
    if plots and not a.no_plots:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            print("report.py: matplotlib is not installed (requirements-dev.txt): plots not written", file=sys.stderr)
            return 1
        for p in plots:
            write_plot(p)
            print(f"report.py: wrote {p.path}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
