"""Pydantic models of the OpenAI response shapes the drop-in client returns.

They mirror the ``openai`` package's names and fields (``ChatCompletion.choices[0].message.content``,
``ChatCompletionChunk.choices[0].delta.content``, ``tool_calls``, ``usage``...). Every model accepts and
keeps fields it does not declare (vLLM adds ``prompt_logprobs``, ``kv_transfer_params``, ...), reachable
as attributes and through ``model_dump()``. Missing optional fields default to None or empty.

Example::

    reply = await client.chat.completions.create(model="m", messages=[...])
    text = reply.choices[0].message.content
    calls = reply.choices[0].message.tool_calls or []
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

__all__ = [
    "ChatCompletion",
    "ChatCompletionChunk",
    "ChatCompletionMessage",
    "ChatCompletionMessageToolCall",
    "Choice",
    "ChoiceDelta",
    "ChoiceDeltaToolCall",
    "ChoiceDeltaToolCallFunction",
    "ChunkChoice",
    "Completion",
    "CompletionChoice",
    "Function",
    "FunctionCall",
    "Model",
    "ModelList",
    "Usage",
]


class _Base(BaseModel):
    model_config = ConfigDict(extra="allow", populate_by_name=True, protected_namespaces=())


class Usage(_Base):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0


class Function(_Base):
    """The function a tool call invokes. ``arguments`` is the JSON text the model produced."""

    name: str = ""
    arguments: str = ""

    def parsed_arguments(self) -> Any:
        """``arguments`` decoded from JSON (raises ``ValueError`` when the model produced invalid JSON)."""
        return json.loads(self.arguments) if self.arguments else {}


FunctionCall = Function  # the legacy ``function_call`` field has the same shape


class ChatCompletionMessageToolCall(_Base):
    id: str = ""
    type: str = "function"
    function: Function = Field(default_factory=Function)


class ChatCompletionMessage(_Base):
    role: str = "assistant"
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChatCompletionMessageToolCall] | None = None
    function_call: FunctionCall | None = None
    reasoning_content: str | None = None


class Choice(_Base):
    index: int = 0
    message: ChatCompletionMessage = Field(default_factory=ChatCompletionMessage)
    finish_reason: str | None = None
    logprobs: Any = None


class ChatCompletion(_Base):
    id: str = ""
    object: str = "chat.completion"
    created: int = 0
    model: str = ""
    choices: list[Choice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ChoiceDeltaToolCallFunction(_Base):
    """A piece of a streamed tool call: ``name`` arrives once, ``arguments`` in fragments to concatenate."""

    name: str | None = None
    arguments: str | None = None


class ChoiceDeltaToolCall(_Base):
    index: int = 0
    id: str | None = None
    type: str | None = None
    function: ChoiceDeltaToolCallFunction | None = None


class ChoiceDelta(_Base):
    role: str | None = None
    content: str | None = None
    refusal: str | None = None
    tool_calls: list[ChoiceDeltaToolCall] | None = None
    function_call: ChoiceDeltaToolCallFunction | None = None
    reasoning_content: str | None = None


class ChunkChoice(_Base):
    index: int = 0
    delta: ChoiceDelta = Field(default_factory=ChoiceDelta)
    finish_reason: str | None = None
    logprobs: Any = None


class ChatCompletionChunk(_Base):
    """One streamed event. The final usage-only chunk (``stream_options.include_usage``) has empty
    ``choices`` and a ``usage``."""

    id: str = ""
    object: str = "chat.completion.chunk"
    created: int = 0
    model: str = ""
    choices: list[ChunkChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class CompletionChoice(_Base):
    index: int = 0
    text: str = ""
    finish_reason: str | None = None
    logprobs: Any = None


class Completion(_Base):
    """A completions response, or (with ``stream=True``) one streamed event of one."""

    id: str = ""
    object: str = "text_completion"
    created: int = 0
    model: str = ""
    choices: list[CompletionChoice] = Field(default_factory=list)
    usage: Usage | None = None
    system_fingerprint: str | None = None


class Model(_Base):
    id: str
    object: str = "model"
    created: int = 0
    owned_by: str | None = None
    max_model_len: int | None = None


class ModelList(_Base):
    object: str = "list"
    data: list[Model] = Field(default_factory=list)

    def __iter__(self) -> Any:  # iterate models, like openai's page objects (Any: BaseModel yields pairs)
        return iter(self.data)
