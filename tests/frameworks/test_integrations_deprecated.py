"""The old import paths ``zp_client.integrations.langchain`` / ``.autogen``: deprecated re-exports of
``langchain_zp`` / ``autogen_zp``, and a clear error naming the install command when those are missing."""

from __future__ import annotations

import importlib
import sys

import pytest

from zp_client.errors import ConfigurationError, MissingIntegration

pytestmark = pytest.mark.openai_compat

CASES = [
    ("langchain", "langchain_zp", "langchain_openai", ["ZPChatOpenAI", "ZPOpenAI", "admit_langchain"]),
    ("autogen", "autogen_zp", "autogen_ext.models.openai", ["ZPOpenAIChatCompletionClient"]),
]


@pytest.mark.parametrize(("sub", "package", "framework", "names"), CASES)
def test_the_old_path_warns_and_reexports_the_new_package(
    monkeypatch: pytest.MonkeyPatch, sub: str, package: str, framework: str, names: list[str]
) -> None:
    pytest.importorskip(framework)
    new = pytest.importorskip(package, reason=f"pip install -e integrations/{sub}")
    monkeypatch.delitem(sys.modules, f"zp_client.integrations.{sub}", raising=False)
    with pytest.warns(DeprecationWarning, match=f"import {package} instead"):
        old = importlib.import_module(f"zp_client.integrations.{sub}")
    for name in names:
        assert getattr(old, name) is getattr(new, name)
    assert sorted(old.__all__) == sorted(names)


def test_the_package_level_names_still_resolve(monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("langchain_openai")
    new = pytest.importorskip("langchain_zp", reason="pip install -e integrations/langchain")
    import zp_client.integrations as integrations

    monkeypatch.delitem(sys.modules, "zp_client.integrations.langchain", raising=False)
    monkeypatch.delitem(integrations.__dict__, "ZPChatOpenAI", raising=False)
    with pytest.warns(DeprecationWarning, match="import langchain_zp instead"):
        assert integrations.ZPChatOpenAI is new.ZPChatOpenAI
    assert integrations.MissingIntegration is MissingIntegration


@pytest.mark.parametrize(("sub", "package", "framework", "names"), CASES)
def test_without_the_new_package_the_old_path_names_the_install_command(
    monkeypatch: pytest.MonkeyPatch, sub: str, package: str, framework: str, names: list[str]
) -> None:
    monkeypatch.setitem(sys.modules, package, None)  # what an uninstalled package looks like
    monkeypatch.delitem(sys.modules, f"zp_client.integrations.{sub}", raising=False)
    with pytest.warns(DeprecationWarning), pytest.raises(MissingIntegration) as info:
        importlib.import_module(f"zp_client.integrations.{sub}")
    assert isinstance(info.value, ConfigurationError) and isinstance(info.value, ImportError)
    assert f"pip install -e integrations/{sub}" in str(info.value)
    assert package in str(info.value)
