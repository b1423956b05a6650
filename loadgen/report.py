"""Tables (rich): one per level (the whole level, each tier, each backend), a sweep summary, and
`--compare` (ratios b / a of the main figures, level by level).

Everything here reads the JSON-shaped summaries (stats.summarise, or a `--json` file read back), so
`--compare` works on files written by any earlier run. An embeddings run's summaries (`"endpoint":
"embeddings"`) get their own columns: inputs/s and prompt tok/s, latency, each tier's and backend's
share, and no TTFT / ITL (there is no stream); a summary without `endpoint` is a chat run's."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from loadgen.stats import num, sub


def _f(x: float | None, digits: int = 1) -> str:
    if x is None:
        return "-"
    return f"{x:,.{digits}f}"


def _g(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _money(x: float | None) -> str:
    return "-" if x is None else f"${x:,.6f}"


def _pcts(group: dict[str, object], name: str) -> str:
    return " / ".join(_f(num(group, name, p)) for p in ("p50", "p90", "p99"))


def _errors(group: dict[str, object]) -> str:
    kinds = sub(group, "errors_by_kind")
    n = int(num(group, "errors") or 0)
    if not n:
        return "0"
    return f"{n} (" + ", ".join(f"{k}: {v}" for k, v in kinds.items()) + ")"


def _row_groups(summary: dict[str, object]) -> list[tuple[str, dict[str, object]]]:
    rows: list[tuple[str, dict[str, object]]] = [("all", summary)]
    tiers = sub(summary, "by_tier")
    if len(tiers) > 1:
        rows += [(f"tier {t}", sub(tiers, t)) for t in tiers]
    backends = sub(summary, "by_backend")
    if len(backends) > 1 or (backends and next(iter(backends)) != "unknown"):
        rows += [(f"backend {b}", sub(backends, b)) for b in backends]
    return rows


def endpoint_of(summary: dict[str, object]) -> str:
    """"chat" or "embeddings": what a summary measured (files from before embeddings have no field)."""
    return "embeddings" if summary.get("endpoint") == "embeddings" else "chat"


def _share(g: dict[str, object]) -> str:
    share = num(g, "share")
    return "" if share is None else f"{100 * share:.1f}%"


def embeddings_table(title: str, summary: dict[str, object]) -> Table:
    has_cost = sub(summary, "cost") != {}
    t = Table(title=title, title_justify="left", header_style="bold")
    t.add_column("")
    for col in ("ok / sent", "share", "req/s", "inputs/s", "prompt tok/s", "latency ms p50 / p90 / p99", "errors"):
        t.add_column(col, justify="right")
    if has_cost:
        t.add_column("cost", justify="right")
    for name, g in _row_groups(summary):
        row = [name, f"{int(num(g, 'ok') or 0)} / {int(num(g, 'requests') or 0)}", _share(g),
               _f(num(g, "request_rate"), 2), _f(num(g, "input_rate")), _f(num(g, "prompt_throughput")),
               _pcts(g, "e2e_ms"), _errors(g)]
        if has_cost:
            row.append(_money(num(g, "cost", "total")))
        t.add_row(*row)
    return t


def level_table(title: str, summary: dict[str, object]) -> Table:
    if endpoint_of(summary) == "embeddings":
        return embeddings_table(title, summary)
    has_slo = sub(summary, "goodput") != {}
    has_cost = sub(summary, "cost") != {}
    t = Table(title=title, title_justify="left", header_style="bold")
    t.add_column("")
    for col in ("ok / sent", "req/s", "out tok/s", "TTFT ms p50 / p90 / p99", "ITL ms p50 / p90 / p99",
                "e2e ms p50 / p90 / p99"):
        t.add_column(col, justify="right")
    if has_slo:
        t.add_column("goodput req/s (met)", justify="right")
    t.add_column("errors", justify="right")
    if has_cost:
        t.add_column("cost", justify="right")
    for name, g in _row_groups(summary):
        row = [name, f"{int(num(g, 'ok') or 0)} / {int(num(g, 'requests') or 0)}", _f(num(g, "request_rate"), 2),
               _f(num(g, "output_throughput")), _pcts(g, "ttft_ms"), _pcts(g, "itl_ms"), _pcts(g, "e2e_ms")]
        if has_slo:
            met = num(g, "goodput", "met")
            row.append(f"{_f(num(g, 'goodput', 'rate'), 2)} ({int(met or 0)})")
        row.append(_errors(g))
        if has_cost:
            row.append(_money(num(g, "cost", "total")))
        t.add_row(*row)
    return t


def usage_line(usage: dict[str, object]) -> str:
    """The gateway's own accounting of the level (`GET /v1/usage` after - before)."""
    tot = sub(usage, "totals")
    parts = [f"{int(num(tot, 'requests') or 0)} requests, {int(num(tot, 'prompt_tokens') or 0)} prompt "
             f"({int(num(tot, 'cached_tokens') or 0)} cached) + {int(num(tot, 'completion_tokens') or 0)} "
             f"completion tokens, {_money(num(tot, 'cost'))}"]
    for backend, v in sub(usage, "by_backend").items():
        parts.append(f"{backend}: {int(num(v, 'requests') or 0)} req {_money(num(v, 'cost'))}")
    return "gateway /v1/usage: " + "; ".join(parts)


def print_level(console: Console, level: dict[str, object]) -> None:
    summary = sub(level, "summary")
    label = str(sub(level, "level").get("label", "?"))
    console.print(level_table(f"{label}: {num(summary, 'duration_s') or 0:.2f} s", summary))
    usage = sub(level, "gateway_usage")
    if usage:
        console.print(usage_line(usage))


def _embeddings_sweep(levels: list[dict[str, object]]) -> Table:
    t = Table(title="sweep", title_justify="left", header_style="bold")
    for col in ("level", "req/s", "inputs/s", "prompt tok/s", "latency p50", "latency p90", "latency p99", "errors",
                "cost"):
        t.add_column(col, justify="left" if col == "level" else "right")
    for lv in levels:
        s = sub(lv, "summary")
        t.add_row(str(sub(lv, "level").get("label", "?")), _f(num(s, "request_rate"), 2), _f(num(s, "input_rate")),
                  _f(num(s, "prompt_throughput")), _f(num(s, "e2e_ms", "p50")), _f(num(s, "e2e_ms", "p90")),
                  _f(num(s, "e2e_ms", "p99")), str(int(num(s, "errors") or 0)), _money(num(s, "cost", "total")))
    return t


def sweep_table(levels: list[dict[str, object]]) -> Table:
    if levels and endpoint_of(sub(levels[0], "summary")) == "embeddings":
        return _embeddings_sweep(levels)
    t = Table(title="sweep", title_justify="left", header_style="bold")
    for col in ("level", "req/s", "out tok/s", "TTFT p50", "TTFT p99", "ITL p50", "ITL p99", "e2e p50", "e2e p99",
                "goodput req/s", "errors", "cost"):
        t.add_column(col, justify="left" if col == "level" else "right")
    for lv in levels:
        s = sub(lv, "summary")
        t.add_row(str(sub(lv, "level").get("label", "?")), _f(num(s, "request_rate"), 2),
                  _f(num(s, "output_throughput")), _f(num(s, "ttft_ms", "p50")), _f(num(s, "ttft_ms", "p99")),
                  _f(num(s, "itl_ms", "p50")), _f(num(s, "itl_ms", "p99")), _f(num(s, "e2e_ms", "p50")),
                  _f(num(s, "e2e_ms", "p99")), _f(num(s, "goodput", "rate"), 2), str(int(num(s, "errors") or 0)),
                  _money(num(s, "cost", "total")))
    return t


# (label, path in a summary): the figures --compare sets side by side.
COMPARED: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests/s", ("request_rate",)),
    ("output tok/s", ("output_throughput",)),
    ("TTFT p50 ms", ("ttft_ms", "p50")),
    ("TTFT p99 ms", ("ttft_ms", "p99")),
    ("ITL p50 ms", ("itl_ms", "p50")),
    ("ITL p99 ms", ("itl_ms", "p99")),
    ("e2e p50 ms", ("e2e_ms", "p50")),
    ("e2e p99 ms", ("e2e_ms", "p99")),
    ("goodput req/s", ("goodput", "rate")),
    ("error rate", ("error_rate",)),
    ("cost per 1k req $", ("cost", "per_1k_requests")),
)
COMPARED_EMBEDDINGS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("requests/s", ("request_rate",)),
    ("inputs/s", ("input_rate",)),
    ("prompt tok/s", ("prompt_throughput",)),
    ("latency p50 ms", ("e2e_ms", "p50")),
    ("latency p90 ms", ("e2e_ms", "p90")),
    ("latency p99 ms", ("e2e_ms", "p99")),
    ("error rate", ("error_rate",)),
    ("cost per 1k req $", ("cost", "per_1k_requests")),
)


def compared(summary: dict[str, object]) -> tuple[tuple[str, tuple[str, ...]], ...]:
    """The figures --compare sets side by side for a summary of this endpoint."""
    return COMPARED_EMBEDDINGS if endpoint_of(summary) == "embeddings" else COMPARED


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a == 0:
        return None
    return b / a


def pair_levels(a: list[dict[str, object]], b: list[dict[str, object]]) -> list[tuple[str, dict[str, object],
                                                                                          dict[str, object]]]:
    """Levels of a and b with the same label; when none match, by position."""
    def label(lv: dict[str, object]) -> str:
        return str(sub(lv, "level").get("label", "?"))

    by_label = {label(lv): lv for lv in b}
    pairs = [(label(lv), lv, by_label[label(lv)]) for lv in a if label(lv) in by_label]
    if not pairs:
        pairs = [(f"{label(x)} vs {label(y)}", x, y) for x, y in zip(a, b)]
    return pairs


def compare_rows(a: list[dict[str, object]], b: list[dict[str, object]]) -> list[tuple[str, str, float | None,
                                                                                         float | None, float | None]]:
    """(level, figure, a, b, b / a) for every compared figure of every paired level."""
    rows = []
    for name, la, lb in pair_levels(a, b):
        sa, sb = sub(la, "summary"), sub(lb, "summary")
        for label, path in compared(sa):
            va, vb = num(sa, *path), num(sb, *path)
            if va is None and vb is None:
                continue
            rows.append((name, label, va, vb, ratio(va, vb)))
    return rows


def compare_table(a_name: str, b_name: str, a: list[dict[str, object]], b: list[dict[str, object]]) -> Table:
    t = Table(title=f"b / a  (a = {a_name}, b = {b_name})", title_justify="left", header_style="bold")
    for col in ("level", "figure", "a", "b", "b / a"):
        t.add_column(col, justify="left" if col in ("level", "figure") else "right")
    last = None
    for level, label, va, vb, r in compare_rows(a, b):
        t.add_row(level if level != last else "", label, _g(va), _g(vb),
                  "-" if r is None else f"{r:.3f}")
        last = level
    return t
