"""Plots of online results: acceptance length and output tokens/s against K, per method."""

from __future__ import annotations

from pathlib import Path

from peagle.eval.online import BASELINE, OnlineResult
from peagle.fileio import atomic_path

LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D"]


def plot_online(result: OnlineResult, out_path: str | Path, *, title: str | None = None) -> Path:
    """Write a PNG: left, acceptance length vs K; right, output tokens/s vs K with the baseline.

    One colour per method, one line style per concurrency level; the no-speculation
    baseline is a horizontal line (acceptance length 1 by definition).
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    out_path = Path(out_path)
    levels = sorted({r.concurrency for r in result.rows})
    methods = result.methods()
    fig, (ax_al, ax_tps) = plt.subplots(1, 2, figsize=(11, 4.2))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, method in enumerate(methods):
        for j, c in enumerate(levels):
            rows = sorted((r for r in result.rows if r.method == method and r.concurrency == c), key=lambda r: r.k)
            if not rows:
                continue
            style = dict(
                color=colors[i % len(colors)],
                linestyle=LINESTYLES[j % len(LINESTYLES)],
                marker=MARKERS[j % len(MARKERS)],
            )
            label = method if len(levels) == 1 else f"{method}, c={c}"
            ks = [r.k for r in rows]
            al = [r.acceptance_length if r.acceptance_length is not None else float("nan") for r in rows]
            ax_al.plot(ks, al, label=label, **style)
            ax_tps.plot(ks, [r.output_tokens_per_s for r in rows], label=label, **style)
    for j, c in enumerate(levels):
        base = result.baseline(c)
        if base is not None:
            label = BASELINE if len(levels) == 1 else f"{BASELINE}, c={c}"
            style = LINESTYLES[j % len(LINESTYLES)]
            ax_tps.axhline(base.output_tokens_per_s, color="gray", linestyle=style, label=label)
    if any(result.baseline(c) is not None for c in levels):
        ax_al.axhline(1.0, color="gray", linestyle="-", label=BASELINE)
    all_ks = sorted({r.k for r in result.rows if r.k})
    for ax, ylabel in ((ax_al, "acceptance length (tokens / target pass)"), (ax_tps, "output tokens / s")):
        ax.set_xlabel("K (speculative tokens)")
        ax.set_ylabel(ylabel)
        if all_ks:
            ax.set_xticks(all_ks)
            ax.set_xlim(min(all_ks) - 0.5, max(all_ks) + 0.5)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    ax_al.set_ylim(bottom=0)
    ax_tps.set_ylim(bottom=0)
    prompts = result.prompt_set or "prompts"
    fig.suptitle(title or f"{Path(result.target).name}: {prompts}, {result.max_tokens} new tokens, greedy")
    fig.tight_layout()
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return out_path
