"""`--plot out.png`: four panels against the sweep's levels (concurrency or rate), matplotlib's Agg
backend (no display needed). matplotlib is the optional extra `ops` (`pip install 'sluice[ops]'`).

* output throughput (tok/s): the whole run in black, each tier in its own colour;
* TTFT p50 (solid, circles) and p99 (dashed, squares), the same colours;
* ITL p50 (solid) and p99 (dashed);
* requests by backend: stacked bars per level (local, each remote provider, unknown), failed requests
  stacked on top in red, and above each bar the local / remote split of the answered ones.

An embeddings run (`--endpoint embeddings`) has no stream: its panels are inputs/s, latency p50 / p99,
prompt tokens/s and the same backend bars.

Levels sit at even spacing, labelled with their value (sweeps are usually geometric: 1, 4, 16, 64).
"""

from __future__ import annotations

import math
from pathlib import Path

from loadgen.report import endpoint_of
from loadgen.stats import num, sub

_TIER_COLOURS = ("tab:blue", "tab:orange", "tab:purple", "tab:brown", "tab:pink", "tab:olive", "tab:cyan")
# Not the tiers' blue and orange: a colour means one thing across the panels.
_REMOTE_COLOURS = ("tab:purple", "tab:cyan", "tab:olive", "tab:brown", "tab:pink", "slateblue", "goldenrod")


class PlotUnavailable(RuntimeError):
    pass


def _tick(level: dict[str, object]) -> str:
    lv = sub(level, "level")
    if lv.get("rate") is not None:
        return f"{lv['rate']}/s" if lv.get("rate") == "inf" else f"{num(lv, 'rate'):g}/s"
    return str(lv.get("concurrency", "?"))


def backend_colour(name: str, remotes: list[str]) -> str:
    if name == "local":
        return "tab:green"
    if name == "unknown":
        return "tab:gray"
    return _REMOTE_COLOURS[remotes.index(name) % len(_REMOTE_COLOURS)] if name in remotes else "tab:gray"


def plot(levels: list[dict[str, object]], path: str | Path, title: str = "") -> None:
    try:
        import matplotlib
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install 'sluice[ops]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.lines import Line2D

    summaries = [sub(lv, "summary") for lv in levels]
    xs = list(range(len(levels)))
    ticks = [_tick(lv) for lv in levels]
    is_rate = bool(levels) and sub(levels[0], "level").get("rate") is not None
    xlabel = "request rate (Poisson arrivals)" if is_rate else "concurrency (requests in flight)"
    tiers = sorted({t for s in summaries for t in sub(s, "by_tier")})
    series: list[tuple[str, str, list[dict[str, object]]]] = [("all", "black", summaries)]
    if len(tiers) > 1:
        series += [(f"tier {t}", _TIER_COLOURS[i % len(_TIER_COLOURS)], [sub(s, "by_tier", t) for s in summaries])
                   for i, t in enumerate(tiers)]

    def values(groups: list[dict[str, object]], *p: str) -> list[float]:
        return [v if (v := num(g, *p)) is not None else math.nan for g in groups]

    # (title, y label, metric, percentiles?) of the three line panels: top left, top right, bottom left
    if summaries and endpoint_of(summaries[0]) == "embeddings":
        panels = (("Inputs embedded", "inputs / s", "input_rate", False), ("Latency", "ms", "e2e_ms", True),
                  ("Prompt tokens", "prompt tokens / s", "prompt_throughput", False))
    else:
        panels = (("Output throughput", "output tokens / s", "output_throughput", False),
                  ("Time to first token", "ms", "ttft_ms", True), ("Inter-token latency", "ms", "itl_ms", True))
    fig, axes = plt.subplots(2, 2, figsize=(13, 9), layout="constrained")
    (ax_tp, ax_ttft), (ax_itl, ax_be) = axes
    for ax, (panel_title, ylabel, metric, pcts) in zip((ax_tp, ax_ttft, ax_itl), panels):
        for name, colour, groups in series:
            width = 2.4 if name == "all" else 1.6
            if not pcts:
                ax.plot(xs, values(groups, metric), marker="o", color=colour, linewidth=width, label=name)
                continue
            ax.plot(xs, values(groups, metric, "p50"), marker="o", color=colour, linewidth=width,
                    label=f"{name} p50")
            ax.plot(xs, values(groups, metric, "p99"), marker="s", color=colour, linewidth=width,
                    linestyle="--", label=f"{name} p99")
        ax.set_title(panel_title)
        ax.set_ylabel(ylabel)

    backends = sorted({b for s in summaries for b in sub(s, "by_backend")},
                      key=lambda b: (b != "local", b == "unknown", b))
    remotes = [b for b in backends if b not in ("local", "unknown")]
    bottom = [0.0] * len(levels)
    for b in backends:
        counts = [num(s, "by_backend", b, "ok") or 0.0 for s in summaries]
        if any(counts):
            ax_be.bar(xs, counts, bottom=bottom, color=backend_colour(b, remotes), label=b, width=0.6)
            bottom = [x + c for x, c in zip(bottom, counts)]
    errors = [num(s, "errors") or 0.0 for s in summaries]
    if any(errors):
        ax_be.bar(xs, errors, bottom=bottom, color="tab:red", hatch="//", label="failed", width=0.6)
    tops = [b + e for b, e in zip(bottom, errors)]
    if any(b != "unknown" for b in backends):  # the local / remote split of the answered requests, above each bar
        for x, ok_total in enumerate(bottom):
            local = num(summaries[x], "by_backend", "local", "ok") or 0.0
            remote = sum(num(summaries[x], "by_backend", b, "ok") or 0.0 for b in remotes)
            if ok_total:
                ax_be.annotate(f"local {100 * local / ok_total:.0f}% / remote {100 * remote / ok_total:.0f}%",
                               (x, tops[x]), ha="center", va="bottom", fontsize=8, xytext=(0, 3),
                               textcoords="offset points")
    ax_be.set_title("Requests by backend (x-sluice-backend)")
    ax_be.set_ylabel("requests")
    ax_be.set_ylim(0, max(tops, default=1.0) * 1.4 or 1.0)  # room for the split and the legend above the bars

    # Percentile panels: colour says the series, line style the percentile (one legend entry each).
    handles = [Line2D([], [], color=colour, linewidth=2.4 if name == "all" else 1.6, label=name)
               for name, colour, _ in series]
    handles += [Line2D([], [], color="gray", marker="o", label="p50"),
                Line2D([], [], color="gray", marker="s", linestyle="--", label="p99")]
    for ax in (ax_tp, ax_ttft, ax_itl, ax_be):
        ax.set_xticks(xs, ticks)
        ax.set_xlabel(xlabel)
        ax.grid(True, alpha=0.3)
        if ax is not ax_be:
            ax.set_ylim(bottom=0)
        ax.set_xlim(-0.5, len(xs) - 0.5)
        if ax is not ax_be and panels[(ax_tp, ax_ttft, ax_itl).index(ax)][3]:
            ax.legend(handles=handles, fontsize=8, loc="best")
        elif ax is ax_be:
            ax.legend(fontsize=8, loc="upper center", ncol=min(4, len(backends) + 1))
        else:
            ax.legend(fontsize=8, loc="best")
    if title:
        fig.suptitle(title, fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)
