"""`chatloom sim-day`: the predictive autoscaler against a reactive one and an oracle over two
simulated days (the second with a sudden burst); a table, JSON with --json, a plot with --plot."""
from __future__ import annotations

import argparse
import json

from chatloom.argtypes import positive_float, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-day", help="predictive against reactive autoscaling over a simulated day")
    p.add_argument("--capacity-rps", type=positive_float, default=1.0,
                   help="requests per second one replica serves within its SLO (default 1.0)")
    p.add_argument("--peak-replicas", type=positive_int, default=150,
                   help="the daily peak, as replicas it needs at that capacity (default 150)")
    p.add_argument("--startup-s", type=float, default=300.0, help="seconds from asking for a replica to ready")
    p.add_argument("--headroom", type=float, default=1.2, help="provision this much above the forecast")
    p.add_argument("--interval-s", type=positive_float, default=60.0, help="the controller's interval")
    p.add_argument("--scale-down-hold-s", type=float, default=300.0)
    p.add_argument("--burst-factor", type=positive_float, default=1.6, help="the second day's burst, x the curve")
    p.add_argument("--ttft-s", type=positive_float, default=2.0, help="the TTFT target requests must meet")
    p.add_argument("--min-replicas", type=positive_int, default=10)
    p.add_argument("--max-replicas", type=positive_int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="DIR", help="write autoscale_day.png there")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sim_day)


def cmd_sim_day(args) -> int:
    from chatloom.serving.autoscale import AutoscaleConfig
    from chatloom.sim.autoscale_day import DayLoad, compare

    config = AutoscaleConfig(args.min_replicas, args.max_replicas, args.capacity_rps, args.startup_s,
                             args.interval_s, args.headroom, args.scale_down_hold_s)  # ValueError: one line
    load = DayLoad(peak_rps=args.peak_replicas * args.capacity_rps, burst_factor=args.burst_factor)
    runs = compare(load, config, args.ttft_s, args.seed)
    out = {"command": "sim-day", "peak_rps": load.peak_rps, "capacity_rps": args.capacity_rps,
           "startup_s": args.startup_s, "headroom": args.headroom, "ttft_s": args.ttft_s,
           "runs": [{k: (float(v) if k == "slo_attainment" else v) for k, v in r.items() if k != "trace"}
                    for r in runs.values()]}
    if args.plot:
        from chatloom.sim.plots import autoscale_day

        out["plot"] = str(autoscale_day(runs, f"{args.plot}/autoscale_day.png"))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"peak {load.peak_rps:g} requests/s, {args.capacity_rps:g} per replica, start-up {args.startup_s:g} s, "
          f"TTFT target {args.ttft_s:g} s; second day (with a x{args.burst_factor:g} burst)")
    print(f"{'controller':<12} {'SLO met':>9} {'replica-hours':>14} {'x oracle':>9} {'peak replicas':>14}")
    for r in out["runs"]:
        print(f"{r['controller']:<12} {100 * r['slo_attainment']:>8.2f}% {r['replica_hours']:>14,.1f} "
              f"{r['replica_hours_vs_oracle']:>9.3f} {r['peak_replicas']:>14,}")
    if "plot" in out:
        print(f"plot: {out['plot']}")
    return 0
