"""The documentation site (mkdocs.yml, docs/) builds with warnings as errors, and documents what
the code has: every wrap() option with its default (docs/python.md's table), every tsd setting
(`tsd --print-config`) in docs/daemon.md, every flag of `tsd --help` and every tsctl subcommand and
flag in docs/cli.md, every example in docs/integrations.md, every plot of docs/img on the results
page. A new option, setting, flag, subcommand, example or plot fails here until it is documented."""
from __future__ import annotations

import inspect
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, tsd_binary

import trainstream
from trainstream.wiring import OPTIONS

DOCS = os.path.join(ROOT, "docs")


def read(name: str) -> str:
    with open(os.path.join(DOCS, name)) as f:
        return f.read()


def section(text: str, heading: str) -> str:
    """The text of a `## heading` section, up to the next heading of its level or above."""
    start = text.index(heading)
    level = heading.split(" ", 1)[0]
    rest = text[start + len(heading):]
    end = re.search(rf"^#{{1,{len(level)}}} ", rest, re.M)
    return rest[:end.start()] if end else rest


def table_rows(text: str) -> list[list[str]]:
    return [[c.strip() for c in re.split(r"(?<!\\)\|", line.strip().strip("|"))] for line in text.splitlines()
            if line.startswith("| ") and not line.startswith("|---")]


def literal(value: object) -> str:
    """How the docs write a default: Python's literal, strings in double quotes."""
    return f'"{value}"' if isinstance(value, str) else repr(value)


def test_site_builds_strictly(tmp_path):
    """`mkdocs build --strict`: a broken link or anchor, or a page missing from the nav, fails."""
    pytest.importorskip("mkdocs", reason="mkdocs is installed by scripts/setup.sh")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "-f", os.path.join(ROOT, "mkdocs.yml"),
                        "-d", str(tmp_path / "site")], capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "site" / "index.html").is_file()
    assert (tmp_path / "site" / "results" / "index.html").is_file()


def test_every_wrap_option_is_documented_with_its_default():
    rows = table_rows(section(read("python.md"), "## `wrap()`"))
    documented: dict[str, str] = {}
    for row in rows:
        names = re.findall(r"`([a-z_]+)`", row[0])
        defaults = [d.strip() for d in row[1].split(",")] if len(row) > 1 and row[1] else []
        for i, name in enumerate(names):
            documented[name] = defaults[i] if len(defaults) == len(names) else ""
    missing = sorted(set(OPTIONS) - set(documented))
    assert not missing, f"wrap() options missing from docs/python.md's wrap() table: {missing}"
    stale = sorted(set(documented) - set(OPTIONS) - {"option"})
    assert not stale, f"docs/python.md documents wrap() options that do not exist: {stale}"
    for name, default in OPTIONS.items():
        if documented[name]:
            assert documented[name] == f"`{literal(default)}`", (name, documented[name], default)
    # wrap()'s own arguments, and plan_wrap()'s, are named in the text.
    text = read("python.md")
    for fn in (trainstream.wrap, trainstream.plan_wrap):
        for p in inspect.signature(fn).parameters.values():
            if p.kind is p.POSITIONAL_OR_KEYWORD and p.name not in ("model", "optimizer"):
                assert f"{p.name}=" in text, f"{fn.__name__}'s argument {p.name} is not in docs/python.md"


def _help(binary: str, *args: str) -> str:
    return subprocess.run([binary, *args, "--help"], capture_output=True, text=True, check=True).stdout


def test_every_tsd_setting_and_flag_is_documented():
    tsd = tsd_binary()
    config = subprocess.run([tsd, "--print-config", "--metrics-listen", ""], capture_output=True, text=True,
                            check=True).stdout
    keys = re.findall(r"^([a-z_]+) = ", config, re.M)
    assert len(keys) >= 10
    daemon, cli = read("daemon.md"), read("cli.md")
    table = section(daemon, "## Settings")
    for key in keys:
        flag = "--" + key.replace("_", "-")
        assert f"| `{key}` (`{flag}`)" in table, f"setting {key} is not in docs/daemon.md's settings table"
        assert re.search(rf"\| `{flag}[ `]", cli), f"{flag} is not in docs/cli.md"
    flags = set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", _help(tsd)))
    assert {"--config", "--print-config", "--version", "--help"} <= flags
    missing = sorted(f for f in flags if not re.search(rf"`{f}[ `]", cli))
    assert not missing, f"tsd flags missing from docs/cli.md: {missing}"


def test_every_tsctl_subcommand_and_flag_is_documented():
    tsctl = os.path.join(os.path.dirname(tsd_binary()), "tsctl")
    if not os.path.exists(tsctl):
        pytest.skip(f"no tsctl beside {tsd_binary()}")
    top = _help(tsctl)
    subcommands = re.findall(r"^  ([a-z]+)\s{2,}", top.split("Subcommands:", 1)[1], re.M)
    assert {"status", "jobs", "top"} <= set(subcommands)
    cli = section(read("cli.md"), "## `tsctl`")
    for flag in re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", top):
        assert f"`{flag}" in cli, f"tsctl {flag} is not in docs/cli.md"
    rows = {row[0].strip("`"): row for row in table_rows(cli)}
    for sub in subcommands:
        assert sub in rows, f"tsctl {sub} is not in docs/cli.md's table"
        for flag in set(re.findall(r"(?<![\w-])(--[a-z][a-z-]+)", _help(tsctl, sub))) - {"--help"}:
            assert f"`{flag}" in rows[sub][2], f"tsctl {sub} {flag} is not in docs/cli.md's row for {sub}"


def test_every_example_and_plot_is_on_a_page():
    integrations = read("integrations.md")
    for name in sorted(os.listdir(os.path.join(ROOT, "examples"))):
        if name.endswith(".py"):
            assert f"`examples/{name}`" in integrations, f"examples/{name} is not in docs/integrations.md"
    results = read("results.md")
    for name in sorted(os.listdir(os.path.join(DOCS, "img"))):
        if name.endswith(".png"):
            assert f"](img/{name})" in results, f"docs/img/{name} is not shown on docs/results.md"
