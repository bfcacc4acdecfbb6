"""DESIGN.md's dependency rule, checked on the source: only server/ imports the web framework,
and api/ never imports server/."""

from __future__ import annotations

import ast
from pathlib import Path

import mlxcel

PACKAGE = Path(mlxcel.__file__).parent
WEB = ("fastapi", "uvicorn", "starlette")


def imported_modules(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
    return names


def test_only_server_imports_the_web_framework() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for p in PACKAGE.rglob("*.py")
                 if "server" not in p.relative_to(PACKAGE).parts[:1]
                 and any(m.split(".")[0] in WEB for m in imported_modules(p))]
    assert offenders == []


def test_api_does_not_import_server() -> None:
    offenders = [str(p.relative_to(PACKAGE)) for p in (PACKAGE / "api").rglob("*.py")
                 if any(m.startswith("mlxcel.server") for m in imported_modules(p))]
    assert offenders == []
