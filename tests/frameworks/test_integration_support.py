"""What the integration packages build on: ``zp_client.AdmissionOptions`` and the two accessors of openai's
private layout (``openai_http_client``, ``openai_client_of``), which must fail loudly if openai moves it.

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest

from zp_client import (
    DEADLINE_HEADER,
    PRIORITY_HEADER,
    ROUTE_HEADER,
    AdmissionOptions,
    LocalBudget,
    Settings,
    admitted_budget,
    openai_client_of,
    openai_http_client,
)
from zp_client.errors import ConfigurationError
from zp_client.sim.server import SimServer

pytestmark = [pytest.mark.openai_compat, pytest.mark.anyio]

SETTINGS = Settings(estimator="heuristic")


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"


@pytest.fixture(scope="module")
def server() -> Iterator[SimServer]:
    with SimServer(profile="tiny", speedup=10.0) as s:
        yield s


def granted(budget: LocalBudget) -> int:
    return int(budget.status_sync().extra["granted"])


def test_options_are_validated() -> None:
    budget = LocalBudget(limit_blocks=100)
    with pytest.raises(ConfigurationError, match="budget must be a zp_client Budget"):
        AdmissionOptions(budget="not a budget")  # type: ignore[arg-type]  # the point of the test
    with pytest.raises(ConfigurationError, match="deadline"):
        AdmissionOptions(budget=budget, deadline=0)
    with pytest.raises(ConfigurationError, match="max_retries"):
        AdmissionOptions(budget=budget, max_retries=-1)


def test_headers_are_the_zp_headers_of_the_options_given() -> None:
    budget = LocalBudget(limit_blocks=100)
    assert AdmissionOptions(budget=budget).headers() == {}
    assert AdmissionOptions(budget=budget, priority=2, deadline=30, route="planner").headers() == {
        PRIORITY_HEADER: "2", DEADLINE_HEADER: "30.0", ROUTE_HEADER: "planner"}


async def test_admit_gates_the_client_once_with_default_headers_and_max_retries(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test")
    opts = AdmissionOptions(budget=budget, settings=SETTINGS, priority=3, max_retries=2)
    admitted = opts.admit(raw)
    assert admitted is not raw and admitted_budget(admitted) is budget and admitted_budget(raw) is None
    assert admitted.default_headers[PRIORITY_HEADER] == "3" and admitted.max_retries == 2
    assert opts.admit(admitted) is admitted  # no second admission (two leases per call) on the same budget
    with pytest.raises(ConfigurationError, match="already admitted on another budget"):
        AdmissionOptions(budget=LocalBudget(limit_blocks=400)).admit(admitted)
    reply = await admitted.chat.completions.create(model=server.model, max_tokens=8,
                                                   messages=[{"role": "user", "content": "hi"}])
    assert reply.choices[0].message.content and granted(budget) == 1
    assert (await budget.status()).used == 0
    await admitted.close()
    await raw.close()


def test_without_max_retries_the_admitted_client_leaves_retrying_to_zp(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    with openai.OpenAI(base_url=server.base_url, api_key="sk-test") as raw:
        admitted = AdmissionOptions(budget=budget, settings=SETTINGS).admit(raw)
        assert admitted.max_retries == 0 and PRIORITY_HEADER not in admitted.default_headers
        admitted.chat.completions.create(model=server.model, max_tokens=8,
                                         messages=[{"role": "user", "content": "hi"}])
        assert granted(budget) == 1 and budget.status_sync().used == 0


async def test_openai_http_client_is_what_the_client_sends_through(server: SimServer) -> None:
    budget = LocalBudget(limit_blocks=400, policy="strict")
    raw = openai.AsyncOpenAI(base_url=server.base_url, api_key="sk-test")
    admitted = AdmissionOptions(budget=budget, settings=SETTINGS).admit(raw)
    http = openai_http_client(admitted)
    assert type(http).__module__.split(".")[0] in {"httpx", "httpx2"}
    seen: list[int] = []

    async def hook(response: Any) -> None:
        seen.append(response.status_code)

    hooks = http.event_hooks
    hooks["response"] = [*hooks["response"], hook]
    http.event_hooks = hooks
    await admitted.chat.completions.create(model=server.model, max_tokens=8,
                                           messages=[{"role": "user", "content": "hi"}])
    assert seen == [200] and granted(budget) == 1
    await admitted.close()
    await raw.close()


def test_openai_http_client_fails_loudly_when_the_layout_is_not_openais() -> None:
    with pytest.raises(ConfigurationError, match="expected an openai"):
        openai_http_client(object())
    client = openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-test")
    http = client.__dict__.pop("_client")  # what a release that moved it would look like
    try:
        with pytest.raises(ConfigurationError, match="has no '_client' attribute any more"):
            openai_http_client(client)
    finally:
        http.close()


def test_openai_client_of_a_resource_is_its_client() -> None:
    with openai.OpenAI(base_url="http://127.0.0.1:9/v1", api_key="sk-test") as client:
        assert openai_client_of(client.completions) is client
        assert openai_client_of(client.chat.completions) is client
        with pytest.raises(ConfigurationError, match="not an openai API resource"):
            openai_client_of(client)
