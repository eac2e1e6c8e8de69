"""The README's results table stays checkable: every row names a command that still exists
(an ``rtrl`` subcommand with each flag it shows, a test file, a script), or says it comes
from the row above's run, and carries the date and commit that recorded it."""

from __future__ import annotations

import re
import subprocess
import sys
from datetime import date
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
HEADER = "| what | figure | target | command | recorded |"


def rows() -> list[list[str]]:
    lines = (ROOT / "README.md").read_text().splitlines()
    start = lines.index(HEADER)
    out = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        out.append([c.strip() for c in line.strip().strip("|").split(" | ")])
    return out


@cache
def help_text(*words: str) -> str:
    """``rtrl <words> --help`` as the CLI prints it."""
    proc = subprocess.run([sys.executable, "-m", "services.cli", *words, "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, f"rtrl {' '.join(words)} --help failed: {proc.stderr[-500:]}"
    return proc.stdout


def check_command(cmd: str, previous: str | None) -> str:
    """Check one backticked command; returns the full command (a ``...`` continuation extends
    ``previous``)."""
    if cmd.startswith("..."):
        assert previous, f"{cmd!r} continues no command"
        cmd = previous + cmd[3:]
    words = cmd.replace("[", " ").replace("]", " ").split()
    if words[0] == "rtrl":
        sub = words[1:3] if words[1] == "bench" else words[1:2]
        modes = [w for w in words if w in ("--scale", "--schedule")]  # modes with a help of their own
        text = help_text(*sub, *modes)
        for flag in (w for w in words if w.startswith("--")):
            assert re.search(rf"{re.escape(flag)}\b", text), f"`{cmd}`: rtrl {' '.join(sub)} has no {flag}"
    elif words[0] == "pytest":
        for path in (w for w in words[1:] if not w.startswith("-")):
            assert (ROOT / path.split("::")[0]).exists(), f"`{cmd}`: no {path}"
    elif words[0].startswith("scripts/"):
        assert (ROOT / words[0]).is_file(), f"`{cmd}`: no {words[0]}"
    else:
        pytest.fail(f"`{cmd}`: not an rtrl command, a pytest run or a script")
    return cmd


def test_every_result_names_a_command_that_exists_and_when_it_was_recorded() -> None:
    table = rows()
    assert len(table) >= 10, "the results table was not found"
    previous: str | None = None
    for what, _figure, _target, command, recorded in table:
        m = re.fullmatch(r"(\d{4}-\d{2}-\d{2}), `([0-9a-f]{7,40})`", recorded)
        assert m, f"{what!r}: 'recorded' must be 'YYYY-MM-DD, `commit`', not {recorded!r}"
        assert date.fromisoformat(m.group(1)) <= date.today(), f"{what!r}: recorded in the future"
        if command in ("same run", "same"):
            assert previous, f"{what!r} says 'same run' but no row above names a command"
            continue
        cmds = re.findall(r"`([^`]+)`", command)
        assert cmds, f"{what!r}: no command in {command!r}"
        for cmd in cmds:
            previous = check_command(cmd, previous)


def test_the_check_rejects_what_does_not_exist() -> None:
    with pytest.raises(AssertionError, match="has no --no-such-flag"):
        check_command("rtrl bench judge --no-such-flag", None)
    with pytest.raises(AssertionError, match=r"no tests/reliability/test_gone\.py"):
        check_command("pytest tests/reliability/test_gone.py", None)
    with pytest.raises(AssertionError, match="continues no command"):
        check_command("... --stream", None)
    assert check_command("... --stream", "rtrl bench gateway --mode vllm") == \
        "rtrl bench gateway --mode vllm --stream"
