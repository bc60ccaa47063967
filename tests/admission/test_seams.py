"""The admission package's seams are typed: no ``Any`` in any signature or field under
zp_client/_admission (the port Protocols included) and no ``getattr(`` there (another library's private
attributes go through zp_client/_private.py)."""

from __future__ import annotations

import ast
import pathlib

import pytest

import zp_client

PACKAGE = pathlib.Path(zp_client.__file__).parent / "_admission"


def _names(node: ast.AST | None) -> set[str]:
    if node is None:
        return set()
    if isinstance(node, ast.Constant) and isinstance(node.value, str):  # a string annotation
        return _names(ast.parse(node.value, mode="eval"))
    return {n.id for n in ast.walk(node) if isinstance(n, ast.Name)} | {
        n.attr for n in ast.walk(node) if isinstance(n, ast.Attribute)}


def any_in_signatures(path: pathlib.Path) -> list[str]:
    """``file:line name`` of every annotation (parameter, return, class field) that mentions ``Any``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            args = node.args
            params = [*args.posonlyargs, *args.args, *args.kwonlyargs,
                      *(a for a in (args.vararg, args.kwarg) if a is not None)]
            for ann in [p.annotation for p in params] + [node.returns]:
                if "Any" in _names(ann):
                    found.append(f"{path.name}:{node.lineno} {node.name}")
        elif isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and "Any" in _names(item.annotation):
                    found.append(f"{path.name}:{item.lineno} {node.name}")
        elif (isinstance(node, ast.Assign) and node.col_offset == 0
              and not isinstance(node.value, ast.Constant) and "Any" in _names(node.value)):
            found.append(f"{path.name}:{node.lineno} alias")  # a type alias built on Any
    return found


def getattr_calls(path: pathlib.Path) -> list[str]:
    return [f"{path.name}:{n.lineno}" for n in ast.walk(ast.parse(path.read_text()))
            if isinstance(n, ast.Call) and isinstance(n.func, ast.Name)
            and n.func.id in ("getattr", "hasattr")]


def test_no_any_in_a_signature_of_the_admission_package() -> None:
    files = sorted(PACKAGE.glob("*.py"))
    assert len(files) >= 10
    assert [o for p in files for o in any_in_signatures(p)] == []


def test_no_getattr_in_the_admission_package() -> None:
    assert [o for p in sorted(PACKAGE.glob("*.py")) for o in getattr_calls(p)] == []


def test_the_checks_see_what_they_look_for(tmp_path: pathlib.Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text("from typing import Any\n"
                     "X = dict[str, Any]\n"
                     "class C:\n    f: 'list[Any]'\n"
                     "def g(a: int, *rest: Any) -> None:\n    return getattr(a, 'b')\n")
    assert sorted(any_in_signatures(probe)) == ["probe.py:2 alias", "probe.py:4 C", "probe.py:5 g"]
    assert getattr_calls(probe) == ["probe.py:6"]


def _module_imports(path: pathlib.Path, names: set[str]) -> set[str]:
    """The zp_client modules ``path`` imports anywhere (deferred and ``TYPE_CHECKING`` ones included)."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            found.add(node.module)
            found |= {f"{node.module}.{a.name}" for a in node.names}
    return found & names


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


@pytest.mark.slow
def test_no_module_of_the_admission_package_is_in_an_import_circle() -> None:
    root = PACKAGE.parent
    paths = {".".join(p.relative_to(root.parent).with_suffix("").parts).removesuffix(".__init__"): p
             for p in root.rglob("*.py")}
    graph = {m: _module_imports(p, set(paths)) for m, p in paths.items()}
    assert graph["zp_client._admission.actions"]  # the graph is not empty: imports are seen
    assert [c for c in _circles(graph) if any(m.startswith("zp_client._admission") for m in c)] == []
    assert _circles({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == [["a", "b"]]  # the search finds one
