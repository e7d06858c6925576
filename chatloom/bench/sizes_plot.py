"""One figure from `chatloom bench sizes` results: each server's figures per model, side by side.

Several result files can be drawn together (one run per model is the usual way to measure; a server
can also come from a run of its own), so the plot merges the files' models by file name. Each panel is one figure of merit; lower is better
except for output tokens per second.
"""
from __future__ import annotations

from pathlib import Path

PANELS: list[tuple[str, str, tuple[str, ...]]] = [
    ("1 in flight: TPOT p50 (ms)", "lower is better", ("one_in_flight", "tpot_p50_ms")),
    ("TTFT, long prompt (s)", "lower is better", ("one_in_flight", "long_prompt_ttft_ms")),
    ("8 in flight: output tok/s", "higher is better", ("in_flight", "output_tok_s")),
    ("8 in flight: TTFT p90 (s)", "lower is better", ("in_flight", "ttft_p90_ms")),
    ("TPOT beside a busy process / quiet", "lower is better", ("busy", "over_quiet")),
    ("resident memory after load (MiB)", "lower is better", ("rss_after_load_mib",)),
]
SECONDS = {"long_prompt_ttft_ms", "ttft_p90_ms"}


def figure_value(server: dict, path: tuple[str, ...]) -> float | None:
    """The figure at `path` in one server's result, in the unit its panel shows (None when missing)."""
    value: object = server
    for key in path:
        if not isinstance(value, dict) or key not in value:
            return None
        value = value[key]
    if value is None:
        return None
    return float(value) / 1000 if path[-1] in SECONDS else float(value)


def models_of(results: list[dict]) -> list[tuple[str, dict]]:
    """(label, servers) per model, in the order first seen. Runs of the same model file are merged, so
    each server may come from its own run (a later run's server replaces an earlier one's); skipped or
    failed servers are left out."""
    merged: dict[str, dict] = {}
    for result in results:
        for m in result["models"]:
            servers = merged.setdefault(Path(m["model"]).stem, {})
            servers.update({n: s for n, s in m["servers"].items() if "skipped" not in s and "error" not in s})
    return list(merged.items())


def plot_sizes(results: list[dict], path: str | Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    models = models_of(results)
    servers = sorted({n for _, s in models for n in s}, key=lambda n: (n != "chatloom", n))
    fig, axes = plt.subplots(2, 3, figsize=(13, 7))
    width = 0.8 / max(len(servers), 1)
    for ax, (title, better, key) in zip(axes.flat, PANELS):
        for i, name in enumerate(servers):
            xs, ys = [], []
            for j, (_, by_server) in enumerate(models):
                value = figure_value(by_server[name], key) if name in by_server else None
                if value is not None:
                    xs.append(j + (i - (len(servers) - 1) / 2) * width)
                    ys.append(value)
            bars = ax.bar(xs, ys, width, label=name)
            ax.bar_label(bars, fmt=lambda v: f"{v:.3g}" if v < 1000 else f"{v:,.0f}", fontsize=7)
        ax.set_title(f"{title}\n({better})", fontsize=9)
        ax.set_xticks(range(len(models)))
        ax.set_xticklabels([label for label, _ in models], fontsize=8)
        ax.grid(axis="y", alpha=0.3)
        if key == ("busy", "over_quiet"):
            ax.set_yscale("log")  # one server's 1.8x beside another's 68x
    axes.flat[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
