"""``zp-client sim``: serve the simulated vLLM server, or replay a workload in virtual time.

    zp-client sim --port 8000 --profile tiny [--num-gpu-blocks N] [--speedup K] [--gateway-timeout S]
    zp-client sim replay WORKLOAD.jsonl --num-gpu-blocks N [...]   (see shared/REPLAY.md)

Serving is the default (no sub-subcommand); ``replay`` delegates to :mod:`zp_sim.replay`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import sys

__all__ = ["add_arguments", "run"]

logger = logging.getLogger("zp_sim.cli")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the ``sim`` options (serve) and the ``replay`` sub-subcommand to ``parser``."""
    from .profiles import PROFILES

    # Serve options use their own dests (sim_*) so the replay subparser's options of the same
    # spelling (--num-gpu-blocks, --policy...) never clash in the shared namespace.
    parser.add_argument("--host", dest="sim_host", default="127.0.0.1", metavar="HOST",
                        help="interface to listen on (default 127.0.0.1)")
    parser.add_argument("--port", dest="sim_port", type=int, default=8000, metavar="PORT",
                        help="port (default 8000; 0 = any)")
    parser.add_argument("--profile", dest="sim_profile", default="tiny", choices=sorted(PROFILES),
                        help="GPU profile: pool size, limits and step-time constants (default tiny)")
    parser.add_argument("--num-gpu-blocks", dest="sim_num_gpu_blocks", type=int, default=None, metavar="N",
                        help="KV pool size in blocks, including the null block (default: the profile's)")
    parser.add_argument("--speedup", dest="sim_speedup", type=float, default=1.0, metavar="K",
                        help="virtual seconds per real second (default 1)")
    parser.add_argument("--gateway-timeout", dest="sim_gateway_timeout", type=float, default=None,
                        metavar="S",
                        help="answer 504 to requests without a first byte after S virtual seconds")
    parser.add_argument("--policy", dest="sim_policy", choices=["fcfs", "priority"], default="fcfs",
                        help="scheduling policy (vLLM's --scheduling-policy)")
    parser.add_argument("--max-num-seqs", dest="sim_max_num_seqs", type=int, default=None, metavar="N",
                        help="most requests running at once (vLLM's --max-num-seqs; default: the profile's)")
    parser.add_argument("--max-num-batched-tokens", dest="sim_max_num_batched_tokens", type=int, default=None,
                        metavar="T",
                        help="most tokens per engine step (vLLM's --max-num-batched-tokens; default: the "
                             "profile's)")
    parser.add_argument("--max-model-len", dest="sim_max_model_len", type=int, default=None, metavar="T",
                        help="context length in tokens (vLLM's --max-model-len; default: the profile's)")
    parser.add_argument("--no-prefix-caching", dest="sim_no_prefix_caching", action="store_true",
                        help="turn automatic prefix caching off (vLLM's --no-enable-prefix-caching)")
    parser.add_argument("--max-num-queued-reqs", dest="sim_max_num_queued_reqs", type=int, default=None,
                        metavar="N",
                        help="answer 503 (as vLLM) to a request that would make more than N requests "
                             "in flight, waiting or running (default: no limit)")
    parser.add_argument("--max-num-queued-tokens", dest="sim_max_num_queued_tokens", type=int, default=None,
                        metavar="T",
                        help="answer 503 (as vLLM) to new requests while the prompts of requests without "
                             "a first token hold T or more tokens (default: no limit)")
    parser.add_argument("--pd", dest="sim_pd", default=None, metavar="P:D",
                        help="serve P prefill and D decode servers (vLLM's NixlConnector roles, in this one "
                             "process: they reach each other in memory) on ports PORT, PORT+1, ...")
    parser.add_argument("--role", dest="sim_role", choices=["prefill", "decode"], default=None,
                        help="one P/D role for this server (its peers must live in the same process: "
                             "use --pd, the Python API or the storm)")
    parser.add_argument("--kv-lease-s", dest="sim_kv_lease_s", type=float, default=30.0, metavar="S",
                        help="P/D: how long a prefill's blocks wait for their decode side (vLLM's "
                             "kv_lease_duration, default 30 virtual s)")
    parser.add_argument("--kv-transfer-s-per-block", dest="sim_kv_transfer", type=float, default=None,
                        metavar="S",
                        help="P/D: seconds to pull one KV block from a prefill server "
                             "(default: the profile's)")
    parser.add_argument("--long-prefill-token-threshold", dest="sim_long_prefill", type=int, default=None,
                        metavar="T",
                        help="vLLM's cap on one request's prefill tokens per step (0: off)")
    parser.add_argument("--model", dest="sim_model", default="sim-llama", metavar="NAME",
                        help="served model name (default sim-llama)")
    parser.add_argument("--seed", dest="sim_seed", type=int, default=0, metavar="N",
                        help="seed of the default output-length distribution")
    sub = parser.add_subparsers(dest="sim_command", metavar="{replay}")
    replay = sub.add_parser("replay", help="replay a JSONL workload in virtual time and print JSON",
                            description="Replay a JSONL workload (shared/REPLAY.md) in virtual time.")
    from .replay import add_replay_arguments

    add_replay_arguments(replay)


def run(args: argparse.Namespace) -> int:
    """Run ``zp-client sim`` (serve until interrupted) or ``zp-client sim replay``."""
    if getattr(args, "sim_command", None) == "replay":
        from .replay import run_replay_command

        return run_replay_command(args)
    from .server import SimServer

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    roles: list[str | None] = [args.sim_role]
    if args.sim_pd is not None:
        try:
            p, d = (int(x) for x in args.sim_pd.split(":"))
            if p < 1 or d < 1:
                raise ValueError
        except ValueError:
            print(f"zp-client sim: --pd takes P:D (at least one of each), got {args.sim_pd!r}",
                  file=sys.stderr)
            return 2
        roles = [*(["prefill"] * p), *(["decode"] * d)]
    try:
        servers = [SimServer(
            args.sim_profile,
            num_gpu_blocks=args.sim_num_gpu_blocks,
            speedup=args.sim_speedup,
            gateway_timeout_s=args.sim_gateway_timeout,
            policy=args.sim_policy,
            port=args.sim_port + i if args.sim_port else 0,
            host=args.sim_host,
            model=args.sim_model,
            seed=args.sim_seed + i,
            enable_prefix_caching=not args.sim_no_prefix_caching,
            max_num_seqs=args.sim_max_num_seqs,
            max_num_batched_tokens=args.sim_max_num_batched_tokens,
            max_model_len=args.sim_max_model_len,
            log_level="info",
            max_num_queued_reqs=args.sim_max_num_queued_reqs,
            max_num_queued_tokens=args.sim_max_num_queued_tokens,
            role=role,
            kv_lease_s=args.sim_kv_lease_s,
            kv_transfer_s_per_block=args.sim_kv_transfer,
            long_prefill_token_threshold=args.sim_long_prefill,
        ) for i, role in enumerate(roles)]
    except ValueError as exc:
        print(f"zp-client sim: {exc}", file=sys.stderr)
        return 2

    async def main() -> None:
        for server, role in zip(servers, roles, strict=True):
            await server.start()
            what = f"{role} server " if role else ""
            print(f"zp-client sim: serving model {server.model!r} (profile {args.sim_profile}, "
                  f"{server.num_gpu_blocks} blocks, max_model_len {server.max_model_len}, "
                  f"speedup {args.sim_speedup:g}) as {what}at {server.base_url}", file=sys.stderr, flush=True)
        try:
            await asyncio.gather(*(server.wait_closed() for server in servers))
        finally:
            for server in servers:
                await server.aclose()
                st = server.stats()
                print(f"zp-client sim: {server.base_url} stopped after {st['engine']['steps']} steps, "
                      f"{st['engine']['preemptions_total']} preemptions, max lag {st['max_lag_s']:.3f} s"
                      + (" (LAGGING: could not keep up with the speedup)" if st["lagging"] else ""),
                      file=sys.stderr)

    with contextlib.suppress(KeyboardInterrupt):  # Ctrl-C is how a foreground server stops
        asyncio.run(main())
    return 0
