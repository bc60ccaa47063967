"""The agent-types storm's pinning table (docs/pinning.md) from storm reports.

    for s in 1 2 3; do zp-client storm --workload agent-types \
        --setups zp-elastic,zp-pinned,zp-pinned-timer --seed $s --out pin-s$s; done
    python benchmarks/pinning_table.py pin-s1 pin-s2 pin-s3
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path
from typing import Any


def main(dirs: list[str]) -> None:
    rows: dict[str, list[tuple[int, dict[str, Any]]]] = {}
    for d in dirs:
        rep = json.loads((Path(d) / "report.json").read_text())
        seed = int(rep["workload"].get("seed", 0)) if isinstance(rep.get("workload"), dict) else 0
        for m in rep["setups"]:
            rows.setdefault(m["setup"], []).append((seed, m))
    print("| setup | seed | cold prefills (per type) | two rarest cold | hit | TTFT p50 | TTFT p99 | "
          "TTFT p50 type 0 / max of types 2-5 | good req/s | keep-warms (share of requests) | "
          "keep-warm tokens (share) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name, lst in rows.items():
        for seed, m in lst:
            p = m["prefix"]
            t = p["ttft_p50_per_type"]
            print(f"| {name} | {seed} | {p['cold_prefills']} {p['cold_per_type']} | "
                  f"{p['cold_share_rarest2']:.0%} | {p['hit_rate']:.1%} | {m['ttft_p50']:.3f} | "
                  f"{m['ttft_p99']:.2f} | {t[0]:.3f} / {max(t[2:]):.3f} | {m['goodput_rps']:.3f} | "
                  f"{p['keepwarm_requests']} ({p['keepwarm_requests_share']:.1%}) | "
                  f"{p['keepwarm_computed_tokens']} ({p['keepwarm_tokens_share']:.2%}) |")
    print()
    for name, lst in rows.items():
        ms = [m for _, m in lst]

        def med(key: str, ms: list[dict[str, Any]] = ms) -> float:
            return statistics.median(float(m["prefix"][key] or 0) for m in ms)

        print(f"{name}: medians cold {med('cold_prefills'):g}, two rarest {med('cold_share_rarest2'):.0%}, "
              f"goodput {statistics.median(m['goodput_rps'] for m in ms):.3f}, TTFT p50 "
              f"{statistics.median(m['ttft_p50'] for m in ms):.3f}, keep-warms {med('keepwarm_requests'):g} "
              f"({med('keepwarm_requests_share'):.1%}), keep-warm tokens {med('keepwarm_tokens_share'):.2%}")


if __name__ == "__main__":
    main(sys.argv[1:])
