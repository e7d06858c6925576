"""`chatloom sim` and `chatloom plan`: the fleet simulator and the capacity planner on the command line.

Both print JSON (sim) or a report (plan, JSON with --json); `--plot DIR` writes PNG charts. A
replica is described either from published figures (--model, --gpu, --gpus-per-replica: the roofline
step-time model) or by a step-time JSON from `chatloom bench calibrate` (--step-time), or by the
seeds' own batching table (--step-time seeds).
"""
from __future__ import annotations

import argparse
import json
import sys

from chatloom.argtypes import float_in, positive_float, positive_int

_fraction = float_in(0.0, 1.0, "must be between 0 and 1")
_efficiency = float_in(0.0, 1.0, "must be in (0, 1]", lo_open=True)


def _replica_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("replica")
    g.add_argument("--model", default="llama-70b", help="a shipped example config (llama-70b) or a config.json path")
    g.add_argument("--gpu", default="h100", help="a100, h100, h200, b200 or l40s (published figures)")
    g.add_argument("--gpus-per-replica", type=positive_int, default=8)
    g.add_argument("--weight-dtype", default="bf16", choices=("bf16", "fp16", "fp8"))
    g.add_argument("--kv-dtype", default="fp16", choices=("bf16", "fp16", "fp8"))
    g.add_argument("--compute-efficiency", type=_efficiency, default=0.5, help="share of peak FLOP/s reached")
    g.add_argument("--memory-efficiency", type=_efficiency, default=0.7, help="share of peak bandwidth reached")
    g.add_argument("--step-overhead-ms", type=float, default=3.0, help="fixed cost of every step")
    g.add_argument("--step-time", default=None, metavar="FILE|seeds",
                   help="a step-time JSON (chatloom bench calibrate) instead of the roofline; 'seeds': the seeds' "
                        "batching table (20 ms at 1, 32 ms at 32, at most 32 sequences)")
    g.add_argument("--kv-blocks", type=positive_int, default=None,
                   help="with --step-time: KV pool size in 16-token blocks (default: sized from --model and --gpu)")
    g.add_argument("--max-num-seqs", type=positive_int, default=256)
    g.add_argument("--max-num-batched-tokens", type=positive_int, default=2048)


def _traffic_args(p: argparse.ArgumentParser, rate_required: bool) -> None:
    g = p.add_argument_group("traffic")
    if rate_required:
        load = g.add_mutually_exclusive_group(required=True)
        load.add_argument("--rate", type=positive_float, help="peak messages (requests) per second, whole fleet")
        load.add_argument("--peak-tokens-per-s", type=positive_float, help="peak generated tokens per second")
    g.add_argument("--mean-turns", type=float, default=3.0)
    g.add_argument("--think-time", type=positive_float, default=20.0, help="mean seconds between answer and reply")
    g.add_argument("--system-prompt-tokens", type=int, default=200)
    g.add_argument("--user-median-tokens", type=positive_float, default=80.0)
    g.add_argument("--answer-median-tokens", type=positive_float, default=360.0)
    g.add_argument("--reasoning-share", type=_fraction, default=0.1)
    g.add_argument("--reasoning-median-tokens", type=positive_float, default=2000.0)
    g.add_argument("--diurnal-trough", type=float_in(0.0, 1.0, "must be in (0, 1]", lo_open=True), default=0.35)
    g.add_argument("--start-hour", type=float, default=0.0, help="hours after the daily peak the simulation starts")
    g.add_argument("--burst-factor", type=positive_float, default=1.0)
    g.add_argument("--burst-start", type=float, default=0.0, help="seconds")
    g.add_argument("--burst-duration", type=float, default=0.0, help="seconds")


def _sim_args(p: argparse.ArgumentParser, duration: float) -> None:
    g = p.add_argument_group("simulation")
    g.add_argument("--duration", type=positive_float, default=duration, help="simulated seconds of traffic")
    g.add_argument("--warmup", type=float, default=None, help="seconds not counted (default: a fifth, at most 300)")
    g.add_argument("--queue-timeout", type=positive_float, default=60.0, help="seconds unscheduled before a 503")
    g.add_argument("--cell-size", type=positive_int, default=16, help="replicas behind one router")
    g.add_argument("--sample-cells", type=positive_int, default=1, help="cells simulated (the rest are alike)")
    g.add_argument("--processes", type=positive_int, default=1, help="cells simulated in parallel")
    g.add_argument("--no-prefix-caching", action="store_true")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--slo-ttft-ms", type=positive_float, default=2000.0)
    g.add_argument("--slo-tpot-ms", type=positive_float, default=50.0)
    g.add_argument("--attainment", type=_efficiency, default=0.99, help="share of requests that must meet the SLO")
    g.add_argument("--route-by-class-targets", action="store_true",
                   help="route as the live router does with class targets: chat requests carry --slo-ttft-ms, "
                        "reasoning requests --reasoning-ttft-ms, to replicas expected to meet them")
    g.add_argument("--reasoning-ttft-ms", type=positive_float, default=10000.0,
                   help="reasoning requests' TTFT target with --route-by-class-targets")
    g.add_argument("--progress", action="store_true", help="a progress bar on stderr")


def register(subparsers: argparse._SubParsersAction) -> None:
    p = subparsers.add_parser("sim", help="simulate a fleet (real scheduler and router, modelled GPUs); prints JSON")
    _replica_args(p)
    _traffic_args(p, rate_required=True)
    _sim_args(p, duration=600.0)
    p.add_argument("--replicas", type=positive_int, nargs="+", required=True, help="fleet sizes to simulate")
    p.add_argument("--policy", nargs="+", default=["prefix_aware"], help="routing policies (serving's names)")
    p.add_argument("--disagg", metavar="P:D", default=None,
                   help="also simulate P prefill + D decode replicas (P+D must equal a --replicas size)")
    p.add_argument("--link-gbps", type=positive_float, default=50.0, help="KV transfer link, GB/s (disaggregation)")
    p.add_argument("--load-factors", type=positive_float, nargs="+", default=None,
                   help="also run these multiples of --rate (for --plot's latency-against-load chart)")
    p.add_argument("--plot", default=None, metavar="DIR", help="write latency_vs_load.png there")
    p.set_defaults(func=cmd_sim)

    p = subparsers.add_parser("plan", help="the smallest fleet meeting an SLO, beside the seeds' arithmetic")
    _replica_args(p)
    _traffic_args(p, rate_required=True)
    _sim_args(p, duration=300.0)
    p.add_argument("--policy", default="prefix_aware", help="routing policy (serving's name)")
    p.add_argument("--tolerance", type=_efficiency, default=0.03, help="stop bisecting within this share")
    p.add_argument("--full", action="store_true",
                   help="bisect with full cell simulations (--cell-size, --duration) instead of sizing from the "
                        "step model and confirming with short probes of a small cell; slow above ~1e5 tokens/s")
    p.add_argument("--probe-replicas", type=positive_int, default=4, help="replicas in the fast planner's probe cell")
    p.add_argument("--probe-duration", type=positive_float, default=30.0,
                   help="simulated seconds of each fast-planner probe")
    p.add_argument("--plot", default=None, metavar="DIR", help="write replicas_vs_peak.png there")
    p.add_argument("--plot-fractions", type=positive_float, nargs="+", default=[0.25, 0.5, 1.0],
                   help="with --plot: plan also at these fractions of the peak")
    p.add_argument("--gpu-hour-price", type=positive_float, default=None, metavar="PRICE",
                   help="the hardware's price per GPU-hour: adds cost per million output tokens")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_plan)


# -- building blocks from arguments ---------------------------------------------------------

def replica_spec(args):
    from chatloom.sim.hardware import ReplicaSpec, model_config, gpu, roofline_replica, size_node
    from chatloom.sim.seeds import seed_step_time
    from chatloom.sim.step_time import load_step_time

    if args.step_time is None:
        return roofline_replica(args.model, args.gpu, args.gpus_per_replica, args.weight_dtype, args.kv_dtype,
                                args.compute_efficiency, args.memory_efficiency, args.step_overhead_ms / 1000,
                                args.max_num_seqs, args.max_num_batched_tokens)
    cfg = model_config(args.model)
    kv_per_token = cfg.kv_bytes_per_token(args.kv_dtype)
    if args.kv_blocks is not None:
        blocks = args.kv_blocks
    else:
        blocks = size_node(cfg, gpu(args.gpu), args.gpus_per_replica, args.weight_dtype, args.kv_dtype).num_blocks
    if args.step_time == "seeds":
        roof = roofline_replica(args.model, args.gpu, args.gpus_per_replica, args.weight_dtype, args.kv_dtype,
                                args.compute_efficiency, args.memory_efficiency).step_time
        per_prompt_token = 2.0 * roof.params / (roof.peak_flops * roof.num_gpus * roof.compute_efficiency)
        st, seqs = seed_step_time(per_prompt_token), min(args.max_num_seqs, 32)
    else:
        st, seqs = load_step_time(args.step_time), args.max_num_seqs
    return ReplicaSpec(num_blocks=blocks, step_time=st, max_num_seqs=seqs,
                       max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=min(cfg.max_position, 8192), model_key=args.model,
                       kv_bytes_per_token=kv_per_token, gpus=args.gpus_per_replica,
                       description=f"{args.model} with step-time model {args.step_time}, {blocks * 16:,} tokens of KV")


def traffic_model(args):
    from chatloom.sim.arrivals import TrafficModel

    kw = dict(mean_turns=args.mean_turns, think_time_s=args.think_time, system_prompt_tokens=args.system_prompt_tokens,
              user_median_tokens=args.user_median_tokens, answer_median_tokens=args.answer_median_tokens,
              reasoning_share=args.reasoning_share, reasoning_median_tokens=args.reasoning_median_tokens,
              diurnal_trough=args.diurnal_trough, start_offset_s=args.start_hour * 3600,
              burst_factor=args.burst_factor, burst_start_s=args.burst_start, burst_duration_s=args.burst_duration)
    if getattr(args, "peak_tokens_per_s", None):
        return TrafficModel.for_tokens_per_s(args.peak_tokens_per_s, **kw)
    return TrafficModel(peak_rate=args.rate, **kw)


def sim_config(args):
    from chatloom.sim.simulator import SimConfig

    warmup = args.warmup if args.warmup is not None else min(300.0, args.duration / 5)
    if not 0 <= warmup < args.duration:
        raise ValueError("--warmup must be at least 0 and shorter than --duration")
    # The conversation traffic's prompts part from a cached block at a block's edge: reusing part of one
    # saved 0.4% of the prompt tokens in a probe of the 2.5 M tokens/s plan, at 2.5x the run's cost.
    targets = {"interactive": args.slo_ttft_ms / 1000, "reasoning": args.reasoning_ttft_ms / 1000} \
        if args.route_by_class_targets else {}
    return SimConfig(duration_s=args.duration, warmup_s=warmup, queue_timeout_s=args.queue_timeout, seed=args.seed,
                     enable_prefix_caching=not args.no_prefix_caching, partial_block_hits=False, ttft_targets=targets)


def slo_of(args):
    from chatloom.sim.report import SLO

    return SLO(ttft_s=args.slo_ttft_ms / 1000, tpot_s=args.slo_tpot_ms / 1000, attainment=args.attainment)


def _check_policy(name: str) -> None:
    from chatloom.sim.fleet import make_policy

    make_policy(name)  # a clear error now rather than inside a worker


def _tier_names(traffic) -> dict[int, str]:
    return {t.priority: t.name for t in traffic.tiers}


# -- sim -----------------------------------------------------------------------------------

def cmd_sim(args) -> int:
    from chatloom.sim.fleet import run_fleet
    from chatloom.sim.report import summarize

    spec, traffic, cfg, slo = replica_spec(args), traffic_model(args), sim_config(args), slo_of(args)
    for name in args.policy:
        _check_policy(name)
    disagg = _parse_disagg(args.disagg, args.replicas) if args.disagg else None
    runs, points = [], []
    factors = args.load_factors or [1.0]
    for factor in factors:
        load = traffic.scaled(factor)
        for n in args.replicas:
            for name in args.policy:
                res = run_fleet(spec, n, name, load, cfg, cell_size=args.cell_size, sample_cells=args.sample_cells,
                                processes=args.processes, show_progress=args.progress)
                s = summarize(res.table, res.replicas, slo, cfg.warmup_s, cfg.duration_s, fleet_size=n,
                              tier_names=_tier_names(traffic))
                entry = {"mode": "colocated", "policy": name, "load_factor": factor, "offered_rate": load.peak_rate,
                         "cell_size": res.cell_size, "wall_seconds": round(res.wall_seconds, 2),
                         "events": sum(c.events for c in res.cells), **s}
                runs.append(entry)
                points.append({"label": f"{name}, {n} replicas", "rate": load.peak_rate, "summary": s})
            if disagg and disagg[0] + disagg[1] == n:
                entry = _run_disagg(spec, disagg, args, load, cfg, slo, n)
                runs.append(entry)
                points.append({"label": f"disagg {disagg[0]}:{disagg[1]}", "rate": load.peak_rate, "summary": entry})
    out = {"command": "sim", "replica": spec.description, "step_time": spec.step_time.to_dict(),
           "traffic": {"peak_rate": traffic.peak_rate, "mean_answer_tokens": round(traffic.mean_answer_tokens, 1),
                       "mean_turns": traffic.mean_turns, "reasoning_share": traffic.reasoning_share},
           "duration_s": cfg.duration_s, "warmup_s": cfg.warmup_s, "runs": runs}
    if args.plot:
        from chatloom.sim.plots import latency_vs_load

        out["plots"] = [str(latency_vs_load(points, args.slo_ttft_ms, args.slo_tpot_ms,
                                            f"{args.plot}/latency_vs_load.png", spec.description))]
    print(json.dumps(out, indent=2))
    return 0


def _parse_disagg(text: str, sizes: list[int]) -> tuple[int, int]:
    p, sep, d = text.partition(":")
    try:
        pd = (int(p), int(d))
    except ValueError:
        raise ValueError(f"--disagg takes P:D (prefill and decode replicas), got {text!r}") from None
    if not sep or min(pd) < 1:
        raise ValueError(f"--disagg takes P:D with both at least 1, got {text!r}")
    if sum(pd) not in sizes:
        raise ValueError(f"--disagg {text}: P+D = {sum(pd)} must be one of the --replicas sizes (equal hardware)")
    return pd


def _run_disagg(spec, pd, args, traffic, cfg, slo, n) -> dict:
    """One disaggregated fleet of P+D replicas (a single cell: the pools share one router)."""
    from chatloom.sim.disagg import DisaggSimulator
    from chatloom.sim.fleet import RequestTable, make_policy, replica_stats
    from chatloom.sim.report import summarize

    sim = DisaggSimulator(spec, pd[0], pd[1], make_policy(args.policy[0]), make_policy(args.policy[0]), traffic, cfg,
                          link_bytes_per_s=args.link_gbps * 1e9)
    run = sim.run()
    s = summarize(RequestTable.from_requests(run.requests), replica_stats(run), slo, cfg.warmup_s, cfg.duration_s, fleet_size=n,
                  tier_names=_tier_names(traffic))
    return {"mode": "disaggregated", "policy": args.policy[0], "prefill_replicas": pd[0], "decode_replicas": pd[1],
            "offered_rate": traffic.peak_rate, "kv_transfers": sim.transfers,
            "kv_transfer_ms_mean": round(1000 * sim.transfer_seconds / max(sim.transfers, 1), 3),
            "wall_seconds": round(run.wall_seconds, 2), "events": run.events, **s}


# -- plan ----------------------------------------------------------------------------------

def cmd_plan(args) -> int:
    from chatloom.sim.hardware import model_config
    from dataclasses import replace

    from chatloom.sim.planner import explain, plan_fast, plan_fleet
    from chatloom.sim.seeds import back_of_envelope

    spec, traffic, cfg, slo = replica_spec(args), traffic_model(args), sim_config(args), slo_of(args)
    _check_policy(args.policy)
    peak_tokens = traffic.peak_rate * traffic.mean_answer_tokens
    seeds = back_of_envelope(peak_tokens, model_config(args.model))

    def one(tr, show: bool):
        def on_probe(p):
            if show and not args.json:
                print(_probe_line(p), file=sys.stderr, flush=True)
        if not args.full:
            dur = min(args.probe_duration, cfg.duration_s)
            probe_cfg = replace(cfg, duration_s=dur, warmup_s=min(cfg.warmup_s, dur / 5))
            return plan_fast(spec, tr, args.policy, slo, probe_cfg, probe_replicas=args.probe_replicas,
                             on_probe=on_probe)
        return plan_fleet(spec, tr, args.policy, slo, cfg, cell_size=args.cell_size, sample_cells=args.sample_cells,
                          processes=args.processes, tolerance=args.tolerance, on_probe=on_probe)

    if not args.json:
        print(f"planning: {spec.description}", file=sys.stderr)
    plan = one(traffic, True)
    reasons = explain(seeds, plan, spec, traffic, peak_tokens)
    best = plan.best
    out = {"command": "plan", "replica": spec.description, "policy": args.policy,
           "peak_tokens_per_s": round(peak_tokens, 1), "peak_rate": round(traffic.peak_rate, 2),
           "slo": {"ttft_ms": args.slo_ttft_ms, "tpot_ms": args.slo_tpot_ms, "attainment": args.attainment},
           "replicas": plan.replicas, "gpus": plan.replicas * spec.gpus if plan.replicas else None,
           "estimate": plan.estimate, "seeds": seeds, "why_they_differ": reasons,
           "simulated": best.summary if best else None,
           "probes": [{"replicas": p.replicas, "ok": p.ok, "slo_attainment": p.summary["slo_attainment"],
                       "stopped": p.stop_reason or None}
                      for p in plan.probes],
           "method": "full" if args.full else "fast",
           "cell_size": args.cell_size if args.full else args.probe_replicas,
           "sample_cells": args.sample_cells if args.full else 1,
           "duration_s": cfg.duration_s if args.full else min(args.probe_duration, cfg.duration_s)}
    if args.gpu_hour_price is not None and plan.replicas:
        from chatloom.sim.cost import cost_report

        out["cost"] = cost_report(spec, traffic, plan.replicas, args.gpu_hour_price, slo.tpot_s,
                                  best.summary["prefix_hit_rate"] or 0.0)
    if args.plot:
        from chatloom.sim.plots import replicas_vs_peak

        pts = []
        for f in sorted(set(args.plot_fractions)):
            pl = plan if f == 1.0 else one(traffic.scaled(f), False)
            pts.append({"peak_tokens_per_s": peak_tokens * f, "replicas": pl.replicas or float("nan"),
                        "estimate": pl.estimate["replicas"], "seed_servers": peak_tokens * f / 1000.0})
        out["plot_points"] = pts
        out["plots"] = [str(replicas_vs_peak(pts, f"{args.plot}/replicas_vs_peak.png", spec.description))]
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        _print_plan(out)
    return 0


def _probe_line(p) -> str:
    s = p.summary
    head = f"  probe {p.replicas:>7,} replicas: "
    if p.ok is None:
        return head + f"prefix hit rate {s['prefix_hit_rate']} (stopped once every request of its window had its first token)"
    figures = (f"attainment {s['slo_attainment']}, TTFT p99 {s['ttft_ms']['p99']} ms, "
               f"TPOT p99 {s['tpot_ms']['p99']} ms, refused {s['refused']}")
    if p.stop_reason == "meets":
        return head + f"meets the SLO (stopped once certain; of the answers ended: {figures})"
    return head + f"{'meets' if p.ok else 'misses'} the SLO ({figures})" + (", stopped once certain" if p.stopped_early else "")


def _print_plan(out: dict) -> None:
    print(f"replica: {out['replica']}")
    print(f"peak: {out['peak_tokens_per_s']:,.0f} tokens/s = {out['peak_rate']:,.1f} messages/s; policy {out['policy']}; "
          f"SLO: TTFT <= {out['slo']['ttft_ms']:g} ms and TPOT <= {out['slo']['tpot_ms']:g} ms for "
          f"{100 * out['slo']['attainment']:g}% of requests")
    print()
    print(f"{'seeds back-of-envelope':<52} {'seed':>14} {'arithmetic':>14} {'diff':>7}")
    for r in out["seeds"]:
        if r["seed"] is None:
            print(f"{r['figure']:<52} {'':>14} {r['arithmetic']:>14,.0f}")
        else:
            print(f"{r['figure']:<52} {r['seed']:>14,.0f} {r['arithmetic']:>14,.0f} {100 * r['difference']:>6.1f}%")
    print()
    est = out["estimate"]
    print(f"roofline estimate: {est['replicas']:,} replicas (batch {est['batch']} at {est['step_ms']} ms/step = "
          f"{est['tokens_per_s']:,.0f} tokens/s per replica, no queueing)")
    if out["replicas"] is None:
        print("simulated: no fleet size up to the search limit met the SLO")
        return
    s = out["simulated"]
    print(f"simulated: {out['replicas']:,} replicas ({out['gpus']:,} GPUs) meet the SLO: attainment "
          f"{s['slo_attainment']}, TTFT p50/p99 {s['ttft_ms']['p50']:.0f}/{s['ttft_ms']['p99']:.0f} ms, "
          f"TPOT p50/p99 {s['tpot_ms']['p50']:.1f}/{s['tpot_ms']['p99']:.1f} ms, "
          f"{s['output_tokens_per_s_per_replica']:,.0f} tokens/s per replica, prefix hits "
          f"{100 * (s['prefix_hit_rate'] or 0):.0f}%")
    if "cost" in out:
        c = out["cost"]
        print(f"cost at {c['gpu_hour_price']:g} per GPU-hour: {c['fleet_cost_per_hour']:,.2f} per hour; per million "
              f"output tokens {c['per_million_output_tokens_at_planned_load']:,.4f} at the planned load, "
              f"{c['per_million_output_tokens_at_slo']:,.4f} at the SLO (batch {c['slo_batch']}, "
              f"{c['output_tokens_per_replica_second_at_slo']:,.0f} tokens per replica-second); batching saves "
              f"{100 * c['batching_saving']:.0f}%, prefix caching {100 * c['prefix_caching_saving']:.0f}%")
    print("why the simulated fleet differs from the seeds':")
    for line in out["why_they_differ"]:
        print(f"  - {line}")
    for path in out.get("plots", []):
        print(f"plot: {path}")
