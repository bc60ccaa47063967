"""The public surface, frozen: the names and signatures of ``zp_client.__all__`` and the public methods of
the budgets and fleets, against the committed snapshot ``tests/public_surface.txt``.

A change to the public API must be deliberate: regenerate the snapshot and list the change in the
README (section "Changes to the public API")::

    PYTHONPATH=. .venv/bin/python tests/test_public_surface.py > tests/public_surface.txt
"""

from __future__ import annotations

import importlib
import inspect
import pathlib
import re
import sys
from collections.abc import Callable

SNAPSHOT = pathlib.Path(__file__).with_name("public_surface.txt")

# The classes whose public methods and properties are frozen too (not only their constructors).
CLASSES = (
    "zp_client.budget.local:LocalBudget",
    "zp_client.budget.redis:RedisBudget",
    "zp_client.fleet.local:Fleet",
    "zp_client.fleet.redis:RedisFleet",
)


def _signature(obj: Callable[..., object]) -> str:
    try:
        text = str(inspect.signature(obj))
    except (TypeError, ValueError):  # a builtin without one
        return "(?)"
    return re.sub(r" at 0x[0-9a-f]+", "", text)  # a sentinel default's address changes per process


def _kind(obj: object) -> str:
    if isinstance(obj, type):
        return "exception" if issubclass(obj, BaseException) else "class"
    if callable(obj):
        return "function"
    return f"value {obj!r}"


def _members(cls: type) -> list[str]:
    lines = []
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        raw = inspect.getattr_static(cls, name)
        if isinstance(raw, property):
            lines.append(f"  {name}: property")
        elif isinstance(raw, (staticmethod, classmethod)):
            lines.append(f"  {name}{_signature(getattr(cls, name))}: {type(raw).__name__}")
        elif inspect.isfunction(raw):
            prefix = "async " if inspect.iscoroutinefunction(raw) else ""
            lines.append(f"  {prefix}{name}{_signature(raw)}")
        elif not callable(raw):
            lines.append(f"  {name}: attribute")
    return lines


def surface() -> str:
    """The snapshot's text: one line per public name (kind and signature), then each frozen class's
    public members."""
    import zp_client

    lines = [f"zp_client {len(zp_client.__all__)} names"]
    for name in sorted(zp_client.__all__, key=str.lower):
        if name == "__version__":
            continue
        obj = getattr(zp_client, name)
        kind = _kind(obj)
        sig = _signature(obj) if kind in ("class", "exception", "function") else ""
        lines.append(f"{name}: {kind}{sig}")
    for spec in CLASSES:
        module, _, qual = spec.partition(":")
        cls = getattr(importlib.import_module(module), qual)
        lines.append(f"[{spec}]")
        lines.extend(_members(cls))
    return "\n".join(lines) + "\n"


def test_the_public_surface_matches_its_snapshot() -> None:
    assert surface() == SNAPSHOT.read_text(), (
        "the public surface changed: if deliberate, regenerate tests/public_surface.txt (see this module's "
        "docstring) and list the change in the README"
    )


def test_the_snapshot_is_not_empty_and_covers_the_fleets() -> None:
    text = SNAPSHOT.read_text()
    assert "wrap: function(" in text
    assert "[zp_client.fleet.redis:RedisFleet]" in text and "  note_failure(" in text


if __name__ == "__main__":
    sys.stdout.write(surface())
