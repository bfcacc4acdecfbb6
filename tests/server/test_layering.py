"""The dependency rule of docs/structure.md, checked on the source: every package edge, the
API layer's view of the engine, the chat features' protocol blindness, and import cycles (none
allowed, and none in the rule's own table).

Imports are read with `ast`, so imports inside functions and under `TYPE_CHECKING` count too:
a type-only import still ties two modules together.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import mlxcel

PACKAGE = Path(mlxcel.__file__).parent
WEB = ("fastapi", "uvicorn", "starlette")

# Each unit of src/mlxcel (a package or a top-level module) and the units
# it may import. docs/structure.md draws the same table; change both together.
ALLOWED: dict[str, set[str]] = {
    "types": set(),
    "lora_registry": set(),  # F8: adapter ids and global scales, torch-free
    "config": {"types"},
    "env": {"media", "settings"},  # media: the policy from a snapshot's MLXCEL_* media variables
    "settings": {"chat", "config", "media", "types"},  # chat: the loop-guard override parser
    "layers": {"types"},
    "models": {"layers", "types"},
    "loading": {"models", "layers", "types"},
    "engine": {"config", "layers", "types"},
    "media": {"types"},
    "text": {"loading", "types"},
    "chat": {"text", "types"},
    "workers": {"layers", "loading", "types", "config"},
    "api": {"chat", "text", "engine", "lora_registry", "media", "workers", "types", "config"},
    # serving/ (issues 25, 47): what builds the serving process: a served model (the same in either process), the
    # engine child's entry point and its spawn, the chat model's start, side and audio models and their products
    # (process). One layer below server/ and the command line; it never imports them.
    "serving": {"api", "chat", "config", "engine", "layers", "loading", "lora_registry", "text", "types", "workers"},
    # server/ holds serving's products (serving.process, type-only served_model); it never imports its loaders at
    # run time (test_issue13_...), nor the engine or the model packages.
    "server": {"api", "chat", "config", "env", "loading", "media", "serving", "settings", "text", "types", "workers"},
    # The command line read into the frozen configs every command starts from (above server: the
    # listener rules and key files it checks live there).
    "command_line": {"api", "chat", "config", "env", "media", "server", "serving", "settings", "types"},
    # The API process's startup path (issue 47: out of serving/, whose products it assembles), above the command
    # line and the server it builds the state of.
    "startup": {"api", "command_line", "config", "layers", "loading", "server", "serving", "settings", "workers",
                "types"},
    "audio_cli": {"api", "config", "env", "loading", "serving", "workers", "types", "text"},
    "cluster": {"api", "command_line", "env", "server", "startup", "config", "types"},
    "perplexity": {"text", "types"},  # issue 27: llama-perplexity's numbers over an engine handed in
    "cli": {"api", "audio_cli", "cluster", "command_line", "config", "env", "loading", "perplexity", "serving",
            "startup", "types"},
}


def module_files() -> dict[str, Path]:
    files = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        files[name] = path
    return files


MODULES = module_files()


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports (absolute imports; `from a import b` names a.b if it is a module)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            for alias in node.names:
                sub = f"{node.module}.{alias.name}"
                names.add(sub if sub in MODULES else node.module)
    return names


def unit_of(module: str) -> str:
    """The package or top-level module of src/mlxcel a module belongs to ("mlxcel.server.state" -> "server");
    each package is judged as a whole (issue 47: no package spans layers)."""
    parts = module.split(".")[1:]
    return parts[0] if parts else ""


def internal_edges() -> Iterator[tuple[str, str]]:
    """(importer, imported) for every import between two mlxcel modules."""
    for name, path in MODULES.items():
        for target in imported_modules(path):
            if target in MODULES and target != name and not name.startswith(target + "."):
                yield name, target


def test_every_unit_is_in_the_rule() -> None:
    units = {unit_of(name) for name in MODULES} - {""}
    assert units == set(ALLOWED), "a new package or top-level module needs its row in ALLOWED (and docs)"


def test_every_package_edge_follows_the_rule() -> None:
    offenders = sorted(f"{a} -> {b}" for a, b in internal_edges()
                       if unit_of(a) != unit_of(b) and unit_of(b) not in ALLOWED[unit_of(a)])
    assert offenders == []


def test_only_server_imports_the_web_framework() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if "server" not in p.relative_to(PACKAGE).parts[:1]
                 and any(m.split(".")[0] in WEB for m in imported_modules(p))]
    assert offenders == []


def test_api_sees_the_engine_only_through_its_client() -> None:
    offenders = sorted(f"{a} -> {b}" for a, b in internal_edges()
                       if unit_of(a) == "api" and unit_of(b) == "engine" and b != "mlxcel.engine.client")
    assert offenders == []


def test_chat_features_never_see_requests() -> None:
    """chat/ gets typed ChatOptions; the wire schemas, pydantic and JSON bodies stay in api/."""
    offenders = [str(p.relative_to(PACKAGE)) for p in (PACKAGE / "chat").rglob("*.py")
                 if "pydantic" in {m.split(".")[0] for m in imported_modules(p)}]
    assert offenders == []


def test_no_import_cycles() -> None:
    graph: dict[str, set[str]] = {name: set() for name in MODULES}
    for a, b in internal_edges():
        graph[a].add(b)
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    assert cycles == []


def test_no_cycle_between_packages() -> None:
    """Each package judged as a whole, whatever the table says: no package reaches itself through others."""
    graph: dict[str, set[str]] = {unit_of(name): set() for name in MODULES}
    for a, b in internal_edges():
        if unit_of(a) != unit_of(b):
            graph[unit_of(a)].add(unit_of(b))
    cycles = [sorted(c) for c in strongly_connected(graph) if len(c) > 1]
    assert cycles == [], "\n".join(f"{' <-> '.join(c)}: " + ", ".join(edges_within(c)) for c in cycles)


def edges_within(packages: list[str]) -> list[str]:
    """The module imports that tie a cycle's packages together, for the failure message."""
    return sorted(f"{a} -> {b}" for a, b in internal_edges()
                  if unit_of(a) != unit_of(b) and {unit_of(a), unit_of(b)} <= set(packages))


def test_the_rule_has_no_circle() -> None:
    """The table itself is layered: no unit may reach itself through the units it may import."""
    graph = {unit: allowed & ALLOWED.keys() for unit, allowed in ALLOWED.items()}
    assert [sorted(c) for c in strongly_connected(graph) if len(c) > 1] == []


def strongly_connected(graph: dict[str, set[str]]) -> list[set[str]]:
    """Tarjan's components, iteratively (the module graph is deep enough to matter)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[set[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is None:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    found.append(component)
            elif child not in index:
                index[child] = low[child] = len(index)
                stack.append(child)
                on_stack.add(child)
                work.append((child, iter(sorted(graph[child]))))
            elif child in on_stack:
                low[node] = min(low[node], index[child])
    return found


def runtime_imports(path: Path) -> set[str]:
    """Modules imported outside `if TYPE_CHECKING:` blocks (type-only imports load nothing)."""
    names: set[str] = set()

    def visit(node: ast.AST) -> None:
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(ast.parse(path.read_text(encoding="utf-8")))
    return names


LOADERS = ("mlxcel.serving.served_model", "mlxcel.serving.chat_model", "mlxcel.serving.engine_process",
           "mlxcel.serving.side_models", "mlxcel.serving.audio_models", "mlxcel.workers")


def test_issue13_server_holds_what_startup_built_and_never_imports_the_loaders() -> None:
    offenders = {str(p.relative_to(PACKAGE)): sorted(m for m in runtime_imports(p) if m.startswith(LOADERS))
                 for p in (PACKAGE / "server").rglob("*.py")}
    assert {path: found for path, found in offenders.items() if found} == {}


def test_server_never_names_the_chat_model_starters() -> None:
    """Of serving/, server/ names only the products and the planners' types, not even type-only the starters."""
    starters = ("mlxcel.serving.chat_model", "mlxcel.serving.engine_process")
    offenders = sorted(f"{a} -> {b}" for a, b in internal_edges() if unit_of(a) == "server" and b.startswith(starters))
    assert offenders == []
