"""Redis URLs without their secrets, for messages and status lines (docs/redis.md, "Credentials").

A Redis URL carries its password in the userinfo (``redis://:pw@host``) or in the query
(``?password=pw``, which redis-py reads too). Nothing zp prints, logs or raises shows either:
:func:`redact_url` masks both. A URL that cannot be read as one (a raw ``#``, ``/`` or ``?`` in a password
cuts it where the password goes on: ``redis://:pa#ss@host`` is host ``""``, port ``"pa"``, fragment
``"ss@host"``) is refused by :func:`check_redis_url` without echoing any of it, before redis-py's own
``ValueError`` could print a piece of the password.
"""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from zp_client.errors import ConfigurationError

__all__ = ["redact_url", "check_redis_url"]

MASK = "***"
# Query parameters whose value is never shown (redis-py reads ``password``; the others are common aliases).
_SECRET_PARAMS = frozenset({"password", "pass", "pwd", "auth", "token", "secret", "credential_provider"})


def redact_url(url: str) -> str:
    """``url`` with its password (userinfo or query) and any fragment masked; for a URL that cannot be
    parsed, only its scheme. Never raises."""
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError on a netloc a password cut short
    except ValueError:
        return _scheme_only(url)
    netloc = parts.netloc
    if "@" in netloc:
        userinfo, _, host = netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # A lone userinfo (redis://x@host) is a username to redis-py, but often meant as the password.
        netloc = f"{user if colon else ''}:{MASK}@{host}"
    query = parts.query
    if query:
        pairs = parse_qsl(query, keep_blank_values=True)
        query = urlencode([(k, MASK if k.lower() in _SECRET_PARAMS else v) for k, v in pairs], safe="*")
    fragment = MASK if parts.fragment else ""
    out = urlunsplit(parts._replace(netloc=netloc, query=query, fragment=fragment))
    if not netloc and url.startswith(f"{parts.scheme}://"):  # unix:///path: keep the empty authority
        out = f"{parts.scheme}://" + out[len(parts.scheme) + 1:]
    return out


def check_redis_url(url: str, what: str = "Redis URL") -> None:
    """Raise :class:`~zp_client.ConfigurationError` when ``url`` cannot be a Redis URL as meant: it has a
    fragment (a raw ``#``, which only a password can hold) or a port that is not a number (a raw ``/``,
    ``?`` or ``#`` in a password cuts the host there). The message never shows the URL's secret parts."""
    bad = False
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018
        bad = bool(parts.fragment) or url.endswith("#")
    except ValueError:
        bad = True
    if bad:
        raise ConfigurationError(
            f"{what} {_scheme_only(url)} cannot be read: a '#', '/', '?' or '@' in a password must be "
            "percent-encoded (%23, %2F, %3F, %40), e.g. redis://:pa%23ss@host:6379/0 (the URL is not "
            "shown: it may hold a password)")


def _scheme_only(url: str) -> str:
    scheme, sep, _ = url.partition("://")
    return f"{scheme}://…" if sep and scheme.isascii() and scheme.replace("+", "").isalnum() else "(a URL)"
