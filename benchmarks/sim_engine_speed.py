"""How fast the simulated engine steps (no HTTP): replays and a storm-sized live batch.

Run: ``.venv/bin/python benchmarks/sim_engine_speed.py``

Prints, per scenario, the number of steps, wall seconds, microseconds per step and the ratio of
virtual time to wall time (how much faster than real time the engine can run the scenario;
the server's --speedup must stay below it).
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

from zp_sim.engine import Engine, EngineConfig
from zp_sim.profiles import get_profile
from zp_sim.replay import run_replay

SHARED = Path(__file__).resolve().parents[1].parent / "shared" / "fidelity"


def _replays() -> None:
    for blocks in (14000, 2000):
        wl = SHARED / "a_burst.jsonl"
        if not wl.exists():
            print(f"skip replay: {wl} not found")
            return
        cfg = EngineConfig.from_profile(get_profile("fidelity"), num_gpu_blocks=blocks, max_model_len=9216)
        t0 = time.perf_counter()
        out = run_replay(wl, cfg)
        dt = time.perf_counter() - t0
        print(
            f"replay a_burst @ {blocks} blocks: {out['steps']} steps, {len(out['requests'])} requests, "
            f"{dt:.3f} s wall, {dt / out['steps'] * 1e6:.0f} us/step, "
            f"virtual/wall = {out['sim_time_s'] / dt:.0f}x"
        )


def _storm(n: int = 600, blocks: int = 30000) -> None:
    rnd = random.Random(1)
    profile = get_profile("llama3-70b-fp8-8xh100")
    e = Engine(EngineConfig.from_profile(profile, num_gpu_blocks=blocks))
    shared = list(range(5_000_000, 5_001_500))
    base = 0
    for i in range(n):
        p, o = rnd.randint(200, 6000), rnd.randint(50, 1500)
        if i % 2:
            toks = shared[: min(p, 1500)] + list(range(base, base + max(0, p - 1500)))
        else:
            toks = list(range(base, base + p))
        base += p
        e.add_request(f"r{i}", toks, o)
    t0 = time.perf_counter()
    steps = 0
    while e.has_unfinished():
        e.step()
        steps += 1
    dt = time.perf_counter() - t0
    s = e.stats
    print(
        f"storm {n} requests on {profile.name} @ {blocks} blocks: {steps} steps, {dt:.3f} s wall, "
        f"{dt / steps * 1e6:.0f} us/step, {s.preemptions_total} preemptions, virtual {e.now:.1f} s, "
        f"virtual/wall = {e.now / dt:.0f}x"
    )
    print("profile constants:", json.dumps({k: getattr(profile, k) for k in ("c0", "c1", "c2", "c3", "c4")}))


if __name__ == "__main__":
    _replays()
    _storm()
