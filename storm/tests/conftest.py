"""The storm's tests use the library suite's Redis fixtures (one definition: tests/conftest.py, which
reuses 127.0.0.1:6379 when it answers and otherwise starts a redis-server of its own). The repository
root is importable wherever the three distributions are installed editable from it (make test)."""

from __future__ import annotations

from tests.conftest import redis_prefix, redis_url

__all__ = ["redis_prefix", "redis_url"]
