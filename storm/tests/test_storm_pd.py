"""The storm's prefill/decode mode (``--pd P:D``): the toy proxy's bodies, the setups, the per-pool report."""

from __future__ import annotations

from typing import Any

import pytest

from zp_client.errors import ConfigurationError
from zp_storm.pd_setups import PREFILL_KV_PARAMS, decode_body, prefill_body
from zp_storm.report import build_report
from zp_storm.runner import StormConfig, run_storm
from zp_storm.setups import parse_setups

SMALL: dict[str, Any] = {"streams": 3, "stream_out": 256, "rounds": 2, "burst": 2, "burst_prompt": 900,
                         "burst_max_tokens": 128}


def test_the_proxy_builds_the_toy_proxys_prefill_and_decode_bodies() -> None:
    body = {"model": "m", "messages": [], "stream": True, "max_tokens": 300, "max_completion_tokens": 300,
            "stream_options": {"include_usage": True}, "min_tokens": 5, "min_completion_tokens": 5}
    pre = prefill_body(body)
    assert pre["kv_transfer_params"] == PREFILL_KV_PARAMS and pre["stream"] is False
    assert pre["max_tokens"] == 1 and pre["max_completion_tokens"] == 1
    assert not {"stream_options", "min_tokens", "min_completion_tokens"} & set(pre)
    assert body["max_tokens"] == 300 and "kv_transfer_params" not in body  # the caller's body untouched
    kv = {"do_remote_prefill": True, "remote_engine_id": "e"}
    assert decode_body(body, kv)["kv_transfer_params"] == kv
    assert "kv_transfer_params" not in decode_body(body, {})  # nothing answered: a local prefill


def test_pd_setups_need_pd_and_pd_defaults_to_them_and_the_colocated_fleet() -> None:
    with pytest.raises(ConfigurationError, match="needs --pd"):
        parse_setups("pd-proxy", None, 2)
    assert parse_setups(None, None, 2, pd=True) == ["no-admission", "zp-fleet", "pd-proxy", "pd-noadmission",
                                                     "zp-fleet-chunk512", "zp-pd"]
    with pytest.raises(ConfigurationError, match="replicas = P \\+ D"):
        StormConfig(pd=(1, 1), replicas=3)


@pytest.mark.slow  # over a second on a loaded 2-core machine: make test-fast skips it
def test_a_pd_storm_moves_every_prompt_and_reports_each_pool() -> None:
    cfg = StormConfig(workload="seed-burst", seed=0, setups=["no-admission", "pd-proxy", "pd-noadmission",
                                                              "zp-fleet-chunk512", "zp-pd"],
                      profile="tiny", num_gpu_blocks=None, workload_overrides=dict(SMALL), replicas=2, pd=(1, 1))
    wl, facts, runs = run_storm(cfg)
    report = build_report(wl, facts, runs, cfg, "pytest")
    by = {m["setup"]: m for m in report["setups"]}
    assert report["pd"]["prefill"] == 1 and report["pd"]["kv_lease_s"] > 0
    assert "pd" not in by["no-admission"] and "pd" not in by["zp-fleet-chunk512"]  # colocated
    for name in ("pd-proxy", "pd-noadmission", "zp-pd"):
        m = by[name]
        pre, dec = m["pd"]["prefill"], m["pd"]["decode"]
        assert pre["servers"] == 1 and dec["servers"] == 1
        # every attempt prefilled on the prefill server and pulled its KV on the decode server
        assert dec["remote"] == pre["freed_read"] + pre["freed_abort"] + pre["expired"] > 0
        assert dec["local_fallback"] == 0 and dec["pulled_blocks"] > 0
        run = next(r for r in runs if r.name == name)
        assert run.replica_stats is not None
        assert all((st["kv"]["held_blocks"], st["kv"]["pulling"]) == (0, 0) for st in run.replica_stats)
        assert m["good_tail"] <= m["good"]
    # zp-pd: every request through the prefill pool (the threshold is below every prompt), and at every
    # sample each replica's budget charged at least what its server had allocated; nothing after the run
    zp = by["zp-pd"]
    assert zp["pd_counts"]["prefills"] == zp["pd"]["prefill"]["freed_read"] > 0
    assert zp["preemptions"] == 0 and zp["pd"]["prefill"]["expired"] == 0
    assert zp["pd"]["decode"]["read_freed"] == 0  # no decode call carried the parameters of a freed KV
    held = zp["held_deficit"]
    assert held["samples"] > 10 and held["deficit_samples"] == 0 and held["max_deficit_blocks"] == [0, 0]
    assert held["charged_after"] == [0, 0] and held["allocated_after"] == [0, 0]
    assert zp["pd"]["decode"]["itl_p99_ms"] > 0 and zp["pd"]["decode"]["transfer_wait_p50_s"] > 0
    assert by["pd-noadmission"]["errors"] == 0
    # the chunk knob reached zp-fleet-chunk512's servers, and only theirs
    for run in runs:
        assert run.replica_stats is not None
        want = 512 if run.name == "zp-fleet-chunk512" else 0
        assert [st["long_prefill_token_threshold"] for st in run.replica_stats] == [want, want]
