"""These tests run from the zp-client clone, where its test helpers (``tests/_budget_probes.py``) are
importable. Without autogen_zp (or its framework) installed the folder is skipped, saying why."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

_REPO_TESTS = str(Path(__file__).resolve().parents[3] / "tests")
if _REPO_TESTS not in sys.path:
    sys.path.insert(0, _REPO_TESTS)

pytest.importorskip("autogen_ext.models.openai")
pytest.importorskip("autogen_zp", reason="not installed: pip install -e integrations/autogen")
