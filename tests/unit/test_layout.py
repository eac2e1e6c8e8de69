"""The layout rules of docs/architecture.md, checked on the source tree: which folders
hold what, which way imports point, how big a module may grow. Static (ast and ruff), so
it runs in the unit tier."""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
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
    ``from a import b`` counts as ``a.b`` when that is a module, else as ``a``. Imports under
    ``if TYPE_CHECKING:`` are in neither list (:func:`_all_imports` has them)."""
    top, inner, _ = _imports_by_kind(module)
    return top, inner


Imports = list[tuple[str, int]]



def parse(source: str) -> ast.Module:
    """``ast.parse``, again in a fresh thread if it fails with CPython 3.11's "AST constructor
    recursion depth mismatch": an earlier test in the session can leave this thread's
    recursion accounting off (a RecursionError caught in C code); a new thread starts clean."""
    try:
        return ast.parse(source)
    except SystemError:
        with ThreadPoolExecutor(1) as pool:
            return pool.submit(ast.parse, source).result()

@cache
def _imports_by_kind(module: str) -> tuple[Imports, Imports, Imports]:
    """(module-level, function-level, type-checking-only) imports of a project module."""
    tree = parse(MODULES[module].read_text())
    top: list[tuple[str, int]] = []
    inner: list[tuple[str, int]] = []
    typed: list[tuple[str, int]] = []
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
        where = typed if id(node) in typing_only else inner if id(node) in in_function else top
        where.extend((n, node.lineno) for n in names)
    return top, inner, typed


def _all_imports(module: str) -> list[tuple[str, int]]:
    """Every import of a module: at module level, inside functions and for type checking only."""
    return [imp for kind in _imports_by_kind(module) for imp in kind]


@cache
def _heavy(module: str) -> bool:
    """Importing this project module imports a HEAVY package (directly or through others)."""
    for name, _ in _imports(module)[0]:
        if name.split(".")[0] in HEAVY or (name in MODULES and name != module and _heavy(name)):
            return True
    return False


ROOMS = {"runtime", "settings", "gateway", "cli", "stack", "sim", "demo", "report", "wiring"}
"""services/: process modules directly, and one room per concern (docs/architecture.md)."""
MAX_ROOM = 12
WIDER: dict[str, int] = {}
"""Rooms allowed more than MAX_ROOM modules while they are being split (none now)."""


def test_services_is_a_hall_of_processes_and_rooms() -> None:
    services = ROOT / "services"
    modules = sorted(p.name for p in services.glob("*.py"))
    assert len(modules) <= 8, f"services/ holds {len(modules)} modules directly: {modules}"
    rooms = {p.name for p in services.iterdir() if (p / "__init__.py").exists()}
    assert rooms == ROOMS, f"services/ rooms changed: {sorted(rooms)} (update docs/architecture.md)"
    assert (ROOT / "ingest" / "reward" / "__init__.py").exists(), "the reward join has its own room"


@pytest.mark.parametrize("room", sorted(ROOMS))
def test_no_room_holds_more_than_twelve_modules(room: str) -> None:
    modules = [p.name for p in (ROOT / "services" / room).glob("*.py")
               if p.name not in ("__init__.py", "__main__.py")]
    assert len(modules) <= WIDER.get(room, MAX_ROOM), f"services/{room}: {len(modules)} modules; split it"


ORDER = ("ingest", "rollback", "deployer", "trainer", "services", "helm", "bench")
"""The import order, bottom first: a package imports only those at or below it. The four
domains stack (the trainer registers and checks candidates with the deployer's registry and
engine check; the deployer judges with the rollback judge; everything reads the contracts
in ingest/); services/ wires them; the chart's tools and the benchmarks sit on top."""


def test_packages_import_only_downwards() -> None:
    rank = {pkg: i for i, pkg in enumerate(ORDER)}
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {m.split('.')[0]} imports {name}"
           for m in MODULES if m.split(".")[0] in rank
           for name, line in _all_imports(m)
           if name.split(".")[0] in rank and rank[name.split(".")[0]] > rank[m.split(".")[0]]]
    assert not bad, "imports running up the order " + " < ".join(ORDER) + ":\n" + "\n".join(bad)


def test_contracts_are_the_bottom() -> None:
    """ingest/contracts/ may import only itself and the event contract: every room imports it."""
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {name}"
           for m in MODULES if m.startswith("ingest.contracts")
           for name, line in _all_imports(m)
           if _is_project(name) and not name.startswith(("ingest.contracts", "ingest.events"))]
    assert not bad, "\n".join(bad)


def _folder(module: str) -> str:
    """The folder a module sits in (a package's ``__init__`` is in its own folder)."""
    path = MODULES[module]
    return str(path.parent.relative_to(ROOT))


def test_no_folder_cycles() -> None:
    """Two folders that import each other (even through lazy or type-only imports) are one
    concern split in two, or two concerns tangled."""
    graph: dict[str, set[str]] = {}
    for m in MODULES:
        mine = _folder(m)
        graph.setdefault(mine, set()).update(
            _folder(n) for n, _ in _all_imports(m) if n in MODULES and _folder(n) != mine)
    _fail_on_cycle(graph, "folder cycle")


def test_process_modules_are_imported_only_by_the_cli_dispatch() -> None:
    """``services/serve_*.py`` only run a process; what they build lives in ``services/wiring/``,
    so nothing imports them (the CLI names them as strings in ``SERVE``)."""
    files = [MODULES[m] for m in MODULES] + sorted((ROOT / "tests").rglob("*.py"))
    bad = []
    for path in files:
        for node in ast.walk(parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            else:
                continue
            if any(n.startswith("services.serve_") for n in names):
                bad.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not bad, "imports of a process module:\n" + "\n".join(bad)


KEY_NAMESPACES = ("routing", "engine", "deployer", "registry", "trainer", "holdout", "gateway", "ingest",
                  "reward")
KEY_HOME = "ingest/contracts/keys.py"


def _key_literals(path: Path) -> list[tuple[int, str]]:
    """String literals (f-strings included, docstrings not) that spell a Redis key of ours:
    ``<namespace>:<something>``, as in ``f"{prefix}routing:{name}"``."""
    tree = parse(path.read_text())
    docs = {id(n.value) for n in ast.walk(tree)
            if isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant)}
    pattern = re.compile(r"(?:^|\})(" + "|".join(KEY_NAMESPACES) + r"):[\w{*-]")
    docs |= {id(v) for n in ast.walk(tree) if isinstance(n, ast.JoinedStr) for v in n.values}  # parts
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.JoinedStr):
            text = "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            text = node.value
        else:
            continue
        if pattern.search(text):
            out.append((node.lineno, text))
    return out


def test_redis_keys_are_built_only_in_the_contracts() -> None:
    bad = [f"{MODULES[m].relative_to(ROOT)}:{line}: {text!r}"
           for m in MODULES if str(MODULES[m].relative_to(ROOT)) != KEY_HOME
           for line, text in _key_literals(MODULES[m])]
    assert not bad, f"Redis keys built outside {KEY_HOME}:\n" + "\n".join(bad)


def test_the_key_check_finds_a_key_built_elsewhere(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text('"""routing:doc is prose."""\nK = f"{prefix}deployer:status"\nL = "holdout:report"\n'
                     'M = f"reward: {x}"\n')
    assert [line for line, _ in _key_literals(probe)] == [2, 3]


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
    """Counting lazy (function-level) and type-only imports: a cycle hidden inside a function
    or behind ``TYPE_CHECKING`` is still two modules that cannot be understood apart."""
    graph = {m: {n for n, _ in _all_imports(m) if n in MODULES and n != m} for m in MODULES}
    _fail_on_cycle(graph, "import cycle")


def _fail_on_cycle(graph: dict[str, set[str]], what: str) -> None:
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
            pytest.fail(f"{what}: " + " -> ".join(cycle))


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


PROBE = "from services.settings.model import Settings\nimport bench.judge\nimport tests.conftest\n" \
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
