"""The package root's ``__all__`` is a literal (so type checkers see the re-exports): it must list exactly
the lazily exported names, each of which resolves."""

from __future__ import annotations

import zp_client


def test_all_lists_every_lazy_export_and_nothing_else() -> None:
    assert sorted(zp_client.__all__) == sorted([*zp_client._EXPORTS, "__version__"])
    assert len(set(zp_client.__all__)) == len(zp_client.__all__)


def test_every_exported_name_resolves() -> None:
    for name in zp_client.__all__:
        assert getattr(zp_client, name) is not None, name
