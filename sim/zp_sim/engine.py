"""A step-driven engine faithful to vLLM's V1 scheduler and KV cache manager, in virtual time.

Single-threaded and deterministic: the same calls give the same results. What it reproduces (block pool,
prefix cache, continuous batching, preemption) and its step semantics: see docs/simulator.md#the-engine
(and shared/VLLM_FACTS.md, shared/REPLAY.md).
"""

from __future__ import annotations

import heapq
import logging
import zlib
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

from zp_sim.profiles import StepProfile

__all__ = [
    "DEFAULT_STEP_TIME",
    "Engine",
    "EngineConfig",
    "EngineStats",
    "RequestRecord",
    "StepOutput",
    "output_token_id",
]

logger = logging.getLogger("zp_sim.engine")

#: Step duration (seconds) when the config has no profile: the fidelity references' fixed step.
DEFAULT_STEP_TIME = 0.02

#: Size of the id space synthesized output tokens are drawn from (Llama 3's vocabulary).
_VOCAB = 128_256
_MIX = 2_654_435_761  # Knuth's multiplicative constant: spreads consecutive positions


def output_token_id(request_id: str, position: int) -> int:
    """The deterministic id of the output token at ``position`` (0-based) of ``request_id``.

    Stable across processes (crc32, not Python's salted ``hash``); different requests get
    different sequences, so their output blocks hash differently.
    """
    seed = zlib.crc32(request_id.encode("utf-8"))
    return (seed + _MIX * (position + 1)) % _VOCAB


@dataclass
class EngineConfig:
    """Engine settings; field names and defaults follow vLLM's CacheConfig / SchedulerConfig."""

    num_gpu_blocks: int
    block_size: int = 16
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 8192
    max_model_len: int = 8192
    enable_prefix_caching: bool = True
    policy: Literal["fcfs", "priority"] = "fcfs"
    #: vLLM's ``scheduler_reserve_full_isl``: admit only if the whole current sequence fits.
    reserve_full_isl: bool = True
    #: Fraction of the pool a waiting request's admission must leave free (vLLM default 0).
    watermark: float = 0.0
    #: vLLM's ``long_prefill_token_threshold`` (0 = off): cap on a request's tokens per step.
    long_prefill_token_threshold: int = 0
    #: Step-time model; ``None`` means a fixed ``DEFAULT_STEP_TIME`` per step.
    profile: StepProfile | None = None
    #: Prefill/decode disaggregation (a decode engine's side of vLLM's NixlConnector): seconds to pull
    #: one KV block from a prefill engine (0: instant). See :meth:`Engine.add_request` ``remote_kv``.
    kv_transfer_s_per_block: float = 0.0

    @classmethod
    def from_profile(cls, profile: StepProfile, **overrides: Any) -> EngineConfig:
        """Config with the profile's pool and limits; keyword ``overrides`` replace any field."""
        base = cls(
            num_gpu_blocks=profile.num_gpu_blocks,
            block_size=profile.block_size,
            max_num_seqs=profile.max_num_seqs,
            max_num_batched_tokens=profile.max_num_batched_tokens,
            max_model_len=profile.max_model_len,
            profile=profile,
            kv_transfer_s_per_block=profile.kv_transfer_s_per_block,
        )
        return replace(base, **overrides)

    def validate(self) -> None:
        """Raise ``ValueError`` with a fix-it message for impossible settings."""
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_gpu_blocks < 2:
            raise ValueError(
                f"num_gpu_blocks must be >= 2 (block 0 is the null block), got {self.num_gpu_blocks}"
            )
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")
        if self.policy not in ("fcfs", "priority"):
            raise ValueError(f"policy must be 'fcfs' or 'priority', got {self.policy!r}")
        if not 0.0 <= self.watermark < 1.0:
            raise ValueError(f"watermark must be in [0, 1), got {self.watermark}")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0 (0 disables it)")
        if not self.kv_transfer_s_per_block >= 0:
            raise ValueError(f"kv_transfer_s_per_block must be >= 0, got {self.kv_transfer_s_per_block}")
        # vLLM refuses to start when one max_model_len sequence cannot fit in the KV cache;
        # the same check here guarantees a lone request can always be scheduled (no deadlock).
        need = -(-self.max_model_len // self.block_size)
        if need > self.num_gpu_blocks - 1:
            raise ValueError(
                f"max_model_len={self.max_model_len} needs {need} blocks of {self.block_size} tokens "
                f"but the pool has only {self.num_gpu_blocks - 1} usable blocks "
                f"(num_gpu_blocks={self.num_gpu_blocks} includes the null block); "
                "raise num_gpu_blocks or lower max_model_len"
            )


@dataclass
class StepOutput:
    """What one call to :meth:`Engine.step` did.

    ``step`` is ``None`` (and ``start_time == end_time``) when nothing was scheduled.
    ``new_tokens`` maps every scheduled request to the number of tokens it produced (0 for a
    partial prefill chunk, else 1). ``kv_usage``/``num_running``/``num_waiting`` are read after
    the step, once finished requests have freed their blocks.
    """

    step: int | None
    start_time: float
    end_time: float
    scheduled_tokens: int
    new_tokens: dict[str, int] = field(default_factory=dict)
    first_token: list[str] = field(default_factory=list)
    finished: list[str] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)
    kv_usage: float = 0.0
    num_running: int = 0
    num_waiting: int = 0
    #: tokens scheduled per request this step (prefill chunk or 1 for a decode)
    scheduled: dict[str, int] = field(default_factory=dict)
    #: the id of the token each request produced this step (only requests that produced one)
    token_ids: dict[str, int] = field(default_factory=dict)
    #: ``remote_kv`` requests admitted this step: their blocks are allocated, their KV is on its way
    kv_loading: list[str] = field(default_factory=list)
    #: ``remote_kv`` requests whose KV arrived (found at this step's start): the prefill side may free
    kv_loaded: list[str] = field(default_factory=list)


@dataclass
class EngineStats:
    """Counters and gauges, named after vLLM's Prometheus metrics (``vllm:...``)."""

    num_running: int
    num_waiting: int
    kv_usage: float
    preemptions_total: int
    recomputed_tokens: int
    prompt_tokens_total: int
    generation_tokens_total: int
    prefix_cache_queries_total: int
    prefix_cache_hits_total: int
    steps: int
    num_free_blocks: int
    num_gpu_blocks: int
    #: prefix-cache hit tokens over every admission, resumptions after preemption included
    cache_hit_tokens_all_admissions: int = 0
    #: P/D: blocks finished ``hold_kv`` requests keep for their decode side, and blocks pulled so far
    kv_held_blocks: int = 0
    kv_pulled_blocks_total: int = 0


@dataclass
class RequestRecord:
    """The life of one request; steps and times are ``None`` until they happen."""

    request_id: str
    prompt_tokens: int
    output_tokens: int
    priority: int
    arrival: float
    first_scheduled_step: int | None
    first_token_step: int | None
    first_token_time: float | None
    finish_step: int | None
    finish_time: float | None
    num_preemptions: int
    num_cached_tokens: int
    output_tokens_done: int
    recomputed_tokens: int
    finished: bool
    aborted: bool


class _Block:
    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev", "next")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: int | None = None
        self.prev: _Block | None = None
        self.next: _Block | None = None


class _FreeQueue:
    """Doubly linked list of free blocks (vLLM's FreeKVCacheBlockQueue): O(1) everywhere."""

    def __init__(self, blocks: list[_Block]) -> None:
        self.head = _Block(-1)
        self.tail = _Block(-1)
        self.head.next = self.tail
        self.tail.prev = self.head
        self.num_free = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> _Block:
        block = self.head.next
        if block is self.tail or block is None:
            raise RuntimeError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: _Block) -> None:
        prev, nxt = block.prev, block.next
        assert prev is not None and nxt is not None, "block is not in the free queue"
        prev.next = nxt
        nxt.prev = prev
        block.prev = block.next = None
        self.num_free -= 1

    def append(self, block: _Block) -> None:
        last = self.tail.prev
        assert last is not None
        last.next = block
        block.prev = last
        block.next = self.tail
        self.tail.prev = block
        self.num_free += 1

    def appendleft(self, block: _Block) -> None:
        first = self.head.next
        assert first is not None
        self.head.next = block
        block.prev = self.head
        block.next = first
        first.prev = block
        self.num_free += 1

    def ids(self) -> list[int]:
        """Block ids front to back (for tests; O(free blocks))."""
        out = []
        node = self.head.next
        while node is not None and node is not self.tail:
            out.append(node.block_id)
            node = node.next
        return out


class _BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool) -> None:
        self.blocks = [_Block(i) for i in range(num_blocks)]
        self.free = _FreeQueue(self.blocks)
        self.enable_caching = enable_caching
        # hash -> {block_id: block}; duplicates allowed, the first inserted is returned.
        self.cached: dict[int, dict[int, _Block]] = {}
        self.null_block = self.free.popleft()

    def get_cached(self, block_hash: int) -> _Block | None:
        entry = self.cached.get(block_hash)
        if not entry:
            return None
        return next(iter(entry.values()))

    def get_new_blocks(self, n: int) -> list[_Block]:
        if n > self.free.num_free:
            raise RuntimeError(f"cannot get {n} free blocks from the pool")
        out = []
        for _ in range(n):
            block = self.free.popleft()
            if block.block_hash is not None:
                self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def _evict(self, block: _Block) -> None:
        assert block.block_hash is not None
        entry = self.cached.get(block.block_hash)
        if entry is not None:
            entry.pop(block.block_id, None)
            if not entry:
                del self.cached[block.block_hash]
        block.block_hash = None

    def touch(self, blocks: Sequence[_Block]) -> None:
        for block in blocks:
            if block.ref_cnt == 0:
                self.free.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered: Sequence[_Block]) -> None:
        """Free in the given order; the first block freed is the first to be evicted."""
        for block in ordered:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self.free.append(block)
                else:
                    self.free.appendleft(block)

    def cache_block(self, block: _Block, block_hash: int) -> None:
        block.block_hash = block_hash
        self.cached.setdefault(block_hash, {})[block.block_id] = block


_WAITING, _RUNNING, _PREEMPTED, _FINISHED, _ABORTED = range(5)
# A remote_kv request's transfer (vLLM's WAITING_FOR_REMOTE_KVS): not yet, on its way, arrived.
_KV_NONE, _KV_LOADING, _KV_LOADED = range(3)


class _Request:
    __slots__ = (
        "request_id",
        "prompt_len",
        "tokens",
        "output_target",
        "output_ids",
        "seed",
        "priority",
        "arrival_time",
        "status",
        "num_computed",
        "hwm",
        "blocks",
        "num_cached_blocks",
        "block_hashes",
        "num_preemptions",
        "num_cached_tokens",
        "recomputed",
        "first_scheduled_step",
        "first_token_step",
        "first_token_time",
        "finish_step",
        "finish_time",
        "hold_kv",
        "remote_kv",
        "kv_state",
        "ready_at",
    )

    def __init__(
        self,
        request_id: str,
        prompt: list[int],
        output_target: int,
        output_ids: list[int] | None,
        priority: int,
        arrival_time: float,
    ) -> None:
        self.request_id = request_id
        self.prompt_len = len(prompt)
        self.tokens = prompt
        self.output_target = output_target
        self.output_ids = output_ids
        self.seed = zlib.crc32(request_id.encode("utf-8"))
        self.priority = priority
        self.arrival_time = arrival_time
        self.status = _WAITING
        self.num_computed = 0
        self.hwm = 0
        self.blocks: list[_Block] = []
        self.num_cached_blocks = 0
        self.block_hashes: list[int] = []
        self.num_preemptions = 0
        self.num_cached_tokens = -1
        self.recomputed = 0
        self.first_scheduled_step: int | None = None
        self.first_token_step: int | None = None
        self.first_token_time: float | None = None
        self.finish_step: int | None = None
        self.finish_time: float | None = None
        self.hold_kv = False
        self.remote_kv = False
        self.kv_state = _KV_NONE
        self.ready_at = 0.0

    # vLLM's Request.__lt__ for the priority queue: (priority, arrival_time, request_id).
    def __lt__(self, other: _Request) -> bool:
        return (self.priority, self.arrival_time, self.request_id) < (
            other.priority,
            other.arrival_time,
            other.request_id,
        )


class _Waiting:
    """vLLM's waiting queue: a deque under FCFS, a heap under the priority policy."""

    def __init__(self, policy: str) -> None:
        self.priority = policy == "priority"
        self.fcfs: deque[_Request] = deque()
        self.heap: list[_Request] = []

    def __len__(self) -> int:
        return len(self.heap) if self.priority else len(self.fcfs)

    def add(self, req: _Request) -> None:
        if self.priority:
            heapq.heappush(self.heap, req)
        else:
            self.fcfs.append(req)

    def prepend(self, req: _Request) -> None:
        # The priority queue has no "front": a preempted request re-enters by its own key.
        if self.priority:
            heapq.heappush(self.heap, req)
        else:
            self.fcfs.appendleft(req)

    def peek(self) -> _Request:
        return self.heap[0] if self.priority else self.fcfs[0]

    def pop(self) -> _Request:
        return heapq.heappop(self.heap) if self.priority else self.fcfs.popleft()

    def remove(self, req: _Request) -> None:
        if self.priority:
            self.heap.remove(req)
            heapq.heapify(self.heap)
        else:
            self.fcfs.remove(req)

    def ids(self) -> list[str]:
        if self.priority:
            return [r.request_id for r in sorted(self.heap)]
        return [r.request_id for r in self.fcfs]


class Engine:
    """vLLM V1's scheduler + KV cache manager + a fake model, stepped in virtual time.

    Drive it with :meth:`add_request`, :meth:`step` and :meth:`abort`; read :attr:`stats`,
    :meth:`request_record` and the returned :class:`StepOutput`. ``now`` is the virtual clock in
    seconds (the sum of step durations plus idle jumps); ``step_index`` is the number the next
    non-empty step will carry.
    """

    def __init__(self, config: EngineConfig) -> None:
        config.validate()
        self.config = config
        self.now = 0.0
        self.step_index = 0
        self._bs = config.block_size
        self._caching = config.enable_prefix_caching
        self._priority = config.policy == "priority"
        self._pool = _BlockPool(config.num_gpu_blocks, config.enable_prefix_caching)
        self._usable = config.num_gpu_blocks - 1
        self._watermark_blocks = int(config.watermark * config.num_gpu_blocks)
        self._requests: dict[str, _Request] = {}
        self._running: list[_Request] = []
        self._waiting = _Waiting(config.policy)
        self._preemptions = 0
        self._recomputed = 0
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._pc_queries = 0
        self._pc_hits = 0
        self._hits_all = 0
        self._steps = 0
        self._step_time = self._make_step_time(config.profile)
        self._held: dict[str, _Request] = {}  # hold_kv requests finished, blocks kept for the peer
        self._loading: dict[str, _Request] = {}  # remote_kv requests whose KV is on its way
        self._kv_pulled_blocks = 0

    @staticmethod
    def _make_step_time(profile: StepProfile | None) -> Callable[[int, float, int, int], float]:
        if profile is None:
            return lambda p, sq, dc, db: DEFAULT_STEP_TIME
        return profile.step_time

    # ----------------------------------------------------------------------------- requests

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        output_tokens: int,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
        output_token_ids: Sequence[int] | None = None,
        hold_kv: bool = False,
        remote_kv: bool = False,
    ) -> None:
        """Queue a request that will generate exactly ``output_tokens`` tokens.

        Prefill/decode disaggregation (vLLM's NixlConnector): ``hold_kv`` (a prefill engine's request,
        ``do_remote_decode``): when it finishes its blocks stay allocated, not freed to the prefix cache,
        until :meth:`free_held` (the decode side read them, aborted, or the lease expired).
        ``remote_kv`` (a decode engine's, ``do_remote_prefill``): its prompt's KV comes from a peer. The
        scheduler admits it FCFS when the whole prompt fits, allocates every prompt block, and pulls the
        blocks its own prefix cache lacks (``kv_transfer_s_per_block`` each) while it waits, skipped by
        the scheduler as vLLM's WAITING_FOR_REMOTE_KVS is; once they arrived it recomputes the last
        prompt token and produces the first output token. A preempted one recomputes locally.

        Generation also stops when the sequence reaches ``max_model_len`` (vLLM's length stop).
        ``output_token_ids`` optionally fixes the generated ids (at least ``output_tokens`` of
        them); otherwise :func:`output_token_id` supplies them. Raises ``ValueError`` for a
        duplicate id, an empty prompt, a prompt longer than ``max_model_len`` or
        ``output_tokens < 1``.
        """
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        prompt = list(prompt_token_ids)
        if not prompt:
            raise ValueError(f"request {request_id!r} has an empty prompt")
        if len(prompt) > self.config.max_model_len:
            raise ValueError(
                f"request {request_id!r}: prompt of {len(prompt)} tokens exceeds "
                f"max_model_len={self.config.max_model_len}"
            )
        if output_tokens < 1:
            raise ValueError(f"request {request_id!r}: output_tokens must be >= 1, got {output_tokens}")
        ids = None
        if output_token_ids is not None:
            ids = list(output_token_ids)
            if len(ids) < output_tokens:
                raise ValueError(
                    f"request {request_id!r}: {len(ids)} output_token_ids for {output_tokens} tokens"
                )
        req = _Request(
            request_id,
            prompt,
            output_tokens,
            ids,
            priority,
            self.now if arrival_time is None else arrival_time,
        )
        req.hold_kv = bool(hold_kv)
        req.remote_kv = bool(remote_kv)
        self._requests[request_id] = req
        self._waiting.add(req)

    def abort(self, request_id: str) -> bool:
        """Abort a waiting or running request and free its blocks now; ``False`` if not live (a finished
        ``hold_kv`` request's blocks: :meth:`free_held`)."""
        req = self._requests.get(request_id)
        if req is None or req.status in (_FINISHED, _ABORTED):
            return False
        if req.status == _RUNNING:
            self._running.remove(req)
        else:
            self._waiting.remove(req)
        self._loading.pop(request_id, None)
        self._free(req)
        req.status = _ABORTED
        req.finish_time = self.now
        return True

    def has_unfinished(self) -> bool:
        """True while any request is running or waiting (a transfer in flight included)."""
        return bool(self._running) or len(self._waiting) > 0

    def free_held(self, request_id: str) -> int:
        """Free a finished ``hold_kv`` request's blocks (to the prefix cache, as any finished request's);
        returns how many (0 if it holds none: unknown, not finished, or freed already)."""
        req = self._held.pop(request_id, None)
        if req is None:
            return 0
        n = len(req.blocks)
        self._free(req)
        return n

    def held_block_ids(self, request_id: str) -> list[int]:
        """The block ids a finished ``hold_kv`` request holds (empty if none)."""
        req = self._held.get(request_id)
        return [b.block_id for b in req.blocks] if req is not None else []

    @property
    def held_kv_ids(self) -> list[str]:
        """Finished ``hold_kv`` requests whose blocks are still held."""
        return list(self._held)

    @property
    def held_kv_blocks(self) -> int:
        return sum(len(r.blocks) for r in self._held.values())

    def next_kv_ready(self) -> float | None:
        """When the earliest transfer in flight completes (virtual s), or None: what an idle engine
        waits for (no step can be scheduled before it)."""
        return min((r.ready_at for r in self._loading.values()), default=None)

    @property
    def kv_pulled_blocks_total(self) -> int:
        """Blocks pulled from peers so far (``remote_kv`` requests' blocks missing from this cache)."""
        return self._kv_pulled_blocks

    def advance_idle(self, t: float) -> None:
        """Move the clock forward to ``t`` (no-op if ``t`` is not later than ``now``)."""
        if t > self.now:
            self.now = t

    def skip_to_step(self, k: int) -> None:
        """Idle jump of the step counter to ``k``; the clock advances one empty step per step.

        Used by step-indexed replays (REPLAY.md: an idle engine jumps to the next arrival).
        """
        if k > self.step_index:
            profile = self.config.profile
            per_step = DEFAULT_STEP_TIME if profile is None else profile.step_time(0, 0.0, 0, 0)
            self.now += (k - self.step_index) * per_step
            self.step_index = k

    def output_token_ids(self, request_id: str) -> list[int]:
        """The ids generated so far for ``request_id`` (KeyError if unknown)."""
        req = self._requests[request_id]
        return req.tokens[req.prompt_len :]

    def forget(self, request_id: str) -> None:
        """Drop the bookkeeping of a finished or aborted request (long-running servers)."""
        req = self._requests.get(request_id)
        if req is not None and req.status in (_FINISHED, _ABORTED):
            del self._requests[request_id]

    def cached_tokens(self, request_id: str) -> int:
        """Prefix-cache hit tokens at the request's first admission (0 before it; KeyError if unknown)."""
        return max(self._requests[request_id].num_cached_tokens, 0)

    def request_record(self, request_id: str) -> RequestRecord:
        """A snapshot of one request's life (KeyError if unknown or forgotten)."""
        r = self._requests[request_id]
        return RequestRecord(
            request_id=r.request_id,
            prompt_tokens=r.prompt_len,
            output_tokens=r.output_target,
            priority=r.priority,
            arrival=r.arrival_time,
            first_scheduled_step=r.first_scheduled_step,
            first_token_step=r.first_token_step,
            first_token_time=r.first_token_time,
            finish_step=r.finish_step,
            finish_time=r.finish_time,
            num_preemptions=r.num_preemptions,
            num_cached_tokens=max(r.num_cached_tokens, 0),
            output_tokens_done=len(r.tokens) - r.prompt_len,
            recomputed_tokens=r.recomputed,
            finished=r.status == _FINISHED,
            aborted=r.status == _ABORTED,
        )

    @property
    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self._running),
            num_waiting=len(self._waiting),
            kv_usage=self.kv_usage,
            preemptions_total=self._preemptions,
            recomputed_tokens=self._recomputed,
            prompt_tokens_total=self._prompt_tokens,
            generation_tokens_total=self._generation_tokens,
            prefix_cache_queries_total=self._pc_queries,
            prefix_cache_hits_total=self._pc_hits,
            steps=self._steps,
            num_free_blocks=self._pool.free.num_free,
            num_gpu_blocks=self.config.num_gpu_blocks,
            cache_hit_tokens_all_admissions=self._hits_all,
            kv_held_blocks=self.held_kv_blocks,
            kv_pulled_blocks_total=self._kv_pulled_blocks,
        )

    @property
    def allocated_blocks(self) -> int:
        """Blocks some request references now (running, or held for a KV transfer); cached blocks nobody
        references are free (vLLM)."""
        return self._usable - self._pool.free.num_free

    @property
    def kv_usage(self) -> float:
        """1 - free / (N - 1); cached blocks nobody references count as free (vLLM)."""
        return 1.0 - self._pool.free.num_free / self._usable

    @property
    def running_ids(self) -> list[str]:
        return [r.request_id for r in self._running]

    @property
    def waiting_ids(self) -> list[str]:
        """Waiting request ids in the order admission will consider them."""
        return self._waiting.ids()

    # ------------------------------------------------------------------------ KV management

    def _block_hash(self, req: _Request, i: int) -> int:
        """Chained hash of the request's i-th full block (computed once, kept on the request)."""
        hashes = req.block_hashes
        bs = self._bs
        tokens = req.tokens
        while len(hashes) <= i:
            j = len(hashes)
            parent = hashes[j - 1] if j else 0
            hashes.append(hash((parent, tuple(tokens[j * bs : (j + 1) * bs]))))
        return hashes[i]

    def _find_cache_hit(self, req: _Request) -> list[_Block]:
        """Longest run of cached full blocks, capped at num_tokens - 1 tokens."""
        max_blocks = (len(req.tokens) - 1) // self._bs
        hit: list[_Block] = []
        get = self._pool.get_cached
        for i in range(max_blocks):
            block = get(self._block_hash(req, i))
            if block is None:
                break
            hit.append(block)
        return hit

    def _num_blocks_to_allocate(self, req: _Request, num_tokens: int, hit: list[_Block]) -> int:
        bs = self._bs
        new = -(-num_tokens // bs) - len(hit) - len(req.blocks)
        evictable = 0
        for block in hit:
            if block.ref_cnt == 0:
                evictable += 1
        return max(new, 0) + evictable

    def _allocate(
        self,
        req: _Request,
        num_new: int,
        hit: list[_Block],
        full_sequence_must_fit: bool,
        watermark_blocks: int,
    ) -> bool:
        """vLLM's KVCacheManager.allocate_slots; False (and no change) if it does not fit."""
        mml = self.config.max_model_len
        total_computed = req.num_computed + len(hit) * self._bs
        free = self._pool.free.num_free
        if full_sequence_must_fit:
            full = min(len(req.tokens), mml)
            if self._num_blocks_to_allocate(req, full, hit) + watermark_blocks > free:
                return False
        need_slot = min(total_computed + num_new, mml)
        if self._num_blocks_to_allocate(req, need_slot, hit) + watermark_blocks > free:
            return False
        if hit:
            self._pool.touch(hit)
            req.blocks.extend(hit)
            req.num_cached_blocks = len(hit)
        k = -(-need_slot // self._bs) - len(req.blocks)
        if k > 0:
            req.blocks.extend(self._pool.get_new_blocks(k))
        if self._caching:
            self._cache_blocks(req, min(total_computed + num_new, len(req.tokens)))
        return True

    def _cache_blocks(self, req: _Request, num_tokens: int) -> None:
        num_full = num_tokens // self._bs
        if num_full <= req.num_cached_blocks:
            return
        blocks = req.blocks
        pool = self._pool
        for i in range(req.num_cached_blocks, num_full):
            pool.cache_block(blocks[i], self._block_hash(req, i))
        req.num_cached_blocks = num_full

    def _free(self, req: _Request) -> None:
        if req.blocks:
            self._pool.free_blocks(req.blocks[::-1])
        req.blocks = []
        req.num_cached_blocks = 0

    def _preempt(self, req: _Request) -> None:
        self._free(req)
        req.remote_kv = False  # a preempted remote_kv request recomputes its prompt here (vLLM)
        req.kv_state = _KV_NONE
        req.status = _PREEMPTED
        req.num_computed = 0
        req.num_preemptions += 1
        self._preemptions += 1
        self._waiting.prepend(req)

    # ---------------------------------------------------------------------------- the step

    def step(self) -> StepOutput:
        """Run one scheduling iteration and the fake forward pass.

        Returns an empty output (``step is None``, clock unchanged) if nothing could be
        scheduled, e.g. when nothing is running or waiting. An iteration that only preempted
        (the last running request preempted itself) schedules nothing; vLLM's engine then simply
        schedules again, at no model cost, so this method does the same and reports those
        preemptions in the output of the step that follows.
        """
        carried: list[str] = []
        while True:
            out = self._step_once()
            if out.step is not None or not out.preempted:
                if carried:
                    out.preempted = carried + out.preempted
                return out
            # Each preempt-only iteration removes a running request: this loop terminates.
            carried.extend(out.preempted)

    def _step_once(self) -> StepOutput:
        cfg = self.config
        start = self.now
        budget = cfg.max_num_batched_tokens
        threshold = cfg.long_prefill_token_threshold
        mml = cfg.max_model_len
        running = self._running
        bs = self._bs
        caching = self._caching
        scheduled: dict[str, int] = {}
        sched_reqs: dict[str, _Request] = {}
        preempted: list[_Request] = []

        # 1. Running requests first, in order.
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            n = len(req.tokens) - req.num_computed
            if 0 < threshold < n:
                n = threshold
            n = min(n, budget, mml - 1 - req.num_computed)
            if n <= 0:
                i += 1
                continue
            # Fast path (most decodes): the held blocks already cover the new tokens.
            if req.num_computed + n <= len(req.blocks) * bs:
                if caching:
                    upto = min(req.num_computed + n, len(req.tokens))
                    if upto // bs > req.num_cached_blocks:
                        self._cache_blocks(req, upto)
                scheduled[req.request_id] = n
                sched_reqs[req.request_id] = req
                budget -= n
                i += 1
                continue
            ok = False
            while True:
                if self._allocate(req, n, [], False, 0):
                    ok = True
                    break
                if self._priority:
                    victim = max(running, key=lambda r: (r.priority, r.arrival_time))
                    running.remove(victim)
                    if victim.request_id in scheduled:
                        budget += scheduled.pop(victim.request_id)
                        del sched_reqs[victim.request_id]
                        i -= 1
                else:
                    victim = running.pop()
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if not ok:
                break
            scheduled[req.request_id] = n
            sched_reqs[req.request_id] = req
            budget -= n
            i += 1

        # 2. Waiting requests, only if nothing was preempted; stop at the first that won't fit.
        new_hits: dict[str, int] = {}
        kv_loading: list[str] = []
        kv_loaded: list[str] = []
        skipped: list[_Request] = []
        if not preempted:
            waiting = self._waiting
            while len(waiting) and budget > 0:
                if len(running) >= cfg.max_num_seqs:
                    break
                req = waiting.peek()
                if req.remote_kv and req.kv_state != _KV_NONE:
                    if req.kv_state == _KV_LOADING:
                        if req.ready_at > start:  # still on its way: skipped, as vLLM skips it
                            skipped.append(waiting.pop())
                            continue
                        # arrived: cached now; the last prompt token is recomputed for the first output
                        self._loading.pop(req.request_id, None)
                        req.kv_state = _KV_LOADED
                        req.num_computed = req.prompt_len - 1
                        if self._caching:
                            self._cache_blocks(req, req.prompt_len)
                        kv_loaded.append(req.request_id)
                    n = min(len(req.tokens) - req.num_computed, budget)
                    wm = self._watermark_blocks if running else 0
                    if not self._allocate(req, n, [], False, wm):
                        break
                    waiting.pop()
                    running.append(req)
                    req.status = _RUNNING
                    scheduled[req.request_id] = n
                    sched_reqs[req.request_id] = req
                    budget -= n
                    continue
                hit = self._find_cache_hit(req) if self._caching else []
                if req.remote_kv and req.status == _WAITING:
                    # do_remote_prefill: the whole prompt must fit; its KV is pulled, not computed
                    wm = self._watermark_blocks if running else 0
                    if (self._num_blocks_to_allocate(req, len(req.tokens), hit) + wm
                            > self._pool.free.num_free):
                        break
                    if hit:
                        self._pool.touch(hit)
                        req.blocks.extend(hit)
                        req.num_cached_blocks = len(hit)
                    k = -(-len(req.tokens) // self._bs) - len(req.blocks)
                    if k > 0:
                        req.blocks.extend(self._pool.get_new_blocks(k))
                    num_hit = len(hit) * self._bs
                    req.num_computed = num_hit
                    req.num_cached_tokens = num_hit
                    if self._caching:
                        self._pc_queries += len(req.tokens)
                        self._pc_hits += num_hit
                    self._hits_all += num_hit
                    missing = max(0, -(-req.prompt_len // self._bs) - len(hit))
                    self._kv_pulled_blocks += missing
                    req.kv_state = _KV_LOADING
                    req.ready_at = start + missing * cfg.kv_transfer_s_per_block
                    if req.first_scheduled_step is None:
                        req.first_scheduled_step = self.step_index
                    self._loading[req.request_id] = req
                    kv_loading.append(req.request_id)
                    skipped.append(waiting.pop())
                    continue
                num_hit = len(hit) * self._bs
                n = len(req.tokens) - num_hit
                if 0 < threshold < n:
                    n = threshold
                n = min(n, budget)
                wm = self._watermark_blocks if running else 0
                if not self._allocate(req, n, hit, cfg.reserve_full_isl, wm):
                    break
                waiting.pop()
                running.append(req)
                req.num_computed = num_hit
                self._hits_all += num_hit
                if self._caching and req.status == _WAITING:
                    # vLLM's PrefixCacheStats counts first admissions only (not resumptions).
                    self._pc_queries += len(req.tokens)
                    self._pc_hits += num_hit
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_hit
                req.status = _RUNNING
                if req.first_scheduled_step is None:
                    req.first_scheduled_step = self.step_index
                scheduled[req.request_id] = n
                sched_reqs[req.request_id] = req
                new_hits[req.request_id] = num_hit
                budget -= n
            for req in reversed(skipped):  # transfers in flight keep their places in line
                waiting.prepend(req)

        if not scheduled:
            return StepOutput(
                step=None,
                start_time=start,
                end_time=start,
                scheduled_tokens=0,
                preempted=[r.request_id for r in preempted],
                kv_usage=self.kv_usage,
                num_running=len(running),
                num_waiting=len(self._waiting),
                kv_loading=kv_loading,
                kv_loaded=kv_loaded,
            )

        # 3. The step's duration from the batch composition.
        prefill_tokens = 0
        prefill_sq = 0.0
        decode_ctx = 0
        decode_batch = 0
        total = 0
        for rid, n in scheduled.items():
            req = sched_reqs[rid]
            c = req.num_computed
            total += n
            if n == 1 and c == len(req.tokens) - 1 and c >= req.prompt_len:
                decode_ctx += c + 1
                decode_batch += 1
            else:
                prefill_tokens += n
                prefill_sq += n * (c + n)
        end = start + self._step_time(prefill_tokens, prefill_sq, decode_ctx, decode_batch)
        step_no = self.step_index

        # 4. Fake forward pass: advance computed tokens, sample where the prefill completes.
        out = StepOutput(
            step=step_no,
            start_time=start,
            end_time=end,
            scheduled_tokens=total,
            preempted=[r.request_id for r in preempted],
            scheduled=dict(scheduled),
            kv_loading=kv_loading,
            kv_loaded=kv_loaded,
        )
        new_tokens = out.new_tokens
        token_ids = out.token_ids
        finished: list[_Request] = []
        for rid, n in scheduled.items():
            req = sched_reqs[rid]
            c = req.num_computed
            if c < req.hwm:
                rec = min(c + n, req.hwm) - c
                req.recomputed += rec
                self._recomputed += rec
            c += n
            req.num_computed = c
            if c > req.hwm:
                req.hwm = c
            if c < len(req.tokens):
                new_tokens[rid] = 0  # partial prefill chunk: the sampled token is discarded
                continue
            pos = len(req.tokens) - req.prompt_len
            ids = req.output_ids
            tok = ids[pos] if ids is not None else (req.seed + _MIX * (pos + 1)) % _VOCAB
            req.tokens.append(tok)
            token_ids[rid] = tok
            new_tokens[rid] = 1
            self._generation_tokens += 1
            if req.first_token_step is None:
                req.first_token_step = step_no
                req.first_token_time = end
                self._prompt_tokens += req.prompt_len
                out.first_token.append(rid)
            if pos + 1 >= req.output_target or len(req.tokens) >= mml:
                finished.append(req)

        if finished:
            for req in finished:
                req.status = _FINISHED
                req.finish_step = step_no
                req.finish_time = end
                if req.hold_kv:
                    self._held[req.request_id] = req  # kept for the decode side (free_held)
                else:
                    self._free(req)
                out.finished.append(req.request_id)
            done = set(out.finished)
            self._running = running = [r for r in running if r.request_id not in done]

        self.now = end
        self.step_index = step_no + 1
        self._steps += 1
        out.kv_usage = self.kv_usage
        out.num_running = len(running)
        out.num_waiting = len(self._waiting)
        return out
