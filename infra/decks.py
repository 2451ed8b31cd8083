"""Self-contained HTML reports for Flyte Decks: inline SVG and CSS, no JavaScript, no network.

Every function here is pure (data in, HTML string out) except `publish_deck` and `write_report`.
Nothing heavy is imported: pandas is only duck-typed, flytekit is imported inside `publish_deck`.

- `curves_html(history)`   one line chart per metric (`{key: [(iteration, value), ...]}`)
- `samples_html(samples)`  best / worst / random rollouts; model text is untrusted and escaped
- `timings_html(timings)`  stage seconds as horizontal bars with the share of the total
- `gain_text(before, after)` "0.08 → 0.04 (×0.5)": a change as before → after and their ratio
- `lineage_html(rows)`     the final policy's lineage rows as a table
- `report_html(...)`       a standalone document composing all of the above
- `publish_deck(name, html)` adds a `flytekit.Deck` when inside a Flyte task, else does nothing
- `write_report(path, html)` writes the file atomically and returns the path

The fragments carry their own `<style>` so each can be a deck on its own; classes are prefixed
`fr-` so they do not clash with flytekit's deck template. SVG is inline HTML5 SVG, which needs
no `xmlns`, so a report contains no `http(s)://` reference at all. See docs/decks.md.
"""

from __future__ import annotations

import html as _html
import logging
import math
import os
import re
import tempfile
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

TEXT_LIMIT = 400          # characters of prompt/response shown in a cell; the rest is in `title`
TITLE_LIMIT = 20_000      # characters kept in a `title` tooltip, so one runaway output can't bloat a deck
MAX_POINTS = 1_000        # points drawn per curve; longer series keep each bucket's min and max

_CSS = """
.fr-report{font-family:system-ui,-apple-system,"Segoe UI",Roboto,sans-serif;color:#222;font-size:14px;
  max-width:1400px;margin:0 auto;padding:8px}
.fr-report h1{font-size:22px;margin:8px 0 12px}.fr-report h2{font-size:17px;margin:20px 0 8px;
  border-bottom:1px solid #ddd;padding-bottom:4px}.fr-report h3{font-size:14px;margin:12px 0 4px}
.fr-chart h3{font-size:13px;margin:0 0 4px;font-family:ui-monospace,Menlo,Consolas,monospace;overflow-wrap:anywhere}
.fr-grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(320px,1fr));gap:12px}
.fr-chart{margin:0;padding:8px;border:1px solid #e3e3e3;border-radius:6px;background:#fff}
.fr-chart svg{width:100%;height:auto;display:block}
.fr-chart figcaption,.fr-note{font-size:12px;color:#555}
.fr-axis{stroke:#888;stroke-width:1}.fr-gridline{stroke:#eee;stroke-width:1}
.fr-tick{font-size:10px;fill:#555;font-family:ui-monospace,Menlo,Consolas,monospace}
.fr-line{fill:none;stroke:#2f6fd6;stroke-width:1.6}.fr-dot{fill:#2f6fd6}.fr-last{fill:#d6452f}
.fr-bar{fill:#2f6fd6}.fr-barlabel{font-size:12px;fill:#222}
.fr-table{border-collapse:collapse;width:100%;table-layout:fixed;font-size:12px}
.fr-table th,.fr-table td{border:1px solid #ddd;padding:4px 6px;vertical-align:top;text-align:left}
.fr-table th{background:#f4f4f4}
.fr-table td.fr-text{white-space:pre-wrap;overflow-wrap:anywhere;font-family:ui-monospace,Menlo,Consolas,monospace}
.fr-table td.fr-num{text-align:right;font-family:ui-monospace,Menlo,Consolas,monospace}
.fr-table td.fr-err{color:#a02020}
.fr-summary{width:auto;table-layout:auto}
"""
_STYLE = f"<style>{_CSS}</style>"
_CONTROL = re.compile(r"[\x00-\x08\x0b\x0c\x0e-\x1f\x7f]")   # not valid in HTML text; shown as U+FFFD


def _esc(value: object) -> str:
    """Text or attribute value, escaped (quotes too) with control characters replaced."""
    return _html.escape(_CONTROL.sub("\ufffd", str(value)), quote=True)


def _fmt(v: float) -> str:
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float) and v.is_integer() and abs(v) < 1e15:
        return str(int(v))
    return f"{v + 0.0:.4g}"            # + 0.0 turns -0.0 into 0.0


def _fmt_seconds(s: float) -> str:
    if s < 1:
        return f"{s * 1000:.3g} ms"
    if s < 60:
        return f"{s:.2f} s" if s < 10 else f"{s:.1f} s"
    if s < 3600:
        return f"{int(s // 60)}m {s % 60:04.1f}s"
    return f"{int(s // 3600)}h {int(s % 3600 // 60):02d}m"


# ---------------------------------------------------------------------------------- curves


def _nice_ticks(lo: float, hi: float, n: int = 4, integer: bool = False) -> list[float]:
    """About n evenly spaced round ticks covering [lo, hi] (lo < hi); steps are 1, 2, 2.5, 5 x 10^k."""
    raw = (hi - lo) / n
    mag = 10 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1, 2, 2.5, 5, 10) if m * mag >= raw * (1 - 1e-9))
    if integer:
        step = max(1.0, math.ceil(step))
    first, last = math.floor(lo / step + 1e-9), math.ceil(hi / step - 1e-9)
    return [k * step for k in range(first, last + 1)]


def _decimate(pts: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """At most ~MAX_POINTS points: first, last, and each bucket's min and max (spikes survive)."""
    if len(pts) <= MAX_POINTS:
        return pts
    size = math.ceil(len(pts) / (MAX_POINTS // 2 - 1))
    out = {pts[0], pts[-1]}
    for i in range(0, len(pts), size):
        bucket = pts[i:i + size]
        out.add(min(bucket, key=lambda p: p[1]))
        out.add(max(bucket, key=lambda p: p[1]))
    return sorted(out)


def _chart(name: str, series: list[tuple[int, float]]) -> str:
    pts, skipped = [], 0
    for x, y in series:
        try:
            x, y = float(x), float(y)
        except (TypeError, ValueError):
            skipped += 1
            continue
        if math.isfinite(x) and math.isfinite(y):
            pts.append((x, y))
        else:
            skipped += 1
    pts.sort(key=lambda p: p[0])
    W, H, L, R, T, B = 320, 180, 54, 12, 10, 26      # svg size and margins, px
    pw, ph = W - L - R, H - T - B
    note = f" · {skipped} non-finite point{'s' * (skipped != 1)} skipped" if skipped else ""
    head = f'<figure class="fr-chart"><h3 title="{_esc(name)}">{_esc(name)}</h3>'
    svg_open = f'<svg viewBox="0 0 {W} {H}" role="img" aria-label="{_esc(name)}">'
    if not pts:
        return (f'{head}{svg_open}<text class="fr-tick" x="{W / 2}" y="{H / 2}" text-anchor="middle">'
                f'no data</text></svg><figcaption>no finite points{note}</figcaption></figure>')
    xs, ys = [p[0] for p in pts], [p[1] for p in pts]
    x0, x1, y0, y1 = min(xs), max(xs), min(ys), max(ys)
    if x0 == x1:
        x0, x1 = x0 - 1, x1 + 1
    if y0 == y1:
        pad = abs(y0) * 0.1 or 1.0
        y0, y1 = y0 - pad, y1 + pad
    if not (math.isfinite(x1 - x0) and math.isfinite(y1 - y0)):
        return (f'{head}{svg_open}<text class="fr-tick" x="{W / 2}" y="{H / 2}" text-anchor="middle">'
                f'range too large to plot</text></svg><figcaption>min {_fmt(min(ys))} · max {_fmt(max(ys))}'
                f'{note}</figcaption></figure>')
    yt = _nice_ticks(y0, y1)
    y0, y1 = yt[0], yt[-1]
    xt = [t for t in _nice_ticks(x0, x1, n=4, integer=True) if x0 <= t <= x1] or [x0, x1]

    def px(x: float) -> float:
        return L + (x - x0) / (x1 - x0) * pw

    def py(y: float) -> float:
        return T + (1 - (y - y0) / (y1 - y0)) * ph

    parts = [head, svg_open]
    for t in yt:
        parts.append(f'<line class="fr-gridline" x1="{L}" x2="{L + pw}" y1="{py(t):.1f}" y2="{py(t):.1f}"/>'
                     f'<text class="fr-tick" x="{L - 4}" y="{py(t) + 3:.1f}" text-anchor="end">{_fmt(t)}</text>')
    for t in xt:
        parts.append(f'<line class="fr-axis" x1="{px(t):.1f}" x2="{px(t):.1f}" y1="{T + ph}" y2="{T + ph + 4}"/>'
                     f'<text class="fr-tick" x="{px(t):.1f}" y="{T + ph + 15}" text-anchor="middle">{_fmt(t)}</text>')
    parts.append(f'<line class="fr-axis" x1="{L}" x2="{L}" y1="{T}" y2="{T + ph}"/>'
                 f'<line class="fr-axis" x1="{L}" x2="{L + pw}" y1="{T + ph}" y2="{T + ph}"/>')
    drawn = _decimate(pts)
    if len(drawn) > 1:
        coords = " ".join(f"{px(x):.1f},{py(y):.1f}" for x, y in drawn)
        parts.append(f'<polyline class="fr-line" points="{coords}"/>')
    if len(drawn) <= 40:
        for x, y in drawn[:-1]:
            parts.append(f'<circle class="fr-dot" cx="{px(x):.1f}" cy="{py(y):.1f}" r="2">'
                         f'<title>it {_fmt(x)}: {_fmt(y)}</title></circle>')
    lx, ly = pts[-1]
    parts.append(f'<circle class="fr-last" cx="{px(lx):.1f}" cy="{py(ly):.1f}" r="3">'
                 f'<title>it {_fmt(lx)}: {_fmt(ly)}</title></circle></svg>')
    parts.append(f'<figcaption>min {_fmt(min(ys))} · max {_fmt(max(ys))} · last {_fmt(ly)} '
                 f'(it {_fmt(lx)}) · {len(pts)} pt{"s" * (len(pts) != 1)}{note}</figcaption></figure>')
    return "".join(parts)


def _curves_body(history: dict[str, list[tuple[int, float]]]) -> str:
    if not history:
        return '<p class="fr-note">no metrics recorded</p>'
    return '<div class="fr-grid">' + "".join(_chart(k, list(v or ())) for k, v in history.items()) + "</div>"


def curves_html(history: dict[str, list[tuple[int, float]]], title: str = "Training curves") -> str:
    """One inline-SVG line chart per metric key, x = iteration, y = value, in a CSS grid.
    NaN/inf points are skipped and counted; an empty series shows "no data"."""
    return f'{_STYLE}<div class="fr-report"><h2>{_esc(title)}</h2>{_curves_body(history)}</div>'


# ---------------------------------------------------------------------------------- samples


def _text_cell(value: object, cls: str = "fr-text") -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return f'<td class="{cls}"></td>'
    full = str(value)
    if len(full) <= TEXT_LIMIT:
        return f'<td class="{cls}">{_esc(full)}</td>'
    tip = full if len(full) <= TITLE_LIMIT else full[:TITLE_LIMIT] + f"… [{len(full) - TITLE_LIMIT} more chars]"
    shown = full[:TEXT_LIMIT] + f"… [{len(full)} chars]"
    return f'<td class="{cls}" title="{_esc(tip)}">{_esc(shown)}</td>'


def _num_cell(value: object) -> str:
    try:
        return f'<td class="fr-num">{_esc(_fmt(float(value)))}</td>'
    except (TypeError, ValueError):
        return _text_cell(value, "fr-num")


_HEADINGS = {"answer": "reference answer"}


def _samples_table(rows: "pd.DataFrame", cols: list[str]) -> str:
    head = "".join(f"<th>{_esc(_HEADINGS.get(c, c))}</th>" for c in cols)
    body = []
    for _, r in rows.iterrows():
        cells = [_num_cell(r[c]) if c == "reward" else
                 _text_cell(r[c], "fr-text fr-err" if c == "reward_error" else "fr-text") for c in cols]
        body.append("<tr>" + "".join(cells) + "</tr>")
    widths = {"prompt": 26, "response": 36, "answer": 13, "reward": 7, "domain": 8, "reward_error": 10}
    colgroup = "".join(f'<col style="width:{widths[c]}%">' for c in cols)
    return f'<table class="fr-table"><colgroup>{colgroup}</colgroup><tr>{head}</tr>{"".join(body)}</table>'


def _samples_body(samples: "pd.DataFrame", n: int, seed: int) -> str:
    missing = [c for c in ("prompt", "response", "reward") if c not in samples.columns]
    if missing:
        raise ValueError(f"samples_html: samples lacks column(s) {missing}; expected prompt, response, "
                         f"reward (domain, reward_error optional), got {list(samples.columns)}")
    if n < 1:
        raise ValueError(f"samples_html: n must be >= 1, got {n}")
    if len(samples) == 0:
        return '<p class="fr-note">no samples</p>'
    cols = [c for c in ("prompt", "response", "answer", "reward", "domain", "reward_error") if c in samples.columns]
    import pandas as pd                 # already loaded by whoever built `samples`

    key = pd.to_numeric(samples["reward"], errors="coerce").reset_index(drop=True)   # positions 0..N-1
    best = samples.iloc[key.sort_values(ascending=False, kind="mergesort", na_position="last").index[:n]]
    worst = samples.iloc[key.sort_values(kind="mergesort", na_position="last").index[:n]]
    rand = samples.sample(n=min(n, len(samples)), random_state=seed)
    k = min(n, len(samples))
    return (f"<h3>best {k} (highest reward)</h3>{_samples_table(best, cols)}"
            f"<h3>worst {k} (lowest reward)</h3>{_samples_table(worst, cols)}"
            f"<h3>random {k} (seed {seed})</h3>{_samples_table(rand, cols)}")


def samples_html(samples: "pd.DataFrame", n: int = 5, seed: int = 0) -> str:
    """Best n, worst n and random n rows of a rollout table (columns prompt, response, reward, and
    the reference answer / domain / reward_error when present). Text is escaped, long text truncated with the full text
    (up to TITLE_LIMIT chars) in the cell's `title`, newlines kept."""
    body = _samples_body(samples, n, seed)
    return f'{_STYLE}<div class="fr-report"><h2>Samples ({len(samples)} rows)</h2>{body}</div>'


# ---------------------------------------------------------------------------------- timings


def _timings_body(timings: dict[str, float]) -> str:
    good, skipped = [], []
    for k, v in (timings or {}).items():
        try:
            v = float(v)
        except (TypeError, ValueError):
            v = math.nan
        (good if math.isfinite(v) and v >= 0 else skipped).append((str(k), v))
    note = f'<p class="fr-note">skipped (not a finite, non-negative time): {_esc(", ".join(k for k, _ in skipped))}</p>' \
        if skipped else ""
    if not good:
        return '<p class="fr-note">no timings</p>' + note
    total = sum(v for _, v in good)
    top = max(v for _, v in good) or 1.0
    W, LBL, BAR, ROW = 760, 190, 400, 24        # svg width, label column, max bar length, row height (px)
    parts = [f'<svg viewBox="0 0 {W} {ROW * len(good) + 28}" role="img" aria-label="stage timings" '
             f'style="max-width:{W}px;width:100%;height:auto">']
    for i, (k, v) in enumerate(good):
        y = i * ROW + 4
        share = v / total if total else 0.0
        label = k if len(k) <= 28 else k[:27] + "…"
        parts.append(f'<g><title>{_esc(k)}: {v:.3f} s ({share:.1%})</title>'
                     f'<text class="fr-barlabel" x="{LBL - 6}" y="{y + 14}" text-anchor="end">{_esc(label)}</text>'
                     f'<rect class="fr-bar" x="{LBL}" y="{y}" width="{max(v / top * BAR, 1):.1f}" height="{ROW - 8}"/>'
                     f'<text class="fr-barlabel" x="{LBL + max(v / top * BAR, 1) + 6:.1f}" y="{y + 14}">'
                     f'{_fmt_seconds(v)} · {share:.1%}</text></g>')
    parts.append(f'<text class="fr-barlabel" x="{LBL}" y="{ROW * len(good) + 20}">total {_fmt_seconds(total)}'
                 f'</text></svg>')
    return "".join(parts) + note


def timings_html(timings: dict[str, float]) -> str:
    """Stage timings (seconds) as a horizontal SVG bar chart with seconds and share of the total,
    in the given (stage) order. NaN, inf and negative values are skipped and named."""
    return f'{_STYLE}<div class="fr-report"><h2>Stage timings</h2>{_timings_body(timings)}</div>'


# ---------------------------------------------------------------------------------- report


def _summary_body(summary: dict[str, float | str]) -> str:
    rows = []
    for k, v in summary.items():
        is_num = isinstance(v, (int, float)) and not isinstance(v, bool)
        cell = _num_cell(v) if is_num else _text_cell(v)
        rows.append(f"<tr><th>{_esc(k)}</th>{cell}</tr>")
    return f'<table class="fr-table fr-summary">{"".join(rows)}</table>'


def gain_text(before: float, after: float) -> str:
    """A change read at a glance: "0.08 → 0.04 (×0.5)" -- before → after and their ratio (no
    "improvement" that is really a halving). A start of 0 has no ratio; it says so."""
    ratio = "no ratio: it started at 0" if before == 0 else f"×{after / before:.3g}"
    return f"{_fmt(before)} → {_fmt(after)} ({ratio})"


def lineage_html(rows: list[tuple[str, str]]) -> str:
    """The lineage of the final policy ((label, value) rows, infra/lineage.py summary_rows) as a table."""
    body = "".join(f"<tr><th>{_esc(k)}</th>{_text_cell(v)}</tr>" for k, v in rows)
    return f'<table class="fr-table fr-summary fr-lineage">{body}</table>'


def report_html(*, title: str, history: dict[str, list[tuple[int, float]]],
                samples: "pd.DataFrame | None" = None, timings: dict[str, float] | None = None,
                summary: dict[str, float | str] | None = None, lineage: list[tuple[str, str]] | None = None) -> str:
    """A standalone HTML document: summary table, lineage, training curves, stage timings, samples."""
    parts = [f"<h1>{_esc(title)}</h1>"]
    if summary:
        parts.append(f"<h2>Summary</h2>{_summary_body(summary)}")
    if lineage:
        parts.append(f"<h2>Lineage</h2>{lineage_html(lineage)}")
    parts.append(f"<h2>Training curves</h2>{_curves_body(history)}")
    if timings is not None:
        parts.append(f"<h2>Stage timings</h2>{_timings_body(timings)}")
    if samples is not None:
        parts.append(f"<h2>Samples ({len(samples)} rows)</h2>{_samples_body(samples, 5, 0)}")
    return ('<!doctype html>\n<html lang="en"><head><meta charset="utf-8">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f"<title>{_esc(title)}</title>{_STYLE}</head>"
            f'<body><div class="fr-report">{"".join(parts)}</div></body></html>\n')


_DOC = re.compile(r"^\s*<!doctype html>.*?(<style>.*?</style>).*?<body>(.*)</body>", re.S | re.I)


def publish_deck(name: str, html: str) -> None:
    """Add `flytekit.Deck(name, html)` when called inside a Flyte task; otherwise do nothing.

    A full document from `report_html` is reduced to its style and body, since flytekit nests
    each deck inside its own page. The task needs `enable_deck=True` for flytekit to render it."""
    try:
        from flytekit import Deck, FlyteContextManager
    except ImportError:
        return
    try:
        ctx = FlyteContextManager.current_context()
        state = ctx.execution_state
        if state is None or state.mode is None or ctx.user_space_params is None:
            return                      # not inside a task: nothing to attach the deck to
        m = _DOC.match(html)
        Deck(name, m.group(1) + m.group(2) if m else html)
    except Exception as e:              # reporting must never fail a task; say why it was dropped
        log.warning("publish_deck(%r) dropped: %s: %s", name, type(e).__name__, e)


def write_report(path: str, html: str) -> str:
    """Write html to a local path (folders created; temp file + rename, so a reader never sees
    half a report) and return the path."""
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".report-", suffix=".html", dir=folder)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", errors="replace") as f:
            f.write(html)
        os.chmod(tmp, 0o644)            # mkstemp makes it 0600; a report is meant to be read
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.remove(tmp)
        raise
    return path
