"""``rtrl demo --json``: stdout carries one strict JSON document, whatever the demo's own
progress lines and the processes it starts write meanwhile."""

from __future__ import annotations

import json
import math
import subprocess
import sys
import textwrap
from pathlib import Path

from services.runtime.json_doc import strict_json

REPO = Path(__file__).resolve().parents[2]


def test_stdout_holds_only_the_document_printed_after_the_block() -> None:
    script = textwrap.dedent("""
        import json, os, subprocess, sys
        from services.demo.console import say, stdout_to_stderr
        with stdout_to_stderr():
            say("progress line")
            subprocess.run([sys.executable, "-c", "print('child stdout')"], check=True)
            subprocess.Popen([sys.executable, "-c", "import os; os.write(1, b'grandchild fd 1')"]).wait()
            os.write(1, b"raw fd 1\\n")
            print("buffered", end="")
        print(json.dumps({"exit_code": 0}))
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)
    assert json.loads(proc.stdout) == {"exit_code": 0}
    for line in ("progress line", "child stdout", "grandchild fd 1", "raw fd 1", "buffered"):
        assert line in proc.stderr


def test_the_block_restores_stdout_after_a_failure() -> None:
    script = textwrap.dedent("""
        from services.demo.console import stdout_to_stderr
        try:
            with stdout_to_stderr():
                raise RuntimeError("inside")
        except RuntimeError:
            pass
        print("after")
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True,
                          timeout=60, check=True)
    assert proc.stdout == "after\n" and proc.stderr == ""


def test_non_finite_numbers_become_null() -> None:
    value = {"a": math.nan, "b": [1.5, math.inf, {"c": -math.inf}], "d": (2, "x"), 3: None}
    out = strict_json(value)
    assert out == {"a": None, "b": [1.5, None, {"c": None}], "d": [2, "x"], "3": None}
    json.dumps(out, allow_nan=False)  # strict JSON
