"""Output-length forecasts for the elastic policy: an online distribution per key, with a prior.

Learns true output lengths (``usage.completion_tokens``) per key (a model name or a route) and answers
*conditional* quantiles: given ``g`` tokens so far, the ``x`` with ``P(L <= x | L > g) = q``.
Representation, decay and the prior: see docs/elastic.md#the-forecaster.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from zp_client.errors import ConfigurationError

__all__ = [
    "BUCKET_RATIO", "DEFAULT_CENSORED", "DEFAULT_COLD_N", "DEFAULT_MAX_KEYS", "DEFAULT_Q", "DEFAULT_Q_BLIND",
    "DEFAULT_Q_SPREAD", "DEFAULT_Q_TAIL", "LengthForecaster", "LengthHistogram", "Prior",
]

BUCKET_RATIO = 1.15

#: Default quantile for a lease whose growth the client sees (a stream). Chosen by measurement on the
#: storm: the elastic policy sums one forecast per live lease, and a sum of per-lease 0.9 quantiles is far
#: above the 0.9 quantile of the sum, so q=0.9 over-reserved (TTFT p50 1.5x no-admission on ``agentic``,
#: benchmarks/elastic_frontier.py). The median (0.5, the default until issue 30) ran short under overload:
#: when one route mixes short calls and long streams, every long stream admitted together is forecast at the
#: short calls' median and they outgrow it together (seed-burst at 2x: 30 streams of 1,024 tokens took the
#: pool from the 0.90 limit to 0.999 and preempted once, on 2 of 4 seeds). 0.7 with the 0.90 headroom held
#: 0 preemptions at every load up to 4x (docs/elastic.md#the-reserve-under-overload,
#: benchmarks/reserve_overload.py); the tail beyond it is carried by the headroom and by re-forecasting
#: (a stream that reaches its forecast is re-forecast given its length so far, and admission tightens).
DEFAULT_Q = 0.7

#: Default quantile for a lease whose growth the client cannot see (non-streamed, or n > 1): nothing
#: corrects its forecast before it completes, so it keeps the safer quantile.
DEFAULT_Q_BLIND = 0.9
#: Default quantile for re-forecasting a stream that reached its forecast and goes on. Such a stream is
#: in the tail of its distribution, where output lengths are the most uncertain (with the heavy tails of
#: LLM outputs, having outlived the median makes a long remainder likelier, not less likely), and where
#: several leases outgrowing their medians at once is what overflows the pool. See docs/elastic.md, "The
#: defaults and why", for the measurement that chose it.
DEFAULT_Q_TAIL = 0.5
#: Quantile of :meth:`LengthForecaster.spread`: a stream's upper forecast, sent with its lease as
#: ``forecast_hi`` so that an elastic policy with a spread-sized reserve (``ElasticPolicy(reserve_z=...)``)
#: can size the pool's reserve from the live leases' forecast uncertainty (docs/elastic.md).
DEFAULT_Q_SPREAD = 0.9
#: Default of :class:`LengthForecaster`'s ``censored`` (on since issue 30; docs/elastic.md#censored-lengths):
#: a completion that ended at its ``max_tokens`` is read as censored (the request would have gone on),
#: and a route where at least ``1 - q`` of the weight ended so forecasts a request at its bound. A histogram
#: of such lengths read as exact forecasts every stream of a generation-bound route short at once: the
#: correlated error the flat reserve (the 0.90 headroom before issue 30) had to cover.
DEFAULT_CENSORED = True
#: Default of :class:`LengthForecaster`'s ``cold_n``: a route's requests are forecast at their
#: ``max_tokens`` until it has this many observations (its first leases are reserved as ``strict`` would,
#: so a burst before the first completion cannot outgrow a prior; docs/elastic.md#censored-lengths).
DEFAULT_COLD_N = 10
#: Most keys (routes) a forecaster keeps a histogram for; the least recently used goes first.
DEFAULT_MAX_KEYS = 1000
_MAX_LEN = 1 << 20
# Bucket edges: [0, 1), [1, 2), then geometric. Edge i is the lower bound of bucket i.
_EDGES: list[float] = [0.0, 1.0]
while _EDGES[-1] < _MAX_LEN:
    _EDGES.append(max(_EDGES[-1] + 1.0, _EDGES[-1] * BUCKET_RATIO))
_NB = len(_EDGES) - 1
_LOG_RATIO = math.log(BUCKET_RATIO)


def _bucket(x: float) -> int:
    if x < 1:
        return 0
    # Geometric edges after the first few unit-width ones: start from the log guess, then correct.
    i = min(_NB - 1, max(1, int(math.log(x) / _LOG_RATIO)))
    while i > 0 and _EDGES[i] > x:
        i -= 1
    while i < _NB - 1 and _EDGES[i + 1] <= x:
        i += 1
    return i


@dataclass(frozen=True)
class Prior:
    """A lognormal prior over output lengths: ``median`` tokens, log-space ``sigma``, ``weight``
    pseudo-observations."""

    median: float = 256.0
    sigma: float = 1.2
    weight: float = 20.0

    def masses(self) -> list[float]:
        mu = math.log(self.median)
        out = []
        for i in range(_NB):
            lo, hi = _EDGES[i], _EDGES[i + 1]
            c_lo = 0.0 if lo <= 0 else _norm_cdf((math.log(lo) - mu) / self.sigma)
            c_hi = _norm_cdf((math.log(hi) - mu) / self.sigma)
            out.append((c_hi - c_lo) * self.weight)
        return out


def _norm_cdf(z: float) -> float:
    return 0.5 * (1.0 + math.erf(z / math.sqrt(2.0)))


class LengthHistogram:
    """Decaying counts over log-spaced buckets. Not thread-safe (the forecaster locks)."""

    __slots__ = ("counts", "total", "observations", "capped", "seen", "base", "_scale", "_decay")

    def __init__(self, prior: Prior | None, half_life: float | None) -> None:
        self.counts = prior.masses() if prior is not None else [0.0] * _NB
        self.total = sum(self.counts)
        self.observations = 0
        self.capped = 0.0
        """Decayed weight of this process's observations that ended at their ``max_tokens``
        (right-censored: the request would have gone on), on the same scale as ``counts``."""
        self.seen = 0.0
        """Decayed weight of this process's observations (``counts`` may be replaced by a fleet's)."""
        self.base = self.total
        """The prior's weight: counted as uncensored in :meth:`capped_share`."""
        # Decay by scaling new observations up instead of every count down; renormalise when large.
        self._scale = 1.0
        self._decay = 1.0 if not half_life else 2.0 ** (1.0 / half_life)

    def add(self, length: float, weight: float = 1.0) -> None:
        self._scale *= self._decay
        w = weight * self._scale
        self.counts[_bucket(length)] += w
        self.total += w
        self.seen += w
        self.observations += 1
        if self._scale > 1e12:
            self.counts = [c / self._scale for c in self.counts]
            self.total /= self._scale
            self.capped /= self._scale
            self.seen /= self._scale
            self.base /= self._scale
            self._scale = 1.0

    def mark_capped(self) -> None:
        """The observation just added ended at its ``max_tokens`` (censored)."""
        self.capped += self._scale

    def capped_share(self) -> float:
        """Share of the weight (the prior's pseudo-observations included, as uncensored ones) that ended
        at its ``max_tokens``."""
        denominator = self.seen + self.base
        return min(1.0, self.capped / denominator) if denominator > 0 else 0.0

    def _mass_above(self, g: float) -> tuple[int, float]:
        """(bucket of g, mass strictly above g), with g's bucket split log-uniformly."""
        b = _bucket(g)
        lo, hi = _EDGES[b], _EDGES[b + 1]
        frac_above = 1.0 - _within(lo, hi, g)
        above = self.counts[b] * frac_above + sum(self.counts[b + 1 :])
        return b, above

    def conditional_quantile(self, q: float, given: float = 0.0) -> float | None:
        """The ``q`` quantile of the length given that it exceeds ``given``; None without mass above."""
        b, above = self._mass_above(given)
        if above <= 0:
            return None
        target = q * above
        lo, hi = _EDGES[b], _EDGES[b + 1]
        frac_above = 1.0 - _within(lo, hi, given)
        first = self.counts[b] * frac_above
        if first >= target and first > 0:
            # Inside g's own bucket, between g and the bucket's top.
            f0 = _within(lo, hi, given)
            return max(given, _inverse_within(lo, hi, f0 + (target / self.counts[b])))
        acc = first
        for i in range(b + 1, _NB):
            c = self.counts[i]
            if acc + c >= target and c > 0:
                return _inverse_within(_EDGES[i], _EDGES[i + 1], (target - acc) / c)
            acc += c
        return _EDGES[-1]


def _within(lo: float, hi: float, x: float) -> float:
    """Fraction of a bucket's (log-uniform) mass below x."""
    if x <= lo:
        return 0.0
    if x >= hi:
        return 1.0
    if lo <= 0:
        return (x - lo) / (hi - lo)
    return math.log(x / lo) / math.log(hi / lo)


def _inverse_within(lo: float, hi: float, f: float) -> float:
    f = min(1.0, max(0.0, f))
    if lo <= 0:
        return lo + f * (hi - lo)
    return lo * float((hi / lo) ** f)  # positive base: a real power (typeshed says Any)


class LengthForecaster:
    """Per-key online distributions of output lengths, answering conditional quantiles.

    Example::

        fc = LengthForecaster()                 # q=0.7 (DEFAULT_Q)
        fc.observe("llama-70b", 180)
        end = fc.forecast("llama-70b", generated=0, max_tokens=4096)   # total output tokens expected

    Thread-safe. ``q`` is the quantile :meth:`forecast` uses for streams (default :data:`DEFAULT_Q`),
    ``q_blind`` the one for requests whose growth is not seen (``streaming=False``; default: the larger
    of ``q`` and :data:`DEFAULT_Q_BLIND`); higher is safer (fewer surprises for the elastic policy) and
    admits less.

    ``max_keys``: most keys with a histogram in memory (default :data:`DEFAULT_MAX_KEYS`; keys come from
    per-call ``X-ZP-Route`` headers); past it the least recently used is dropped and starts from its prior.
    """

    def __init__(
        self,
        *,
        q: float = DEFAULT_Q,
        prior: Prior | None = None,
        half_life: float | None = 2000.0,
        priors: Mapping[str, Prior] | None = None,
        q_blind: float | None = None,
        q_tail: float | None = None,
        q_spread: float = DEFAULT_Q_SPREAD,
        max_keys: int = DEFAULT_MAX_KEYS,
        censored: bool = DEFAULT_CENSORED,
        cold_n: int = DEFAULT_COLD_N,
    ) -> None:
        if isinstance(max_keys, bool) or not isinstance(max_keys, int) or max_keys < 1:
            raise ConfigurationError(f"max_keys must be a positive integer, got {max_keys!r}")
        if not 0.0 < q < 1.0:
            raise ConfigurationError(f"forecast quantile q must be in (0, 1), got {q!r}")
        if q_blind is None:
            q_blind = max(q, DEFAULT_Q_BLIND)
        if not 0.0 < q_blind < 1.0:
            raise ConfigurationError(f"forecast quantile q_blind must be in (0, 1), got {q_blind!r}")
        if q_tail is None:
            q_tail = max(q, DEFAULT_Q_TAIL)
        if not 0.0 < q_tail < 1.0:
            raise ConfigurationError(f"forecast quantile q_tail must be in (0, 1), got {q_tail!r}")
        if not 0.0 < q_spread < 1.0:
            raise ConfigurationError(f"forecast quantile q_spread must be in (0, 1), got {q_spread!r}")
        self.q = q
        self.censored = bool(censored)
        """Read completions that ended at their ``max_tokens`` as censored (:meth:`observe` with
        ``capped=True``): a route whose share of such completions is ``c`` forecasts a request with
        ``max_tokens`` at its quantile ``q`` of a mixture with mass ``c`` at that bound, i.e. at the bound
        once ``c >= 1 - q``, else at the histogram's ``q / (1 - c)`` quantile (see :meth:`forecast`).
        Off: every completion is an exact length (the default until issue 30)."""
        if isinstance(cold_n, bool) or not isinstance(cold_n, int) or cold_n < 0:
            raise ConfigurationError(f"cold_n must be a non-negative integer, got {cold_n!r}")
        self.cold_n = cold_n
        """While a key has fewer than ``cold_n`` observations, a request with ``max_tokens`` is forecast
        at that bound (nothing learned yet: its first leases are reserved as ``strict`` reserves them).
        0: the prior answers from the first request."""
        self.q_spread = q_spread
        self.q_blind = q_blind
        self.q_tail = q_tail
        self.prior = prior if prior is not None else Prior()
        self._priors = dict(priors or {})
        self._half_life = half_life
        # Keys come from per-call headers (X-ZP-Route): at most max_keys histograms, least recently used
        # dropped first (a dropped key starts again from its prior).
        self._max_keys = max_keys
        self._hists: OrderedDict[str, LengthHistogram] = OrderedDict()
        self._lock = threading.Lock()

    def _hist(self, key: str) -> LengthHistogram:
        h = self._hists.get(key)
        if h is None:
            h = self._hists[key] = LengthHistogram(self._priors.get(key, self.prior), self._half_life)
            while len(self._hists) > self._max_keys:
                self._hists.popitem(last=False)
        else:
            self._hists.move_to_end(key)
        return h

    def observe(self, key: str, completion_tokens: int, *, capped: bool = False) -> None:
        """Learn one finished request's true output length; ``capped``: it ended at its ``max_tokens``
        (read only with ``censored``)."""
        if completion_tokens < 0:
            raise ConfigurationError(f"completion_tokens must be >= 0, got {completion_tokens}")
        with self._lock:
            h = self._hist(key)
            h.add(float(completion_tokens))
            if capped and self.censored:
                h.mark_capped()

    def capped_share(self, key: str) -> float:
        """Share of ``key``'s completions (with the prior's weight) that ended at their ``max_tokens``;
        0 unless ``censored``."""
        if not self.censored:
            return 0.0
        with self._lock:
            h = self._hists.get(key)
            return h.capped_share() if h else 0.0

    def _learned(self, key: str) -> float:
        """Observations of ``key`` for ``cold_n``: this process's, or what a fleet's snapshot holds beyond
        the prior (:meth:`merge_counts`), whichever is more."""
        with self._lock:
            h = self._hists.get(key)
            return max(float(h.observations), h.total - h.base) if h else 0.0

    def _censored_q(self, key: str, q: float, max_tokens: int | None) -> float | None:
        """The quantile to read for ``q`` given the route's capped share, or None: the bound itself."""
        if max_tokens is None:
            return q
        if self.cold_n and self._learned(key) < self.cold_n:
            return None
        if not self.censored:
            return q
        c = self.capped_share(key)
        if c <= 0:
            return q
        if c >= 1 - q:
            return None
        return q / (1 - c)

    def observe_many(self, key: str, lengths: Sequence[int]) -> None:
        with self._lock:
            h = self._hist(key)
            for n in lengths:
                h.add(float(n))

    def observations(self, key: str) -> int:
        with self._lock:
            h = self._hists.get(key)
            return h.observations if h else 0

    def quantile(self, key: str, q: float, *, generated: int = 0) -> float:
        """The ``q`` quantile of the output length of a request of ``key`` that has produced ``generated``
        tokens so far (conditional on outliving them)."""
        with self._lock:
            x = self._hist(key).conditional_quantile(q, float(generated))
        # No mass beyond g (it outgrew everything seen): assume it is half-way.
        return float(2 * generated + 1) if x is None else max(x, generated + 1.0)

    def forecast(self, key: str, *, generated: int = 0, max_tokens: int | None = None,
                 streaming: bool = True, tail: bool = False) -> int:
        """Total output tokens expected at the end, capped at ``max_tokens``: the forecaster's ``q``
        quantile; ``q_blind`` when ``streaming`` is False; ``q_tail`` when ``tail`` (a re-forecast of a
        stream that outlived its forecast)."""
        if not streaming:
            q = getattr(self, "q_blind", self.q)
        elif tail:
            q = getattr(self, "q_tail", self.q)
        else:
            q = self.q
        qc = self._censored_q(key, q, max_tokens)
        if qc is None:
            assert max_tokens is not None
            return max_tokens
        x = math.ceil(self.quantile(key, qc, generated=generated))
        return min(x, max_tokens) if max_tokens is not None else x

    def spread(self, key: str, *, generated: int = 0, max_tokens: int | None = None) -> int:
        """The upper forecast of a stream: total output tokens at the forecaster's ``q_spread`` quantile
        (default :data:`DEFAULT_Q_SPREAD`) given ``generated`` tokens so far, capped at ``max_tokens``.
        The transport sends it as the lease's ``forecast_hi``; its distance above :meth:`forecast` is
        the lease's forecast uncertainty."""
        qc = self._censored_q(key, getattr(self, "q_spread", DEFAULT_Q_SPREAD), max_tokens)
        if qc is None:
            assert max_tokens is not None
            return max_tokens
        x = math.ceil(self.quantile(key, qc, generated=generated))
        return min(x, max_tokens) if max_tokens is not None else x

    def snapshot(self, key: str) -> list[float]:
        """The bucket counts of ``key`` (for sharing through Redis and for tests)."""
        with self._lock:
            return list(self._hist(key).counts)

    def merge_counts(self, key: str, counts: Sequence[float]) -> None:
        """Replace ``key``'s counts by a fleet-wide snapshot (e.g. read from Redis)."""
        if len(counts) != _NB:
            raise ConfigurationError(f"expected {_NB} bucket counts, got {len(counts)}")
        with self._lock:
            h = self._hist(key)
            h.counts = [float(c) for c in counts]
            h.total = sum(h.counts)
