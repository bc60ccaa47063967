"""Upstream attempts per always-failing call through LiteLLM (the issue 31 table's LiteLLM row).

30 concurrent ``litellm.acompletion(client=wrap(...))`` calls with zp's defaults, 3 of them always answered
503 by a proxy in front of the simulator (tests/_fail_proxy.py), by default and with ``num_retries=2``.
Run from the repository root: ``python integrations/litellm/bench_retries.py`` (about 10 s).
"""
from __future__ import annotations

import asyncio
import os
import sys
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network fetch at import
sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

import litellm  # noqa: E402
import openai  # noqa: E402
from _fail_proxy import FailProxy  # noqa: E402

from zp_client import LocalBudget, wrap  # noqa: E402
from zp_sim.server import SimServer  # noqa: E402

litellm.suppress_debug_info = True

async def run(proxy: FailProxy, sim: SimServer, num_retries: int | None) -> None:
    b = LocalBudget(limit_blocks=400)
    raw = openai.AsyncOpenAI(base_url=proxy.base_url, api_key="x")
    c = wrap(raw, b)
    tag = f"fail-{num_retries}-"
    models = [f"{tag}{i}" if i % 10 == 0 else sim.model for i in range(30)]
    kw: dict[str, Any] = {} if num_retries is None else {"num_retries": num_retries}
    async def one(m: str) -> str:
        try:
            await litellm.acompletion(model=f"openai/{m}", client=c, max_tokens=16,
                                      messages=[{"role": "user", "content": "hi"}], **kw)
            return "ok"
        except Exception as e:  # noqa: BLE001 - the type is what is reported
            return type(e).__name__
    t = time.monotonic()
    res = await asyncio.gather(*(one(m) for m in models))
    wall = time.monotonic() - t
    fails = [m for m in models if m.startswith("fail")]
    per = [proxy.count(m) for m in fails]
    st = b.status_sync()
    errors = sorted({r for r in res if r != "ok"})
    print(f"num_retries={num_retries}: attempts per always-failing call {per}, ok {res.count('ok')}/30, "
          f"leases {st.extra['granted']}, held after {st.used}, wall {wall:.1f}s, errors {errors}")
    await c.close()
    await raw.close()

async def main() -> None:
    with SimServer(profile="tiny", speedup=10.0) as sim, FailProxy(sim.url) as proxy:
        for n in (None, 2):
            await run(proxy, sim, n)
asyncio.run(main())
