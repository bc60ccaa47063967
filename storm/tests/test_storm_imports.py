"""zp-storm uses zp-client as any application would: only its public names (issue 32).

Every import in ``zp_storm`` (deferred ones included) is of the standard library, a third-party package,
``zp_storm`` itself, ``zp_sim``, or a public name of ``zp_client``: a module path with no ``_``-prefixed
part, and a name that is in that module's ``__all__`` (the package root's included), never a private
one. The check reads the source (``ast``), so an import that only runs on some path is seen too."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import zp_storm

STORM = Path(zp_storm.__file__).parent


def _imports(path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name) for every absolute import in ``path``; name None for ``import module``."""
    found: list[tuple[int, str, str | None]] = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, None) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found += [(node.lineno, node.module, a.name) for a in node.names]
        elif isinstance(node, ast.Call) and isinstance(node.func, (ast.Name, ast.Attribute)):
            fn = node.func.id if isinstance(node.func, ast.Name) else node.func.attr
            if fn in ("import_module", "__import__") and node.args \
                    and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value, None))
    return sorted(found, key=lambda f: f[0])  # ast.walk is breadth-first: in source order


def _private_use(module: str, name: str | None) -> str | None:
    """Why importing ``name`` from ``module`` (a zp_client module) is not public use; None when it is."""
    if any(part.startswith("_") for part in module.split(".")):
        return "a private module"
    if name is None:
        return None
    if name.startswith("_"):
        return "a private name"
    mod = importlib.import_module(module)
    public = getattr(mod, "__all__", None)
    if public is not None and name not in public:
        try:  # a submodule (``from zp_client.fleet import pd``) is a module, not a name
            importlib.import_module(f"{module}.{name}")
        except ModuleNotFoundError:
            return f"not in {module}.__all__"
        return _private_use(f"{module}.{name}", None)
    return None


def _offences(root: Path) -> list[str]:
    out = []
    for path in sorted(root.rglob("*.py")):
        for line, module, name in _imports(path):
            top = module.split(".")[0]
            if top == "zp_client":
                why = _private_use(module, name)
                if why:
                    out.append(f"{path.name}:{line} {module} {name or ''}: {why}")
    return out


def test_the_storm_imports_only_public_zp_client_names() -> None:
    assert len(list(STORM.glob("*.py"))) > 10
    assert _offences(STORM) == []


def test_the_check_sees_private_imports(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "from zp_client import wrap\n"
        "from zp_client._wrap import admitted_budget\n"   # a private module
        "def f():\n"
        "    from zp_client.clock import _nothing\n"      # a private name, deferred
        "    from zp_client.errors import install_hint\n"  # public-looking, not in __all__
        "    import zp_client.testing\n"
        "    importlib.import_module('zp_client._core')\n")
    assert [o.split(": ", 1)[1] for o in _offences(tmp_path)] == [
        "a private module", "a private name", "not in zp_client.errors.__all__", "a private module"]


def test_what_the_storm_imports_at_all() -> None:
    """Besides zp_client's public names: the standard library, zp_sim, itself and its declared
    requirements (storm/pyproject.toml) and what they bring (openai 3.x's httpx2, anyio, httpx)."""
    import sys

    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+

    project = tomllib.loads((STORM.parent / "pyproject.toml").read_text())["project"]
    declared = {r.split("[")[0].split(">")[0].split("=")[0].split("<")[0].strip().replace("-", "_")
                for r in project["dependencies"]}
    allowed = declared | {"zp_storm", "openai", "redis", "httpx", "httpx2", "anyio", "tenacity"}
    tops = {module.split(".")[0] for p in STORM.rglob("*.py") for _, module, _ in _imports(p)}
    assert "zp_client" in declared and "zp_sim" in declared
    assert sorted(t for t in tops - allowed if t not in sys.stdlib_module_names) == []
