"""The simulator's own tokenizer: deterministic, prefix-stable, fast, and deliberately *not* cl100k.

It counts like a Llama-3-style tokenizer (close to cl100k per text, not equal) without a vocabulary file
and without tiktoken, so the judge shares nothing with the client it judges. ``render_chat`` is the one
chat template behind both ``/tokenize`` and ``/v1/chat/completions``. How it works, what callers may
rely on and its measured ratio to cl100k: see docs/simulator.md#the-tokenizer.
"""

from __future__ import annotations

import functools
import hashlib
import json
import random
import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

__all__ = [
    "BOS",
    "EOT",
    "RATIO_MEDIAN_RANGE",
    "RATIO_RANGE",
    "SPECIAL_TOKENS",
    "VOCAB_SIZE",
    "WORDS",
    "SimTokenizer",
    "count_chat_tokens",
    "count_tokens",
    "decode",
    "encode",
    "make_text",
    "render_chat",
    "token_text",
]

#: Ids below this are ordinary tokens; Llama 3's special tokens sit at 128000 and above.
VOCAB_SIZE = 128_000
BOS = "<|begin_of_text|>"
EOT = "<|eot_id|>"
SPECIAL_TOKENS: dict[str, int] = {
    BOS: 128000,
    "<|end_of_text|>": 128001,
    "<|start_header_id|>": 128006,
    "<|end_header_id|>": 128007,
    "<|eom_id|>": 128008,
    EOT: 128009,
    "<|python_tag|>": 128010,
}
_SPECIAL_BY_ID = {v: k for k, v in SPECIAL_TOKENS.items()}

#: Documented spread of per-text ratio (sim tokens / cl100k tokens) for texts of >= 200 cl100k tokens.
RATIO_RANGE = (0.80, 1.25)
#: Where the median of that ratio over a mixed corpus lies.
RATIO_MEDIAN_RANGE = (0.92, 1.08)

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")

# Shaped like cl100k's pre-tokenizer, in stdlib ``re`` syntax ([^\W\d_] is "a letter").
_PIECE_RE = re.compile(
    r"""'(?i:[sdmt]|ll|ve|re)"""  # contractions
    r"""|(?:[^\r\n\w]|_)?[^\W\d_]+"""  # a word, with one leading space/punctuation char
    r"""|\d{1,3}"""  # numbers in runs of at most 3 digits
    r"""| ?[^\s\w]+[\r\n]*"""  # punctuation runs
    r"""|\s*[\r\n]"""  # newlines (with the indentation before them)
    r"""|\s+(?!\S)"""  # whitespace not followed by a word
    r"""|\s|_"""
)


def _digest(piece: str, n: int, salt: int = 0) -> bytes:
    return hashlib.blake2b(piece.encode("utf-8"), digest_size=min(64, max(8, 4 * n)),
                           salt=salt.to_bytes(16, "little")).digest()


def _piece_count(piece: str, h: int) -> int:
    """How many tokens one pre-split piece costs. ``h`` is a stable 32-bit hash of the piece."""
    core = piece.lstrip(" ")
    if not core:
        return 1
    first = core[0]
    if first.isalpha() or (len(core) > 1 and core[1].isalpha()):
        if not core.isascii():
            # non-Latin scripts: roughly one token per 2-3 characters, as in BPE vocabularies
            return max(1, (len(core) + 1 + (h & 1)) // 3)
        # A vocabulary holds the common short words whole; longer words split into 3-5 char chunks.
        # Which words count as "in the vocabulary" is decided by the hash, so texts differ.
        threshold = 6 + (h % 6)  # 6..11 characters fit in one token
        if len(core) <= threshold:
            extra = 1 if (h >> 8) % 17 == 0 and len(core) > 3 else 0  # the odd rare short word
            return 1 + extra
        chunk = 4 + ((h >> 4) % 3)  # 4..6
        return 1 + -(-(len(core) - threshold) // chunk)
    if first.isdigit():
        return 1
    if core.isspace():
        # Runs of spaces/newlines: mostly one token, long indentation runs two.
        return 1 if len(piece) <= 8 + (h % 9) else 2
    # punctuation runs: short ones are single tokens, long ones split
    run = len(core.rstrip("\r\n"))
    return 1 if run <= 2 + (h % 2) else -(-run // (3 + (h % 2)))


# Memo of piece -> ids. A plain dict is markedly faster than lru_cache on this hot path; it is
# cleared when it grows past _MEMO_MAX (pieces repeat heavily in real prompts, so it stays small).
_MEMO: dict[str, tuple[int, ...]] = {}
_MEMO_MAX = 1 << 18


def _encode_piece(piece: str) -> tuple[int, ...]:
    h = int.from_bytes(hashlib.blake2b(piece.encode("utf-8"), digest_size=4).digest(), "little")
    n = _piece_count(piece, h)
    ids: list[int] = []
    salt = 0
    while len(ids) < n:
        d = _digest(piece, n - len(ids), salt)
        ids.extend(int.from_bytes(d[i:i + 4], "little") % VOCAB_SIZE for i in range(0, len(d), 4))
        salt += 1
    out = tuple(ids[:n])
    if len(_MEMO) >= _MEMO_MAX:
        _MEMO.clear()
    _MEMO[piece] = out
    return out


def encode(text: str, *, add_special_tokens: bool = False) -> list[int]:
    """Token ids of ``text`` (special-token strings become their single ids).

    ``add_special_tokens`` prepends ``<|begin_of_text|>`` as Llama 3's tokenizer does for a plain
    completion prompt (vLLM's default for ``/v1/completions`` and the completion form of ``/tokenize``).
    """
    out: list[int] = [SPECIAL_TOKENS[BOS]] if add_special_tokens else []
    extend = out.extend
    memo_get = _MEMO.get
    for i, part in enumerate(_SPECIAL_RE.split(text)):
        if i % 2:  # a special token
            out.append(SPECIAL_TOKENS[part])
        elif part:
            for piece in _PIECE_RE.findall(part):
                ids = memo_get(piece)
                extend(ids if ids is not None else _encode_piece(piece))
    return out


def count_tokens(text: str, *, add_special_tokens: bool = False) -> int:
    """``len(encode(text, add_special_tokens=...))``."""
    return len(encode(text, add_special_tokens=add_special_tokens))


_CONS = "bcdfghjklmnprstvwz"
_VOW = "aeiou"
_SYL = [c + v for c in _CONS for v in _VOW]  # 90 syllables


@functools.lru_cache(maxsize=1 << 16)
def token_text(token_id: int) -> str:
    """The text of one id in the synthetic vocabulary (a stable pseudo-word with a leading space).

    Raises ``ValueError`` for an id outside the vocabulary.
    """
    if token_id in _SPECIAL_BY_ID:
        return _SPECIAL_BY_ID[token_id]
    if not 0 <= token_id < VOCAB_SIZE:
        raise ValueError(f"token id {token_id} is out of vocabulary range [0, {VOCAB_SIZE})")
    a, rest = token_id % 90, token_id // 90
    b, c = rest % 90, rest // 90
    word = _SYL[a] + _SYL[b] + (_SYL[c % 90] if c else "")
    # every 11th id is punctuation-like so generated text has sentences
    if token_id % 11 == 0:
        return "."
    if token_id % 17 == 0:
        return ","
    return " " + word


def decode(ids: Iterable[int]) -> str:
    """Text for ``ids`` in the synthetic vocabulary (not the inverse of ``encode``; outputs only)."""
    return "".join(token_text(int(i)) for i in ids)


def _content_text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, Sequence):
        parts: list[str] = []
        for part in content:
            if isinstance(part, Mapping):
                if part.get("type") == "text":
                    parts.append(str(part.get("text", "")))
                elif part.get("type") in ("image_url", "input_image", "image"):
                    parts.append("<|image|>")
                elif "text" in part:
                    parts.append(str(part["text"]))
            elif isinstance(part, str):
                parts.append(part)
        return "".join(parts)
    return str(content)


_TOOLS_PREAMBLE = (
    "Given the following functions, please respond with a JSON for a function call with its proper "
    "arguments that best answers the given prompt.\n\n"
    'Respond in the format {"name": function name, "parameters": dictionary of argument name and its '
    "value}. Do not use variables.\n\n"
)


def _header(role: str) -> str:
    return f"<|start_header_id|>{role}<|end_header_id|>\n\n"


def render_chat(
    messages: Sequence[Mapping[str, Any]],
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
) -> str:
    """Render a conversation with a Llama-3.1-style chat template (the text the server tokenizes).

    Each message is ``<|start_header_id|>ROLE<|end_header_id|>\\n\\nCONTENT<|eot_id|>`` after a single
    ``<|begin_of_text|>``; role ``tool`` renders as ``ipython``; an assistant message carrying
    ``tool_calls`` renders them as ``{"name": ..., "parameters": ...}`` JSON; ``tools`` (OpenAI format)
    are inserted, as JSON, at the start of the first user message, as Llama 3.1's template does.
    Raises ``ValueError`` for a message without a role.
    """
    out = [BOS]
    tools_pending = bool(tools)
    if tools:
        out.append(_header("system") + "Environment: ipython\n")
        # a leading system message is merged into this block, as Llama 3.1 does
        if messages and messages[0].get("role") in ("system", "developer"):
            out.append("\n" + _content_text(messages[0].get("content")).strip())
            messages = messages[1:]
        out.append(EOT)
    for msg in messages:
        role = msg.get("role")
        if not isinstance(role, str):
            raise ValueError("every message needs a 'role' string")
        if role == "developer":
            role = "system"
        text = _content_text(msg.get("content")).strip()
        calls = msg.get("tool_calls") or []
        if role == "assistant" and calls:
            rendered = []
            for call in calls:
                fn = call.get("function", {}) if isinstance(call, Mapping) else {}
                args = fn.get("arguments", "{}")
                try:
                    params = json.loads(args) if isinstance(args, str) else args
                except ValueError:
                    params = args
                rendered.append(json.dumps({"name": fn.get("name"), "parameters": params}))
            text = (text + "\n" if text else "") + "\n".join(rendered)
        if role == "tool":
            role = "ipython"
        if role == "user" and tools_pending:
            schema = "".join(json.dumps(t, indent=4) + "\n\n" for t in tools or ())
            text = _TOOLS_PREAMBLE + schema + text
            tools_pending = False
        out.append(_header(role) + text + EOT)
    if add_generation_prompt:
        out.append(_header("assistant"))
    return "".join(out)


class SimTokenizer:
    """Object form of the module functions, for code that wants a tokenizer handle."""

    vocab_size = VOCAB_SIZE + 256
    bos_token_id = SPECIAL_TOKENS[BOS]
    eot_token_id = SPECIAL_TOKENS[EOT]

    def encode(self, text: str, *, add_special_tokens: bool = False) -> list[int]:
        return encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: Iterable[int]) -> str:
        return decode(ids)

    def render_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> str:
        return render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt)

    def encode_chat(self, messages: Sequence[Mapping[str, Any]], *,
                    tools: Sequence[Mapping[str, Any]] | None = None,
                    add_generation_prompt: bool = True) -> list[int]:
        """Token ids of the rendered chat (the template already holds ``<|begin_of_text|>``)."""
        return encode(render_chat(messages, tools=tools, add_generation_prompt=add_generation_prompt))


# --------------------------------------------------------------------------------------- text

# Short common words: one token each under the simulator's tokenizer (words of <= 6 letters), so
# text length in tokens is easy to steer. A leading tag keeps every prompt unique from its first block,
# which keeps the prefix cache from hitting between requests that should not share anything.
_WORD_TEXT = (
    "the of and to in is it for on with as was at by be this are or from an but not have had his they "
    "you were her she all there can one been would if will more when which their said so what about out "
    "up them into some time could than other then its two first may only new over also any after our "
    "most way made where very well back just much good did how each first file code test call read "
    "write value error line list name type data path user tool task step plan fix run check build"
)
#: The words :func:`make_text` draws from.
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())



def count_chat_tokens(messages: Sequence[Mapping[str, Any]]) -> int:
    """Prompt tokens of ``messages`` exactly as the simulator counts them (its chat template)."""
    return len(encode(render_chat(messages)))


def make_text(n_tokens: int, rng: random.Random, tag: str = "") -> str:
    """Text of about ``n_tokens`` simulator tokens (within a few tokens), starting with ``tag``: words
    drawn from :data:`WORDS` by ``rng`` (the storm's prompts, and the tests' own)."""
    count = count_tokens
    head = f"[{tag}]" if tag else ""
    if n_tokens <= 0:
        return head
    words: list[str] = [rng.choice(WORDS) for _ in range(max(1, n_tokens))]
    # one word is about one token; trim or extend until the measured count lands on the target
    text = head + " " + " ".join(words)
    for _ in range(4):
        c = count(text)
        if abs(c - n_tokens) <= 2:
            break
        if c > n_tokens:
            words = words[: max(1, len(words) - (c - n_tokens))]
        else:
            words.extend(rng.choice(WORDS) for _ in range(n_tokens - c))
        text = head + " " + " ".join(words)
    return text
