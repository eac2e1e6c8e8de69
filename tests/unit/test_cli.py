"""The ``rtrl`` command's routing: every command resolves to a module with ``main``, help
is fast and touches nothing."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path

import pytest

from services.cli import BENCH, COMMANDS, SERVE, main
from services.settings.model import get_settings

ROUTED = sorted({module for module, _ in [*COMMANDS.values(), *SERVE.values(), *BENCH.values()]})


@pytest.mark.parametrize("module", ROUTED)
def test_every_command_routes_to_a_main(module: str) -> None:
    assert callable(getattr(importlib.import_module(module), "main", None)), module


def test_help_lists_every_command_and_imports_nothing_heavy() -> None:
    code = ("import sys; from services.cli import main; main(['--help']); "
            "print(sorted(m for m in ('torch', 'ray', 'mlflow', 'kafka', 'redis') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert all(f"  {name} " in out for name in COMMANDS)
    assert out.strip().splitlines()[-1] == "[]"


@pytest.mark.parametrize("argv", [["up", "--help"], ["down", "-h"], ["stack", "--help"]])
def test_stack_commands_answer_help_without_touching_the_stack(
        argv: list[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """``rtrl up --help`` must print its usage, not start (or ``down`` stop) the stack."""
    monkeypatch.setenv("RTRL_STACK__DATA_DIR", str(tmp_path / "stack"))
    get_settings.cache_clear()
    assert main(argv) == 0
    assert "usage: rtrl up" in capsys.readouterr().out
    assert not (tmp_path / "stack").exists()
    get_settings.cache_clear()


def test_a_benchmark_stops_on_sigterm_as_on_ctrl_c(monkeypatch: pytest.MonkeyPatch) -> None:
    import signal

    import services.cli as cli

    seen: list[object] = []
    monkeypatch.setattr(cli, "_run", lambda *a: seen.append(signal.getsignal(signal.SIGTERM)) or 0)
    previous = signal.getsignal(signal.SIGTERM)
    try:
        assert cli.main(["bench", "pipeline"]) == 0
        assert seen == [cli._interrupted]
        with pytest.raises(KeyboardInterrupt):
            cli._interrupted(signal.SIGTERM, None)
    finally:
        signal.signal(signal.SIGTERM, previous)
