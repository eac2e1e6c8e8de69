"""The layout rules of docs/architecture.md, checked on the source tree: which folders
hold what, which way imports point, how big a module may grow. Static (ast and ruff), so
it runs in the unit tier."""

from __future__ import annotations

import ast
import importlib.util
import subprocess
import sys
from functools import cache
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("ingest", "trainer", "deployer", "rollback", "services", "bench", "helm")
DOMAINS = ("ingest", "trainer", "deployer", "rollback")
MAX_LINES = 400
HEAVY = frozenset({"torch", "ray", "mlflow", "transformers", "peft", "matplotlib", "scipy"})
"""Third-party packages slow enough to import that a function may import them lazily."""
OPTIONAL = frozenset({"uvicorn", "starlette", "tokenizers", "trl", "datasets"})
"""Not core dependencies of rtrl: imported only where they are used (uvicorn and starlette by
the benchmark that compares against them, trl and datasets by the one that compares against
TRL; tokenizers, with the ``hf`` extra, by the tiny model builder)."""


def _modules() -> dict[str, Path]:
    out: dict[str, Path] = {}
    for pkg in PACKAGES:
        for path in sorted((ROOT / pkg).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


MODULES = _modules()


def _is_project(name: str) -> bool:
    return name.split(".")[0] in PACKAGES


@cache
def _imports(module: str) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(module-level, function-level) imports of a project module: (imported module, line).
    ``from a import b`` counts as ``a.b`` when that is a module, else as ``a``."""
    tree = ast.parse(MODULES[module].read_text())
    top: list[tuple[str, int]] = []
    inner: list[tuple[str, int]] = []
    in_function: set[int] = set()
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            in_function |= {id(n) for n in ast.walk(node)}
        elif isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            typing_only |= {id(n) for n in ast.walk(node)}  # never imported at run time
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in MODULES else node.module
                     for a in node.names]
        if id(node) not in typing_only:
            (inner if id(node) in in_function else top).extend((n, node.lineno) for n in names)
    return top, inner


@cache
def _heavy(module: str) -> bool:
    """Importing this project module imports a HEAVY package (directly or through others)."""
    for name, _ in _imports(module)[0]:
        if name.split(".")[0] in HEAVY or (name in MODULES and name != module and _heavy(name)):
            return True
    return False


def test_services_is_a_hall_of_processes_and_four_rooms() -> None:
    services = ROOT / "services"
    modules = sorted(p.name for p in services.glob("*.py"))
    assert len(modules) <= 8, f"services/ holds {len(modules)} modules directly: {modules}"
    rooms = {p.name for p in services.iterdir() if (p / "__init__.py").exists()}
    assert {"runtime", "gateway", "cli", "local"} <= rooms
    assert (ROOT / "ingest" / "reward" / "__init__.py").exists(), "the reward join has its own room"


@pytest.mark.parametrize("module", sorted(m for m in MODULES if not m.startswith("tests")))
def test_modules_stay_small(module: str) -> None:
    lines = len(MODULES[module].read_text().splitlines())
    assert lines <= MAX_LINES, f"{MODULES[module].relative_to(ROOT)} has {lines} lines (at most {MAX_LINES})"


def test_every_project_import_resolves() -> None:
    """mypy skips imports it cannot find (third-party stubs), so a moved module would hide."""
    broken = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}"
              for m in MODULES for name, line in _imports(m)[0] + _imports(m)[1]
              if _is_project(name) and importlib.util.find_spec(name) is None]
    assert not broken, "imports of modules that do not exist:\n" + "\n".join(broken)


def test_domain_folders_never_import_services_bench_or_tests() -> None:
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}"
           for m in MODULES if m.split(".")[0] in DOMAINS
           for name, line in _imports(m)[0] + _imports(m)[1]
           if name.split(".")[0] in {"services", "bench", "tests"}]
    assert not bad, "\n".join(bad)


def test_no_import_cycles() -> None:
    graph = {m: {n for n, _ in _imports(m)[0] if n in MODULES and n != m} for m in MODULES}
    # a package's __init__ importing its own modules is not a cycle through them
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return [*stack[stack.index(n):], n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            pytest.fail("import cycle: " + " -> ".join(cycle))


def test_function_level_imports_only_for_heavy_dependencies() -> None:
    """A function may import lazily only what would slow ``rtrl --help`` or a light command:
    torch, Ray, MLflow and friends, or a project module that imports them. Anything else at
    function level hides a cycle or a dependency."""
    lazy = []
    for m in MODULES:
        for name, line in _imports(m)[1]:
            root = name.split(".")[0]
            if root in HEAVY | OPTIONAL or (name in MODULES and _heavy(name)):
                continue
            lazy.append(f"{MODULES[m].relative_to(ROOT)}:{line}: {name}")
    assert not lazy, "function-level imports of light modules (move them to the top):\n" + "\n".join(lazy)


def _ruff(path: str, source: str) -> str:
    ruff = Path(sys.executable).parent / "ruff"
    proc = subprocess.run([str(ruff), "check", "--no-cache", "--stdin-filename", path, "-"], input=source,
                          capture_output=True, text=True, cwd=ROOT, check=False)
    return proc.stdout + proc.stderr


PROBE = "from services.runtime.settings import Settings\nimport bench.judge\nimport tests.conftest\n" \
        "print(Settings, bench, tests)\n"


@pytest.mark.parametrize("path", [f"{d}/probe.py" for d in DOMAINS] + ["trainer/adapters/probe.py",
                                                                       "deployer/adapters/probe.py",
                                                                       "ingest/adapters/probe.py"])
def test_ruff_fails_a_domain_folder_that_imports_services(path: str) -> None:
    out = _ruff(path, PROBE)
    for banned in ("services", "bench", "tests"):
        assert f"TID251 `{banned}` is banned" in out, out


def test_ruff_lets_services_import_services() -> None:
    assert "TID251" not in _ruff("services/probe.py", PROBE)



def test_test_files_have_unique_basenames() -> None:
    """pytest imports test files that sit outside a package by their basename alone, so two
    tiers holding the same file name stop the whole run at collection."""
    seen: dict[str, list[str]] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if not (path.parent / "__init__.py").exists():
            seen.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    assert {name: paths for name, paths in seen.items() if len(paths) > 1} == {}
