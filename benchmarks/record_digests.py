"""sha256 digests of the storm's per-request records: the behaviour-unchanged check of a refactor.

Not a test. Runs, in process on the virtual clock, ``make demo`` (``zp-client storm --workload
seed-burst``: default setups, seed 0, load 1) and the load-2x point of ``--sweep 2`` (load scale 2) on
seed-burst, agentic, agent-types, azure-code, azure-conv and mooncake (default setups, seed 0), and
prints and writes one digest per (workload, load, setup): the sha256 of that setup run's
``run.records``, each record serialised with every dataclass field (``json.dumps(asdict(r),
sort_keys=True)``; floats as Python writes them, exactly), the serialised records sorted.

Two commits whose digests are equal replayed every request identically on the virtual clock.

    python benchmarks/record_digests.py --out benchmarks/record_digests.start.json
    python benchmarks/record_digests.py --compare benchmarks/record_digests.start.json --out /tmp/end.json
    python benchmarks/record_digests.py --only seed-burst@1   # one point (WORKLOAD@LOAD)

It imports the storm as ``zp_storm`` (the three-distribution layout) and falls back to
``zp_client.bench`` (the layout before it), so the same script measures both sides of the move.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import json
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

#: (workload, load): ``make demo`` and the 2x point of the overload sweep.
POINTS: list[tuple[str, float]] = [("seed-burst", 1.0)] + [
    (w, 2.0) for w in ("seed-burst", "agentic", "agent-types", "azure-code", "azure-conv", "mooncake")
]


def _storm_module(name: str) -> ModuleType:
    """``zp_storm.<name>``, else ``zp_client.bench.<name>`` (the layout before the split)."""
    try:
        return importlib.import_module(f"zp_storm.{name}")
    except ModuleNotFoundError as exc:
        if not (exc.name or "").startswith("zp_storm"):
            raise
        return importlib.import_module(f"zp_client.bench.{name}")


def record_digest(records: list[Any]) -> str:
    """sha256 over the sorted, deterministically serialised records (every field)."""
    lines = sorted(json.dumps(dataclasses.asdict(r), sort_keys=True, separators=(",", ":")) for r in records)
    h = hashlib.sha256()
    for line in lines:
        h.update(line.encode())
        h.update(b"\n")
    return h.hexdigest()


def run_point(workload: str, load: float, seed: int = 0) -> dict[str, dict[str, Any]]:
    """One storm as ``zp-client storm --workload W`` (load 1) or the ``--sweep`` point ``load`` runs
    it: default setups, the workload's default profile, pool and context, the virtual clock."""
    cli = _storm_module("cli")
    runner = _storm_module("runner")
    setups_mod = _storm_module("setups")
    profile, blocks, mml, speedup = cli._DEFAULTS[workload]
    cfg = runner.StormConfig(
        workload=workload, seed=seed, setups=setups_mod.parse_setups(None, None, 1, pd=False),
        profile=profile, num_gpu_blocks=blocks, max_model_len=mml, speedup=speedup, clock="virtual",
    )
    if load != 1.0:  # what --sweep does per point: load_scale = base (1) x load
        cfg = dataclasses.replace(cfg, load_scale=load)
    _wl, _facts, runs = runner.run_storm(cfg)
    return {r.name: {"records": len(r.records), "sha256": record_digest(r.records)} for r in runs}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="write the digests here (JSON)")
    ap.add_argument("--compare", default=None, help="a digests JSON to compare against, key by key")
    ap.add_argument("--only", default=None, help="comma-separated WORKLOAD@LOAD points (default: all)")
    a = ap.parse_args(argv)
    points = POINTS
    if a.only:
        wanted = {(p.split("@")[0], float(p.split("@")[1])) for p in a.only.split(",")}
        points = [p for p in POINTS if p in wanted]
    out: dict[str, Any] = {}
    for workload, load in points:
        t0 = time.monotonic()
        for setup, d in run_point(workload, load).items():
            key = f"{workload}@{load:g}/{setup}"
            out[key] = d
            print(f"{key:45s} {d['records']:6d} {d['sha256']}", flush=True)
        print(f"# {workload}@{load:g}: {time.monotonic() - t0:.0f} s", file=sys.stderr, flush=True)
        if a.out:  # incrementally: a long run leaves what it finished
            Path(a.out).write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    if a.compare:
        ref = json.loads(Path(a.compare).read_text())
        differ = 0
        keys = set(out) if a.only else set(ref) | set(out)  # --only: just the points run
        for key in sorted(keys):
            if key not in out or key not in ref:
                print(f"{key:45s} {'only in reference' if key in ref else 'only in this run'}")
                continue
            same = ref[key]["sha256"] == out[key]["sha256"]
            differ += not same
            print(f"{key:45s} {'equal' if same else 'NOT EQUAL'}")
        print(f"# {len(keys) - differ} of {len(keys)} equal")
        return 1 if differ else 0
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
