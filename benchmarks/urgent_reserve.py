"""The urgent reserve on the virtual-clock storm (issue 30).

docs/benchmark.md#an-urgent-reserve-on-mixed has the results.

Not a test. ``mixed`` puts an interactive class (priority 0, TTFT target 1 s) and a batch class (priority 1,
30 s) on one server; ``zp-slo``'s misses there are interactive calls that arrive to a pool full of batch
leases and wait for one to end. The library's rule is ``ElasticPolicy(urgent_reserve=...)`` (default 2.0:
a less urgent waiter leaves twice the largest live urgent lease's bound free); ``--urgent U`` runs the storm
with another value (``--urgent 0``: without it). The fixed-size variants measured before the rule was
adopted wrap the elastic policy's ``fits`` (``--reserve R --mode ...``, best with ``--urgent 0``) so that a
waiter of a less urgent class (priority > 0) is admitted only while it fits under the limit less ``R``
blocks, kept for the more urgent class:

* ``uncond``: always ``R``;
* ``cond``: ``R`` only while a lease of a more urgent class is live, else nothing;
* ``adaptive``: ``R / 48`` times the largest bound among the live leases of a more urgent class (``R`` 96:
  room for two of them; 48 blocks is about one interactive request's bound on ``mixed``).

The wrapper narrows admission only (a tighter limit for some waiters; every admission still passes the
projection's check), but the run then follows another trajectory, with other forecast errors: the script
prints the server's preemptions (``--urgent 3`` preempted once on ``mixed`` 2x seed 1). ``--urgent`` and
the wrapper patch the library in this process only (``zp_client.budget.elastic.ElasticPolicy``), so they
cover ``LocalBudget`` setups (``zp-slo``, ``zp-elastic``), not Redis. One line per setup: requests in SLO per
class, each scored against its own class's targets (``zp_storm.report.in_slo``), and preemptions.

    .venv/bin/python benchmarks/urgent_reserve.py --load 2 --seed 4 --reserve 96 --mode cond \
        --setups zp-slo,vllm-priority
    .venv/bin/python benchmarks/urgent_reserve.py --load 2 --seed 4 --urgent 0 --setups zp-slo   # without it
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from zp_client.budget import elastic  # noqa: E402
from zp_storm.cli import _DEFAULTS  # noqa: E402
from zp_storm.report import in_slo  # noqa: E402
from zp_storm.runner import StormConfig, run_storm  # noqa: E402

MODES = ("uncond", "cond", "adaptive")
#: ``adaptive``'s unit: about one interactive request's bound on ``mixed`` (prompt ~500 + 256 output
#: tokens, 16-token blocks).
UNIT_BLOCKS = 48


class _Narrowed:
    """A ledger view whose limit is ``reserve`` blocks less (everything else is the view's)."""

    def __init__(self, view: Any, reserve: int) -> None:
        self._view = view
        self._reserve = reserve

    def __getattr__(self, name: str) -> Any:
        return getattr(self._view, name)

    @property
    def limit(self) -> int:
        return int(self._view.limit) - self._reserve


def urgent_reserve(view: Any, priority: int, reserve: int, mode: str) -> int:
    """Blocks kept free of a waiter of class ``priority`` for the more urgent classes."""
    if priority <= 0 or reserve <= 0:
        return 0
    urgent = [lease.bound for lease in view.leases.values() if lease.priority < priority]
    if mode == "uncond":
        return reserve
    if mode == "cond":
        return reserve if urgent else 0
    return reserve * max(urgent, default=0) // UNIT_BLOCKS


def install(reserve: int, mode: str) -> None:
    """Wrap ``ElasticPolicy.fits`` in this process (see the module doc)."""
    inner = elastic.ElasticPolicy.fits

    def fits(self: Any, view: Any, candidate: Any) -> bool:
        r = urgent_reserve(view, candidate.priority, reserve, mode)
        return inner(self, _Narrowed(view, r) if r else view, candidate)

    elastic.ElasticPolicy.fits = fits  # type: ignore[method-assign]


def install_urgent(urgent: float) -> None:
    """Make ``urgent`` the ``urgent_reserve`` of every ElasticPolicy built without one, in this process."""
    init = elastic.ElasticPolicy.__init__

    def patched(self: Any, *args: Any, **kw: Any) -> None:
        kw.setdefault("urgent_reserve", urgent)
        init(self, *args, **kw)

    elastic.ElasticPolicy.__init__ = patched  # type: ignore[method-assign]


def run(workload: str, load: float, seed: int, setups: list[str], reserve: int,
        mode: str, urgent: float) -> list[dict[str, Any]]:
    profile, blocks, mml, _ = _DEFAULTS[workload]
    cfg = StormConfig(workload=workload, seed=seed, profile=profile, num_gpu_blocks=blocks, max_model_len=mml,
                      load_scale=load, setups=setups)
    wl, _, runs = run_storm(cfg)
    out = []
    for r in runs:
        classes: dict[str, list[int]] = {}
        for rec in r.records:
            if not rec.sent:
                continue
            c = classes.setdefault(rec.slo_class or "", [0, 0])
            c[0] += 1
            c[1] += bool(in_slo(wl, rec))
        out.append({
            "setup": r.name, "workload": workload, "load": load, "seed": seed,
            "urgent_reserve": urgent, "reserve": reserve, "mode": mode,
            "in_slo": sum(v[1] for v in classes.values()), "sent": sum(v[0] for v in classes.values()),
            "classes": {k: {"sent": v[0], "in_slo": v[1]} for k, v in sorted(classes.items())},
            "preemptions": int((r.server_stats.get("engine") or {}).get("preemptions_total") or 0),
        })
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workload", default="mixed", choices=sorted(_DEFAULTS))
    ap.add_argument("--load", type=float, default=2.0)
    ap.add_argument("--seed", type=int, default=4)
    ap.add_argument("--setups", default="zp-slo")
    ap.add_argument("--reserve", type=int, default=0, help="the wrapper's R in blocks (0: no wrapper)")
    ap.add_argument("--mode", default="cond", choices=MODES)
    ap.add_argument("--urgent", type=float, default=elastic.DEFAULT_URGENT_RESERVE,
                    help="the library's urgent_reserve (default: the library's, %(default)s; 0: off)")
    args = ap.parse_args()
    if args.urgent != elastic.DEFAULT_URGENT_RESERVE:
        install_urgent(args.urgent)
    if args.reserve:
        install(args.reserve, args.mode)
    for row in run(args.workload, args.load, args.seed, args.setups.split(","), args.reserve, args.mode,
                   args.urgent):
        print(json.dumps(row))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
