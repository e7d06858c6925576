"""`chatloom sim-day`: the predictive autoscaler against a reactive one and an oracle over two
simulated days (the second with a sudden burst); a table, JSON with --json, a plot with --plot."""
from __future__ import annotations

import argparse
import json

from chatloom.argtypes import positive_float, positive_int


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim-day", help="predictive against reactive autoscaling over a simulated day")
    p.add_argument("--model", default="llama-70b", help="the fleet's model (a shipped example or config.json)")
    p.add_argument("--gpu", default="h100", help="its GPU (roofline step-time model)")
    p.add_argument("--gpus-per-replica", type=positive_int, default=8)
    p.add_argument("--small-model", default="llama-3.1-8b",
                   help="the degrade ladder's smaller model for the free tier, on one GPU ('none': no such step)")
    p.add_argument("--no-ladder", action="store_true", help="run without the degrade ladder")
    p.add_argument("--peak-replicas", type=positive_int, default=150,
                   help="the daily peak, as replicas it needs undegraded (default 150)")
    p.add_argument("--startup-s", type=float, default=300.0, help="seconds from asking for a replica to ready")
    p.add_argument("--headroom", type=float, default=1.1, help="provision this much above the forecast")
    p.add_argument("--interval-s", type=positive_float, default=60.0, help="the controller's interval")
    p.add_argument("--scale-down-hold-s", type=float, default=300.0)
    p.add_argument("--burst-factor", type=positive_float, default=1.6, help="the second day's burst, x the curve")
    p.add_argument("--ttft-s", type=positive_float, default=2.0, help="the interactive classes' TTFT target")
    p.add_argument("--tpot-s", type=positive_float, default=0.05, help="the interactive classes' TPOT target")
    p.add_argument("--reasoning-ttft-s", type=positive_float, default=10.0)
    p.add_argument("--batch-ttft-s", type=positive_float, default=900.0)
    p.add_argument("--step-s", type=positive_float, default=1.0, help="the fluid model's time step")
    p.add_argument("--min-replicas", type=positive_int, default=10)
    p.add_argument("--max-replicas", type=positive_int, default=10_000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--plot", default=None, metavar="DIR", help="write autoscale_day.png there")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_sim_day)


def cmd_sim_day(args) -> int:
    from chatloom.serving.autoscale import AutoscaleConfig
    from chatloom.sim.autoscale_day import DayLoad, build_model, compare, sim_settings

    small = None if args.small_model.lower() == "none" else args.small_model
    traffic, degrade = sim_settings(args.ttft_s, args.tpot_s, args.reasoning_ttft_s, args.batch_ttft_s, small)
    model = build_model(traffic, None if args.no_ladder else degrade, args.model, args.gpu, args.gpus_per_replica,
                        step_s=args.step_s)  # ValueError (unknown model, GPU): one line
    config = AutoscaleConfig(args.min_replicas, args.max_replicas, model.capacity_rps, args.startup_s,
                             args.interval_s, args.headroom, args.scale_down_hold_s)
    load = DayLoad(peak_rps=args.peak_replicas * model.capacity_rps, burst_factor=args.burst_factor)
    runs = compare(load, config, model, args.seed)
    out = {"command": "sim-day", "model": args.model, "gpu": args.gpu, "small_model": None if args.no_ladder else small,
           "ladder": not args.no_ladder, "peak_rps": round(load.peak_rps, 2),
           "capacity_rps": round(model.capacity_rps, 4), "startup_s": args.startup_s, "headroom": args.headroom,
           "classes": [{"class": c.name, "share": c.share, "ttft_target_s": c.ttft_s,
                        "replica_s_per_request_by_level": [round(w, 5) for w in c.work]} for c in model.classes],
           "runs": [{k: v for k, v in r.items() if k != "trace"} for r in runs.values()]}
    if args.plot:
        from chatloom.sim.plots import autoscale_day

        out["plot"] = str(autoscale_day(runs, f"{args.plot}/autoscale_day.png"))
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"{args.model} on {args.gpus_per_replica}x{args.gpu}: {model.capacity_rps:.2f} requests/s per replica; "
          f"peak {load.peak_rps:,.0f} requests/s, start-up {args.startup_s:g} s, headroom {args.headroom:g}; "
          f"second day (a x{args.burst_factor:g} burst at 10:00), "
          f"{'with the degrade ladder' if not args.no_ladder else 'no degrade ladder'}")
    names = [c.name for c in model.classes]
    print(f"{'controller':<11} {'all':>8} " + " ".join(f"{n:>16}" for n in names)
          + f" {'replica-h':>10} {'x oracle':>8} {'peak':>5}")
    for r in out["runs"]:
        cells = " ".join(f"{100 * r['by_class'][n]['slo_attainment']:>15.2f}%" for n in names)
        print(f"{r['controller']:<11} {100 * r['slo_attainment']:>7.2f}% {cells} {r['replica_hours']:>10,.1f} "
              f"{r['replica_hours_vs_oracle']:>8.3f} {r['peak_replicas']:>5,}")
    print("requests degraded, per step: " + "; ".join(
        f"{r['controller']}: " + ", ".join(f"{k} {v:,}" for k, v in r["degraded_requests"].items())
        for r in out["runs"]))
    if "plot" in out:
        print(f"plot: {out['plot']}")
    return 0
