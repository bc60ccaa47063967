"""A repeat (zp_client._repeat: a retry from above zp of a call zp gave up on) is counted as a repeat in
``zp_repeats_total``, not as a new refusal in ``zp_refusals_total``: a refusal a framework retries twice is
one refusal and two repeats; an error answer replayed is a repeat by its status. Real openai client, a
loopback proxy that answers 503 (tests/_fail_proxy.py).

Marked ``openai_compat``: runs with openai 3.x (httpx2) and again with openai 2.x (httpx).
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from _fail_proxy import FailProxy
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from zp_client import LocalBudget, Settings, wrap
from zp_client.errors import LeaseTooLarge
from zp_client.metrics import ZPMetrics
from zp_client.retry import RetryPolicy, testing

pytestmark = [pytest.mark.openai_compat]

SETTINGS = Settings(estimator="heuristic", max_model_len=4096, pool_check=False)


@pytest.fixture(scope="module")
def proxy() -> Iterator[FailProxy]:
    with FailProxy() as p:
        yield p


def counts(m: ZPMetrics, name: str) -> dict[str, float]:
    text = generate_latest(m.registry).decode()
    return {s.labels["error"]: s.value for f in text_string_to_metric_families(text) for s in f.samples
            if s.name == name}


def test_a_replayed_refusal_and_answer_count_as_repeats_not_new_refusals(proxy: FailProxy) -> None:
    m = ZPMetrics()
    budget = LocalBudget(limit_blocks=8, policy="strict")
    client = wrap(openai.OpenAI(base_url=proxy.base_url, api_key="sk-test", max_retries=0), budget,
                  settings=SETTINGS, retry=RetryPolicy(budget=None), metrics=m)
    ask = {"model": "ok", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 1000}
    for _ in range(3):  # a framework's retry loop around one call: the same context, the same body
        with pytest.raises(LeaseTooLarge):
            client.chat.completions.create(**ask)
    assert counts(m, "zp_refusals_total") == {"LeaseTooLarge": 1}
    assert counts(m, "zp_repeats_total") == {"LeaseTooLarge": 2}
    with testing():
        for _ in range(2):
            with pytest.raises(openai.InternalServerError):
                client.chat.completions.create(**{**ask, "model": "fail-metrics", "max_tokens": 8})
    assert proxy.count("fail-metrics") == RetryPolicy().max_attempts  # the second call sent nothing
    assert counts(m, "zp_repeats_total") == {"LeaseTooLarge": 2, "http_503": 1}
    assert counts(m, "zp_refusals_total") == {"LeaseTooLarge": 1}
    assert budget.status_sync().used == 0
