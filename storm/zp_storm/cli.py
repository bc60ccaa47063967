"""``zp-client storm``: the same workload against the same simulated server, with and without zp-client.

Example::

    zp-client storm --workload seed-burst --out storm-report
    zp-client storm --workload agentic --setups no-admission,zp-strict,clairvoyant --seed 3
    zp-client storm --workload azure-conv --time-scale 0.2 --load-scale 1.0
    zp-client storm --workload seed-burst --sweep 0.5,1,2,4     # the overload curve
    zp-client storm --workload seed-burst --redis redis://127.0.0.1:6379/0     # adds zp-redis (real clock)
    zp-client storm --trace my-traffic.jsonl --load-scale 2                    # your own requests
    zp-client storm --workload agentic --bypass 0.25 --setups no-admission,zp-elastic  # unadmitted traffic

Runs are on a virtual clock by default (deterministic, as fast as the CPU allows); ``--clock real``
serves the simulator on loopback HTTP in real time x ``--speedup`` (the only mode for the multi-process
Redis setups).
"""

from __future__ import annotations

import argparse
import logging
import shlex
import sys
from pathlib import Path
from types import TracebackType
from typing import Any

from zp_client.errors import ConfigurationError, ZPError

__all__ = ["add_arguments", "run"]

#: Defaults per workload: (profile, num_gpu_blocks, speedup). The 70B-on-8xH100 profile's step times
#: with a scaled-down pool keep a whole storm under 3 minutes on 2 cores. seed-burst's pool (8192
#: usable blocks = 131k tokens) keeps an 8k-token agent prompt a small share of it (~5%), as on the
#: real deployment (0.25% of 206k blocks), so several burst prompts fit at once and then outgrow it.
_DEFAULTS: dict[str, tuple[str, int | None, int | None, float]] = {
    "seed-burst": ("llama3-70b-fp8-8xh100", 8193, None, 2.0),
    "agentic": ("llama3-70b-fp8-8xh100", 2049, 32768, 3.0),
    "mixed": ("llama3-70b-fp8-8xh100", 2049, 32768, 3.0),  # agentic's server, shared by both classes
    "agent-types": ("llama3-70b-fp8-8xh100", 8193, 32768, 2.0),
    "azure-code": ("llama3-70b-fp8-8xh100", 2049, None, 3.0),
    "azure-conv": ("llama3-70b-fp8-8xh100", 2049, None, 3.0),
    "mooncake": ("llama3-70b-fp8-8xh100", 2049, None, 3.0),
    "trace": ("llama3-70b-fp8-8xh100", 2049, None, 3.0),  # --trace FILE; max_model_len: see _trace_options
}


def _parse_pd(text: str | None) -> tuple[int, int] | None:
    if text is None:
        return None
    try:
        p, d = (int(x) for x in text.split(":"))
    except ValueError:
        raise ConfigurationError(f"--pd takes P:D, e.g. 1:1, got {text!r}") from None
    if p < 1 or d < 1:
        raise ConfigurationError(f"--pd needs at least one prefill and one decode server, got {text!r}")
    return p, d


def add_arguments(parser: argparse.ArgumentParser) -> None:
    from zp_storm.setups import SETUPS
    from zp_storm.workloads import WORKLOADS

    parser.add_argument("--workload", default="seed-burst", choices=WORKLOADS, help="default: seed-burst")
    parser.add_argument("--out", default="storm-report", help="output folder for report.json and storm.png")
    parser.add_argument("--redis", default=None, metavar="URL", help="Redis URL; adds the zp-redis setup")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--setups", default=None,
                        help=f"comma-separated subset of: {','.join(SETUPS)} (no-admission always runs)")
    parser.add_argument("--clock", choices=("virtual", "real"), default=None,
                        help="virtual (default; deterministic, as fast as the CPU allows) or real "
                             "(loopback HTTP in real time x --speedup; the default with --redis)")
    parser.add_argument("--speedup", type=float, default=None,
                        help="--clock real: virtual seconds per wall second")
    parser.add_argument("--client-load", type=float, default=0.0, metavar="F",
                        help="a busy client: block the client's event loop in 50 ms bursts for fraction F of "
                             "real time (the real clock is the default with it; the simulator then runs "
                             "in its own process); with --clock virtual, modelled deterministically: the "
                             "client's reads are held through 50 ms busy periods at duty cycle F")
    parser.add_argument("--sweep", default=None, metavar="X,Y,...",
                        help="the overload curve: run at each offered load (x scales the arrival rate, "
                             "keeps request sizes; on top of --load-scale) and plot them")
    parser.add_argument("--time-scale", type=float, default=None,
                        help="trace replays: virtual arrival = trace offset x this; agentic: window x this")
    parser.add_argument("--load-scale", type=float, default=None,
                        help="trace replays: keep/replicate requests x this; "
                             "seed-burst/agentic: sessions x this")
    parser.add_argument("--profile", default=None, metavar="NAME",
                        help="simulator profile (see zp_sim.profiles; default: the workload's)")
    parser.add_argument("--num-gpu-blocks", type=int, default=None, help="override the profile's pool size")
    parser.add_argument("--max-model-len", type=int, default=None, help="override the context length")
    parser.add_argument("--workers", type=int, default=3, help="zp-redis worker processes (default 3)")
    parser.add_argument("--max-requests", type=int, default=None,
                        help="trace replays: requests in the window")
    parser.add_argument("--bypass", type=float, default=0.0, metavar="F",
                        help="every zp-* setup sends fraction F of the requests (the same ones, chosen from "
                             "--seed) straight to the server, unadmitted (a plain openai client, the naive "
                             "setup's retries); a no-op for the other setups")
    parser.add_argument("--bypass-window", default=None, metavar="START:END",
                        help="--bypass only for requests submitted in [START, END) virtual seconds of the "
                             "run (either side may be empty)")
    parser.add_argument("--replicas", type=int, default=1, metavar="N",
                        help="a fleet: N fresh simulated servers per setup run, the load scaled by N; the "
                             "default setups become no-admission (round-robin), rr, rr-zp, epp "
                             "(docs/benchmark.md#fleets---replicas-n)")
    parser.add_argument("--pd", default=None, metavar="P:D",
                        help="prefill/decode disaggregation: P prefill and D decode servers for the P/D "
                             "setups (pd-proxy, pd-noadmission, zp-pd), P + D colocated ones for the "
                             "others; the load scaled by P + D (docs/benchmark.md#prefilldecode---pd-pd)")
    parser.add_argument("--kill-replica", type=float, default=None, metavar="AT_S",
                        help="kill the replica with the most requests in flight AT_S virtual seconds into "
                             "each run, abruptly (connections reset, no drain)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    # --trace FILE: a team's own requests through every setup (docs/benchmark.md#your-own-traffic)
    from zp_storm.tracefile import TRACE_FORMATS

    parser.add_argument("--trace", default=None, metavar="FILE",
                        help="replay your own requests instead of --workload: JSONL (arrival_s, "
                             "prompt_tokens, max_tokens, ...), or an Azure CSV / Mooncake JSONL trace")
    parser.add_argument("--trace-format", default="auto", choices=TRACE_FORMATS,
                        help="format of --trace (default: auto, from the extension and the first record)")


def _check_profile(name: str | None) -> None:
    """A ``--profile`` the simulator knows (checked before anything starts: a one-line error, not a
    traceback from the first simulated server)."""
    from zp_sim.profiles import PROFILES

    if name is not None and name not in PROFILES:
        raise ConfigurationError(f"unknown simulator profile {name!r} (--profile); choose one of: "
                                 f"{', '.join(sorted(PROFILES))}")


def _trace_options(args: argparse.Namespace) -> dict[str, Any]:
    """``--trace FILE``: validate the whole file now (a bad line fails in one line before any server starts),
    select the workload ``trace`` and, unless ``--max-model-len`` is given, a context that holds the file's
    longest request (never below the profile's; the simulator caps it to its pool). Returns the workload
    overrides."""
    from zp_client.errors import ConfigurationError
    from zp_sim.profiles import get_profile
    from zp_storm.tracefile import read_trace, trace_context_len
    from zp_storm.workloads import TRACE_WORKLOAD

    if args.workload != "seed-burst":  # the default: --trace replaces it
        raise ConfigurationError(f"give --workload or --trace, not both (got --workload {args.workload})")
    trace = read_trace(args.trace, args.trace_format)
    args.workload = TRACE_WORKLOAD
    if args.max_model_len is None:
        try:
            profile = get_profile(args.profile or _DEFAULTS[TRACE_WORKLOAD][0])
        except ValueError as exc:
            raise ConfigurationError(str(exc)) from None
        args.max_model_len = trace_context_len(trace, floor=profile.max_model_len,
                                               block_size=profile.block_size)
    return {"path": str(trace.path), "trace_format": trace.format}


class _Progress:
    def __init__(self, console: Any, setups: list[str], total: int, enabled: bool) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self.enabled = enabled
        self.progress = Progress(TextColumn("{task.description:<14}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, disable=not enabled)
        self.tasks = {s: self.progress.add_task(s, total=total, start=False) for s in setups}

    def __enter__(self) -> _Progress:
        self.progress.__enter__()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.progress.__exit__(exc_type, exc, tb)

    def start(self, name: str) -> None:
        self.progress.start_task(self.tasks[name])

    def advance(self, name: str, k: int) -> None:
        self.progress.advance(self.tasks[name], k)

    def finish(self, name: str) -> None:
        self.progress.stop_task(self.tasks[name])


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from zp_storm.report import build_report, markdown_table, print_checks, print_table, write_report
    from zp_storm.runner import StormConfig
    from zp_storm.setups import parse_setups

    console = Console()
    if not console.is_terminal:  # piped into a file or CI log: do not squeeze the table to 80 columns
        console = Console(width=200)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # The simulator warns on every transient lag; the harness judges saturation itself (effective speed,
    # CPU) and reports the simulator's largest lag per run, so its warning would only be noise here.
    logging.getLogger("zp_sim.server").setLevel(logging.ERROR)
    try:
        replicas = int(getattr(args, "replicas", 1) or 1)
        if replicas < 1:
            raise ConfigurationError(f"--replicas takes a positive integer, got {replicas}")
        pd = _parse_pd(getattr(args, "pd", None))
        if pd is not None:
            if replicas not in (1, sum(pd)):
                raise ConfigurationError(f"--pd {pd[0]}:{pd[1]} runs {sum(pd)} servers; drop --replicas")
            replicas = sum(pd)
        setups = parse_setups(args.setups, args.redis, replicas, pd=pd is not None)
        loads = _parse_sweep(args.sweep)
        _check_profile(args.profile)
        from zp_storm.bypass import parse_window

        bypass = float(getattr(args, "bypass", 0.0) or 0.0)
        if not 0.0 <= bypass <= 1.0:
            raise ConfigurationError(f"--bypass takes a fraction in [0, 1], got {bypass!r}")
        bypass_window = parse_window(getattr(args, "bypass_window", None))
        if bypass_window is not None and not bypass:
            raise ConfigurationError("--bypass-window needs --bypass F (F > 0)")
    except ZPError as exc:
        print(f"zp-client storm: {exc}", file=sys.stderr)
        return 2
    clock = args.clock or ("real" if args.redis or args.client_load else "virtual")
    trace_overrides: dict[str, Any] = {}
    if getattr(args, "trace", None) is not None:  # --trace FILE (sets args.workload, args.max_model_len)
        try:
            trace_overrides = _trace_options(args)
        except ZPError as exc:
            print(f"zp-client storm: {exc}", file=sys.stderr)
            return 2
    profile, blocks, mml, speedup = _DEFAULTS[args.workload]
    overrides: dict[str, Any] = dict(trace_overrides)
    if args.max_requests is not None:
        overrides["max_requests"] = args.max_requests
    try:
        cfg = StormConfig(
            workload=args.workload, seed=args.seed, setups=setups,
            profile=args.profile or profile,
            num_gpu_blocks=args.num_gpu_blocks if args.num_gpu_blocks is not None else blocks,
            max_model_len=args.max_model_len if args.max_model_len is not None else mml,
            speedup=args.speedup or speedup, redis_url=args.redis, time_scale=args.time_scale,
            load_scale=args.load_scale, workers=args.workers, workload_overrides=overrides, clock=clock,
            client_load=args.client_load, bypass=bypass, bypass_window=bypass_window,
            replicas=replicas, kill_replica_s=getattr(args, "kill_replica", None), pd=pd,
        )
    except ZPError as exc:
        print(f"zp-client storm: {exc}", file=sys.stderr)
        return 2
    command = "zp-client storm " + " ".join(shlex.quote(a) for a in sys.argv[2:]) if len(sys.argv) > 1 \
        and sys.argv[1] == "storm" else "zp-client storm (programmatic)"
    if loads:
        return _sweep(cfg, loads, args, console, command)
    result = _run_storm(cfg, console, args.quiet)
    if isinstance(result, int):
        return result
    wl, facts, runs = result
    report = build_report(wl, facts, runs, cfg, command)
    print_table(report, console)
    print_checks(report, console)
    jp, pp = write_report(report, Path(args.out))
    (Path(args.out) / "table.md").write_text(markdown_table(report) + "\n")
    console.print(f"wrote {jp} and {pp}", highlight=False)
    if not report["valid"]:
        console.print("[bold red]the harness was saturated: do not quote these numbers[/]")
        return 3
    return 0


def _run_storm(cfg: Any, console: Any, quiet: bool) -> Any:
    """``run_storm(cfg)`` under a progress bar: its result, or exit code 2 after a one-line error."""
    from zp_storm.runner import run_storm

    holder: dict[str, _Progress] = {}

    def factory(names: list[str], total: int) -> _Progress:
        p = _Progress(console, names, total, not quiet)
        p.__enter__()
        holder["p"] = p
        return p

    try:
        return run_storm(cfg, factory)
    except ZPError as exc:
        print(f"zp-client storm: {exc}", file=sys.stderr)
        return 2
    finally:
        if "p" in holder:
            holder["p"].__exit__(None, None, None)


def _parse_sweep(text: str | None) -> list[float]:
    if not text:
        return []
    try:
        loads = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ConfigurationError(f"--sweep takes comma-separated positive numbers, got {text!r}") from None
    if not loads or any(not 0 < x < float("inf") for x in loads):
        raise ConfigurationError(f"--sweep takes comma-separated positive numbers, got {text!r}")
    return sorted(set(loads))


def _sweep(cfg: Any, loads: list[float], args: argparse.Namespace, console: Any, command: str) -> int:
    """One storm per offered load (each written to ``OUT/load-X``), then the curve and its figure."""
    import dataclasses

    from zp_storm.report import (
        build_report,
        build_sweep_report,
        print_sweep_table,
        write_report,
        write_sweep_report,
    )

    out = Path(args.out)
    base = cfg.load_scale if cfg.load_scale is not None else 1.0
    reports = []
    for x in loads:
        point = dataclasses.replace(cfg, load_scale=base * x)
        console.print(f"[bold]offered load {x:g}x[/] (--load-scale {base * x:g})", highlight=False)
        result = _run_storm(point, console, args.quiet)
        if isinstance(result, int):
            return result
        wl, facts, runs = result
        report = build_report(wl, facts, runs, point, f"{command} (load {x:g}x)")
        write_report(report, out / f"load-{x:g}")
        reports.append(report)
    sweep = build_sweep_report(loads, reports)
    print_sweep_table(sweep, console)
    jp, pp = write_sweep_report(sweep, out)
    console.print(f"wrote {jp} and {pp} (one report per load in {out}/load-X)", highlight=False)
    if not all(r["valid"] for r in reports):
        console.print("[bold red]the harness was saturated at some load: do not quote those numbers[/]")
        return 3
    return 0
