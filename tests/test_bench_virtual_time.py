"""The storm's virtual-time clients are plain top-level classes parametrised by ``speedup``, and
neither they (zp_client.testing) nor the storm (zp_storm) define a class inside a function or at run time."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

import openai
import pytest
from openai._models import FinalRequestOptions

import zp_client.testing
from zp_client.errors import ConfigurationError
from zp_client.retry import RetryPolicy, testing
from zp_client.testing import VirtualTimeAsyncOpenAI, VirtualTimeRetryPolicy

# the virtual-time helpers and the storm (storm/zp_storm in this repository), read as source
_TESTING = Path(zp_client.testing.__file__).parent
BENCH = [_TESTING, _TESTING.parents[1] / "storm" / "zp_storm"]


def _retry_timeout(client: openai.AsyncOpenAI, retry_after_ms: str) -> float:
    options = FinalRequestOptions.construct(method="post", url="/chat/completions")
    # the SDK reads the header with .get (a Headers of httpx for openai 2.x, of httpx2 for 3.x)
    return client._calculate_retry_timeout(1, options, {"retry-after-ms": retry_after_ms})  # type: ignore[arg-type]


@pytest.mark.openai_compat
def test_openai_backoff_runs_in_virtual_seconds_and_copies_keep_the_speedup() -> None:
    plain = openai.AsyncOpenAI(base_url="http://127.0.0.1:1/v1", api_key="x")
    fast = VirtualTimeAsyncOpenAI(speedup=4.0, base_url="http://127.0.0.1:1/v1", api_key="x", max_retries=5)
    assert _retry_timeout(plain, "2000") == pytest.approx(2.0)  # the server's Retry-After, honoured
    assert _retry_timeout(fast, "2000") == pytest.approx(0.5)  # 2 virtual seconds at 4x
    for copy in (fast.copy(timeout=3.0), fast.with_options(max_retries=1)):
        assert type(copy) is VirtualTimeAsyncOpenAI and copy.speedup == 4.0
        assert _retry_timeout(copy, "2000") == pytest.approx(0.5)
    assert fast.copy().max_retries == 5
    with pytest.raises(ConfigurationError, match="speedup"):
        VirtualTimeAsyncOpenAI(speedup=0, base_url="http://127.0.0.1:1/v1", api_key="x")
    for c in (plain, fast):
        asyncio.run(c.close())


def test_zp_retry_sleeps_run_in_virtual_seconds() -> None:
    policy = VirtualTimeRetryPolicy(8.0, max_attempts=5)
    assert isinstance(policy, RetryPolicy) and policy.max_attempts == 5 and policy.speedup == 8.0
    with testing() as rec:
        policy.sleep_sync(4.0)
        asyncio.run(policy.sleep(2.0))
    assert rec.sleeps == [0.5, 0.25]
    with pytest.raises(ConfigurationError, match="speedup"):
        VirtualTimeRetryPolicy(-1.0)


def _runtime_classes(tree: ast.AST) -> list[str]:
    """``class`` statements inside a function or method, and ``type(name, bases, ns)`` / ``new_class``
    calls."""
    found: list[str] = []

    def visit(node: ast.AST, in_function: bool) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef) and in_function:
                found.append(f"class {child.name} (line {child.lineno})")
            if isinstance(child, ast.Call):
                fn = child.func
                name = fn.id if isinstance(fn, ast.Name) else fn.attr if isinstance(fn, ast.Attribute) else ""
                if (name == "type" and len(child.args) == 3) or name in ("new_class", "make_dataclass"):
                    found.append(f"{name}(...) (line {child.lineno})")
            inside = in_function or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            visit(child, inside)

    visit(tree, False)
    return found


def test_the_bench_defines_no_class_at_run_time() -> None:
    paths = [p for d in BENCH for p in sorted(d.glob("*.py"))]
    assert len(paths) > 10  # both folders were found
    found = {p.name: hits for p in paths if (hits := _runtime_classes(ast.parse(p.read_text())))}
    assert found == {}
    # the finder finds what it looks for
    assert _runtime_classes(ast.parse("def f():\n    class A: ...\n    return type('B', (), {})\n")) == [
        "class A (line 2)", "type(...) (line 3)"]
