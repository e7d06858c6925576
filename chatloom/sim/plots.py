"""PNG charts of simulated figures: latency against load, replicas needed against peak rate.

matplotlib with the Agg backend (files only, no display); imported only when --plot is given.
"""
from __future__ import annotations

from pathlib import Path


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def latency_vs_load(points: list[dict], slo_ttft_ms: float, slo_tpot_ms: float, path: str | Path,
                    title: str = "") -> Path:
    """points: {"label", "rate", "summary"} per simulated run; one line per label."""
    plt = _plt()
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    labels = sorted({p["label"] for p in points})
    for label in labels:
        pts = sorted((p for p in points if p["label"] == label), key=lambda p: p["rate"])
        x = [p["rate"] for p in pts]
        s = [p["summary"] for p in pts]
        axes[0].plot(x, [v["ttft_ms"]["p90"] or float("nan") for v in s], marker="o", label=label)
        axes[1].plot(x, [v["tpot_ms"]["p90"] or float("nan") for v in s], marker="o", label=label)
        axes[2].plot(x, [v["goodput_rps"] for v in s], marker="o", label=label)
    axes[0].axhline(slo_ttft_ms, color="grey", linestyle="--", linewidth=1, label="SLO")
    axes[1].axhline(slo_tpot_ms, color="grey", linestyle="--", linewidth=1, label="SLO")
    axes[0].set(xlabel="offered load (requests/s)", ylabel="TTFT p90 (ms)", yscale="log")
    axes[1].set(xlabel="offered load (requests/s)", ylabel="TPOT p90 (ms)")
    axes[2].set(xlabel="offered load (requests/s)", ylabel="goodput (requests/s within SLO)")
    for ax in axes:
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def replicas_vs_peak(points: list[dict], path: str | Path, title: str = "") -> Path:
    """points: {"peak_tokens_per_s", "replicas" (simulated), "seed_servers", "estimate"} per plan."""
    plt = _plt()
    pts = sorted(points, key=lambda p: p["peak_tokens_per_s"])
    x = [p["peak_tokens_per_s"] / 1e6 for p in pts]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(x, [p["replicas"] for p in pts], marker="o", label="simulated: smallest fleet meeting the SLO")
    ax.plot(x, [p["estimate"] for p in pts], marker="^", linestyle=":", label="roofline estimate (no queueing)")
    ax.plot(x, [p["seed_servers"] for p in pts], marker="s", linestyle="--", label="seeds: peak / 1,000 tokens/s")
    ax.set(xlabel="peak output (million tokens/s)", ylabel="replicas")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def autoscale_day(runs: dict, path: str | Path) -> Path:
    """runs: sim.autoscale_day.compare's result; capacity each controller provides against the load,
    and the degrade ladder's level, over the measured (second) day."""
    plt = _plt()
    fig, (ax, lad) = plt.subplots(2, 1, figsize=(9, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    trace = runs["oracle"]["trace"]
    day = len(trace) // 2
    hours = [t[0] - 24 for t in trace[day:]]
    ax.plot(hours, [t[1] for t in trace[day:]], color="black", linewidth=1.2, label="arrivals (requests/s)")
    for name, style in (("predictive", "-"), ("reactive", "--"), ("oracle", ":")):
        ax.plot(hours, [t[2] for t in runs[name]["trace"][day:]], linestyle=style,
                label=f"{name}: capacity of ready replicas (undegraded requests/s)")
        if name != "oracle":
            lad.step(hours, [t[3] for t in runs[name]["trace"][day:]], linestyle=style, where="post", label=name)
    ax.set(ylabel="requests/s")
    lad.set(xlabel="hour of the day", ylabel="ladder level", yticks=[0, 1, 2, 3])
    for a in (ax, lad):
        a.grid(True, alpha=0.3)
        a.legend(fontsize=8)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
