"""The online results' plot: per prompt set, tokens per target step and output tokens/s against K.

Every method is drawn on the same footing: tokens per target step (``OnlineRow.tokens_per_step``),
output tokens per target forward pass over every decode step. vLLM's acceptance length is not
drawn: for a head it is the same figure, and for n-gram lookup it counts only the steps where
its lookup matched, so it is no per-step figure.
"""

from __future__ import annotations

import textwrap
from dataclasses import dataclass
from pathlib import Path

from peagle.catalogue import DESCRIPTIONS
from peagle.contract import NGRAM, NGRAM_DISPLAY
from peagle.eval.online import OnlineResult
from peagle.fileio import atomic_path

NO_SPECULATION = "no speculation"
TOKENS_PER_STEP_AXIS = "tokens per target step\n(output tokens / target forward passes)"
TOKENS_PER_S_AXIS = "output tokens / s"
K_AXIS = "K (speculative tokens)"
FOOTNOTE = (
    "Tokens per target step: output tokens per target forward pass over every decode step, drafting or not "
    "(no speculation: 1). A head drafts at every step, so this is its vLLM acceptance length (less the draft "
    "tokens vLLM counts past a request's end). n-gram lookup drafts only where its lookup matches and vLLM's "
    "acceptance length for it counts only those steps, so that figure is not drawn. n-gram lookup's bar runs "
    "down to the least its tokens per step can be: vLLM counts the draft tokens a request's last step accepted "
    "past its end (at most K a request), which the output drops."
)
LINESTYLES = ["-", "--", ":", "-."]
MARKERS = ["o", "s", "^", "D"]
DODGE = 0.07  # K offset between methods, so that points and bars at one K stay apart


@dataclass(frozen=True)
class Series:
    """One method's line over K: ``values`` and the least each can be (``lows``; the value where exact)."""

    method: str  # as the plot names it (``display_name``)
    ks: list[int]
    values: list[float]
    lows: list[float]
    concurrency: int




@dataclass(frozen=True)
class PromptSetPlot:
    """What one prompt set's row of the figure draws."""

    prompt_set: str
    levels: list[int]  # the concurrency levels measured; tokens per step are drawn at the first
    tokens_per_step: list[Series]  # every speculating method; no speculation is the line at 1
    tokens_per_s: list[Series]  # every method at every concurrency
    baseline_tokens_per_s: dict[int, float]  # concurrency -> output tokens/s of no speculation


def display_name(label: str) -> str:
    """How the plot names a row's method: the drafting method's name, n-gram lookup, or the label."""
    if label == NGRAM:
        return NGRAM_DISPLAY
    names = {d.label: d.display_name for d in DESCRIPTIONS.values()}
    return names.get(label, label)


def prompt_set_plot(measured: OnlineResult) -> PromptSetPlot:
    """The series of one prompt set: tokens per step at the lowest concurrency, tokens/s at each."""
    levels = sorted({r.concurrency for r in measured.rows})
    lowest = levels[0] if levels else 1
    per_step, per_s = [], []
    for method in measured.methods():
        most = measured.tokens_per_step_by_k(method, lowest)
        least = measured.min_tokens_per_step_by_k(method, lowest)
        if most:
            ks = sorted(most)
            per_step.append(Series(display_name(method), ks, [most[k] for k in ks], [least[k] for k in ks], lowest))
        for c in levels:
            rows = sorted((r for r in measured.rows if r.method == method and r.concurrency == c), key=lambda r: r.k)
            if rows:
                speeds = [r.output_tokens_per_s for r in rows]
                per_s.append(Series(display_name(method), [r.k for r in rows], speeds, speeds, c))
    baseline = {c: b.output_tokens_per_s for c in levels if (b := measured.baseline(c)) is not None}
    return PromptSetPlot(measured.prompt_set or "prompts", levels, per_step, per_s, baseline)


def plot_data(result: OnlineResult) -> list[PromptSetPlot]:
    """Every prompt set measured, in ``result.prompt_sets()`` order: one row of the figure each."""
    return [prompt_set_plot(measured) for measured in result.prompt_sets()]


def online_figure(result: OnlineResult, *, title: str | None = None):
    """A matplotlib figure: per prompt set, left tokens per target step vs K (no speculation at 1,
    n-gram lookup with the bar of its counting error), right output tokens/s vs K; one legend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sets = plot_data(result)
    levels = sorted({c for data in sets for c in data.levels})
    methods = list(dict.fromkeys(s.method for data in sets for s in [*data.tokens_per_step, *data.tokens_per_s]))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    style = _Style({m: colors[i % len(colors)] for i, m in enumerate(methods)},
                   {m: (i - (len(methods) - 1) / 2) * DODGE for i, m in enumerate(methods)},
                   {c: j for j, c in enumerate(levels)})
    footnote = textwrap.fill(FOOTNOTE, 190)
    bottom_in = 0.55 + 0.16 * footnote.count("\n") + 0.25 * (1 + (len(levels) > 1))
    height = 3.6 * len(sets) + 0.5 + bottom_in
    fig, axes = plt.subplots(len(sets), 2, figsize=(12, height), squeeze=False)
    all_ks = sorted({r.k for measured in result.prompt_sets() for r in measured.rows if r.k})
    for data, (ax_step, ax_speed) in zip(sets, axes, strict=True):
        _draw_tokens_per_step(ax_step, data, style)
        _draw_tokens_per_s(ax_speed, data, style)
        for ax in (ax_step, ax_speed):
            ax.set_xlabel(K_AXIS)
            if all_ks:
                ax.set_xticks(all_ks)
                ax.set_xlim(min(all_ks) - 0.5, max(all_ks) + 0.5)
            ax.grid(alpha=0.3)
    fig.suptitle(title or f"{Path(result.target).name}: {result.max_tokens} new tokens, greedy, vLLM")
    handles = _legend(methods, levels, style)
    fig.legend(handles=handles, loc="lower center", ncol=len(handles) if len(handles) <= 8 else (len(handles) + 1) // 2,
               fontsize=8.5, frameon=False, bbox_to_anchor=(0.5, (0.2 + 0.16 * footnote.count("\n")) / height))
    fig.text(0.01, 0.08 / height, footnote, fontsize=7.5, va="bottom", ha="left")
    fig.tight_layout(rect=(0, bottom_in / height, 1, 1))
    return fig


@dataclass(frozen=True)
class _Style:
    color: dict[str, str]  # method -> colour
    offset: dict[str, float]  # method -> K offset
    level: dict[int, int]  # concurrency -> line style index

    def line(self, c: int) -> dict:
        j = self.level[c]
        return {"linestyle": LINESTYLES[j % len(LINESTYLES)], "marker": MARKERS[j % len(MARKERS)]}


def _legend(methods: list[str], levels: list[int], style: _Style) -> list:
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color="gray", label=f"{NO_SPECULATION} (1 token a step)")]
    handles += [Line2D([], [], color=style.color[m], marker="o", label=m) for m in methods]
    if len(levels) > 1:
        handles += [Line2D([], [], color="black", label=f"c={c}", **style.line(c)) for c in levels]
    return handles


def _draw_tokens_per_step(ax, data: PromptSetPlot, style: _Style) -> None:
    ax.axhline(1.0, color="gray", linestyle="-")
    for series in data.tokens_per_step:
        color = style.color[series.method]
        xs = [k + style.offset[series.method] for k in series.ks]
        below = [v - low for v, low in zip(series.values, series.lows, strict=True)]
        yerr = [below, [0.0] * len(below)] if any(b > 0 for b in below) else None
        ax.errorbar(xs, series.values, yerr=yerr, color=color, marker="o", capsize=4)
        for x, v, low in zip(xs, series.values, series.lows, strict=True):
            text = f"{v:.2f}" if f"{low:.2f}" == f"{v:.2f}" else f"{low:.2f}-{v:.2f}"
            ax.annotate(text, (x, v), textcoords="offset points", xytext=(5, 4), fontsize=7.5, color=color)
    ax.set_ylabel(TOKENS_PER_STEP_AXIS)
    ax.set_title(f"{data.prompt_set}: tokens per target step ({_requests(data.levels[0])})", fontsize=10)
    low, high = ax.get_ylim()
    low = min(low, 0.95)
    ax.set_ylim(low, high + 0.08 * (high - low))


def _draw_tokens_per_s(ax, data: PromptSetPlot, style: _Style) -> None:
    for c in data.levels:
        if c in data.baseline_tokens_per_s:
            ax.axhline(data.baseline_tokens_per_s[c], color="gray", linestyle=style.line(c)["linestyle"])
    for series in data.tokens_per_s:
        xs = [k + style.offset[series.method] for k in series.ks]
        ax.plot(xs, series.values, color=style.color[series.method], **style.line(series.concurrency))
    ax.set_ylabel(TOKENS_PER_S_AXIS)
    where = _requests(data.levels[0]) if len(data.levels) == 1 else "c requests at a time"
    ax.set_title(f"{data.prompt_set}: output tokens/s ({where})", fontsize=10)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.06)


def _requests(c: int) -> str:
    return f"{c} request{'s' * (c > 1)} at a time"


def plot_online(result: OnlineResult, out_path: str | Path, *, title: str | None = None) -> Path:
    """Write ``online_figure`` as a PNG (atomically); returns its path."""
    import matplotlib.pyplot as plt

    out_path = Path(out_path)
    fig = online_figure(result, title=title)
    out_path.parent.mkdir(parents=True, exist_ok=True)
    with atomic_path(out_path) as tmp:
        fig.savefig(tmp, dpi=120)
    plt.close(fig)
    return out_path
