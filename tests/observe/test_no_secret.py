"""No Redis password in any output (issue 33, item 10): over the URL forms (userinfo, ``?password=``, a raw
``#`` or ``/`` in a password, ``rediss://``, a unix socket), ``zp-client status`` (text and ``--json``), a
``RedisBudget``'s errors (their ``str``, ``repr`` and formatted traceback) and every log record at DEBUG
show no piece of the password.

``?password=`` was printed as given; ``redis://:pa#ss@host`` ended in redis-py's ``ValueError: Port could not
be cast to integer value as 'pa'`` (a piece of the password) in a traceback.
"""

from __future__ import annotations

import logging
import traceback
import uuid
from collections.abc import Iterator

import pytest

from tests.conftest import _free_port
from zp_client import ConfigurationError, RedisBudget
from zp_client._redact import check_redis_url, redact_url
from zp_client.budget.redis_forecast import RedisLengthForecaster
from zp_client.cli import main

pytestmark = pytest.mark.redis

# Each password is made of pieces that must never show, even alone (a '#' or '/' cuts a URL there).
PIECES = ("hunter2xq", "zebra7kw")


def _forms(redis_url: str) -> list[tuple[str, str]]:
    """(id, URL) of every form, each holding PIECES; on the test Redis where a form can reach it."""
    hostport = redis_url.split("://", 1)[1].split("/", 1)[0]
    closed = f"127.0.0.1:{_free_port()}"
    sock = f"/tmp/zp-nosock-{uuid.uuid4().hex[:8]}.sock"
    a, b = PIECES
    return [
        ("userinfo", f"redis://:{a}{b}@{hostport}/0"),
        ("user-and-password", f"redis://default:{a}{b}@{closed}/0"),
        ("query", f"redis://{hostport}/0?password={a}{b}"),
        ("query-and-userinfo", f"redis://:{a}@{closed}/0?db=0&password={b}"),
        ("hash-in-password", f"redis://:{a}#{b}@{hostport}/0"),
        ("slash-in-password", f"redis://:{a}/{b}@{hostport}/0"),
        ("rediss", f"rediss://:{a}{b}@{closed}/0"),
        ("unix-socket", f"unix://{sock}?password={a}{b}&db=0"),
        ("unix-socket-userinfo", f"unix://:{a}{b}@{sock}"),
    ]


FORM_IDS = [i for i, _ in _forms("redis://127.0.0.1:6379/0")]


@pytest.fixture
def form(request: pytest.FixtureRequest, redis_url: str) -> Iterator[str]:
    yield dict(_forms(redis_url))[request.param]


def _clean(text: str, where: str) -> None:
    for piece in PIECES:
        assert piece not in text, f"a piece of the password in {where}: {text[:400]!r}"


@pytest.mark.parametrize("form", FORM_IDS, indirect=True)
@pytest.mark.parametrize("as_json", [False, True])
def test_status_prints_no_secret(form: str, as_json: bool, capsys: pytest.CaptureFixture[str],
                                 caplog: pytest.LogCaptureFixture) -> None:
    name = f"zptest-nosecret-{uuid.uuid4().hex[:8]}"  # never created: status is read-only
    caplog.set_level(logging.DEBUG)
    json_flag = ["--json"] if as_json else []
    rc = main(["status", "--redis", form, "--name", name, "--timeout", "0.5", *json_flag])
    out = capsys.readouterr()
    assert rc in (1, 2)  # the budget does not exist, or Redis refused / cannot be reached / bad URL
    _clean(out.out, "stdout")
    _clean(out.err, "stderr")
    _clean(caplog.text, "the log")
    for r in caplog.records:
        _clean(r.getMessage(), "a log record")


@pytest.mark.parametrize("form", FORM_IDS, indirect=True)
def test_budget_errors_hold_no_secret(form: str, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    name = f"zptest-nosecret-{uuid.uuid4().hex[:8]}"
    errors: list[BaseException] = []
    answered = None
    try:
        budget = RedisBudget(form, name, 0, unavailable_timeout_s=0.5)
    except Exception as exc:  # noqa: BLE001 - any error: its text is what is checked
        errors.append(exc)
    else:
        try:
            answered = budget.status_sync().extra.get("exists")
        except Exception as exc:  # noqa: BLE001
            errors.append(exc)
        finally:
            budget.close_sync()
    for exc in errors:
        _clean(str(exc), "str(error)")
        _clean(repr(exc), "repr(error)")
        _clean("".join(traceback.format_exception(exc)), "the traceback")
    _clean(caplog.text, "the log")
    # Each form either fails (nothing listening, a URL cut short: the error is checked) or reads the
    # test Redis (it has no password: redis-py's AUTH is then accepted) and finds no such budget.
    assert len(errors) == 1 or answered is False


@pytest.mark.parametrize("url", ["redis://:hunter2xq#zebra7kw@127.0.0.1:6379/0",
                                 "redis://:hunter2xq/zebra7kw@127.0.0.1:6379/0",
                                 "redis://:hunter2xq?zebra7kw@127.0.0.1:6379/0",
                                 "redis://:hunter2xq#"])
def test_a_url_a_password_cuts_short_is_a_configuration_error_that_shows_none_of_it(url: str) -> None:
    with pytest.raises(ConfigurationError) as bad:
        check_redis_url(url)
    _clean(str(bad.value), "the message")
    assert "%23" in str(bad.value)  # says how to write it
    with pytest.raises(ConfigurationError):
        RedisBudget(url, "zptest-never", 0)
    with pytest.raises(ConfigurationError):
        RedisLengthForecaster(url, "zptest-never")


def test_redact_url_masks_every_form_and_keeps_the_rest() -> None:
    assert redact_url("redis://:pw@h:6379/0") == "redis://:***@h:6379/0"
    assert redact_url("redis://u:pw@h:6379/0") == "redis://u:***@h:6379/0"
    assert redact_url("redis://h:6379/0?password=pw&db=2") == "redis://h:6379/0?password=***&db=2"
    assert redact_url("unix:///run/redis.sock?password=pw") == "unix:///run/redis.sock?password=***"
    assert redact_url("rediss://h:6380/0") == "rediss://h:6380/0"
    assert redact_url("redis://:pa#ss@h") == "redis://…"
    assert redact_url("redis://:pa%23ss@h") == "redis://:***@h"
