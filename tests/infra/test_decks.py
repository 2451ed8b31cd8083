"""HTML decks: well-formed, self-contained, hostile model output escaped, odd inputs survive.

Structure is checked with the stdlib `html.parser`; the slow test renders a report in headless
Chromium (when installed) and checks the screenshot is not blank.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from html.parser import HTMLParser

import pandas as pd
import pytest

from infra import decks
from infra.decks import curves_html, publish_deck, report_html, samples_html, timings_html, write_report

HOSTILE = ['<script>alert(1)</script>', '"><img src=x onerror=alert(2)>', "'><svg onload=alert(3)>",
           "</td></tr></table><iframe src=javascript:alert(4)>", "&lt;already escaped&gt; & \x00 \x1b[31m"]
VOID = {"meta", "br", "img", "input", "hr", "link", "col", "area", "base", "source", "wbr"}


class Parsed(HTMLParser):
    """Tags, attributes and text of a document; `errors` lists tags that do not balance."""

    def __init__(self, doc: str):
        super().__init__(convert_charrefs=True)
        self.stack, self.errors, self.tags, self.attrs, self.text = [], [], [], [], []
        self.feed(doc)
        self.close()
        self.errors += [f"unclosed <{t}>" for t in self.stack]

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        self.attrs += attrs
        if tag not in VOID:
            self.stack.append(tag)

    def handle_startendtag(self, tag, attrs):   # <line .../> in SVG
        self.tags.append(tag)
        self.attrs += attrs

    def handle_endtag(self, tag):
        if self.stack and self.stack[-1] == tag:
            self.stack.pop()
        else:
            self.errors.append(f"</{tag}> while open: {self.stack[-3:]}")

    def handle_data(self, data):
        self.text.append(data)


def check(doc: str) -> Parsed:
    """Balanced, self-contained, no script or event handler anywhere."""
    p = Parsed(doc)
    assert p.errors == []
    assert "http://" not in doc and "https://" not in doc
    assert not {"script", "img", "iframe", "link"} & set(p.tags)
    assert not [k for k, _ in p.attrs if k.startswith("on") or k in ("src", "href")]
    return p


HISTORY = {
    "reward/mean": [(i, 0.1 + 0.02 * i) for i in range(30)],
    "actor/pg_loss": [(i, math.sin(i) * 1e-3) for i in range(30)],
    "actor/kl": [(0, 0.0), (1, float("nan")), (2, 0.01), (3, float("inf")), (4, 0.03)],
}


def rollouts(rewards, **extra) -> pd.DataFrame:
    n = len(rewards)
    return pd.DataFrame({"prompt": [f"prompt {i}\nline two" for i in range(n)],
                         "response": [f"response {i}" for i in range(n)],
                         "reward": rewards, "domain": ["math"] * n, **extra})


# ---------------------------------------------------------------------------------- curves

def test_curves_one_svg_per_metric_with_name_and_stats():
    doc = curves_html(HISTORY)
    p = check(doc)
    assert doc.count("<svg") == len(HISTORY) == p.tags.count("svg")
    text = "".join(p.text)
    for key in HISTORY:
        assert key in text
    # actor/kl: finite points (0, 0.0), (2, 0.01), (4, 0.03); nan and inf skipped and counted
    assert "min 0 · max 0.03 · last 0.03 (it 4) · 3 pts · 2 non-finite points skipped" in text
    assert 'class="fr-grid"' in doc


@pytest.mark.parametrize("series, caption", [
    ([], "no finite points"),
    ([(0, float("nan")), (1, float("-inf"))], "no finite points · 2 non-finite points skipped"),
    ([(7, 0.5)], "min 0.5 · max 0.5 · last 0.5 (it 7) · 1 pt"),
    ([(i, 2.0) for i in range(5)], "min 2 · max 2 · last 2 (it 4) · 5 pts"),
    ([(3, -1.0), (1, 4.0), (2, 0.0)], "min -1 · max 4 · last -1 (it 3) · 3 pts"),   # sorted by iteration
    ([(0, 1e308), (1, -1e308)], "min -1e+308 · max 1e+308"),                        # span overflows
    ([(0, "x"), (1, None), (2, 1.0)], "last 1 (it 2) · 1 pt · 2 non-finite points skipped"),
])
def test_curves_edge_series_render(series, caption):
    doc = curves_html({"m": series})
    p = check(doc)
    assert doc.count("<svg") == 1
    assert caption in "".join(p.text)


def test_curves_empty_history_and_hostile_metric_name():
    assert "no metrics recorded" in curves_html({})
    doc = curves_html({HOSTILE[1]: [(0, 1.0), (1, 2.0)]}, title=HOSTILE[0])
    p = check(doc)
    assert HOSTILE[0] in "".join(p.text) and HOSTILE[1] in "".join(p.text)


def test_nice_ticks_hand_worked():
    # span 1, ~4 ticks: raw step 0.25 -> 2.5 x 10^-1
    assert decks._nice_ticks(0.0, 1.0) == [0.0, 0.25, 0.5, 0.75, 1.0]
    # raw step 0.185 -> 0.2; 0.13 floors to 0, 0.87 ceils to 1.0
    assert [round(t, 9) for t in decks._nice_ticks(0.13, 0.87)] == [0.0, 0.2, 0.4, 0.6, 0.8, 1.0]
    # iterations are integers: raw step 0.75 -> 1
    assert decks._nice_ticks(0, 3, integer=True) == [0, 1, 2, 3]


def test_long_series_is_decimated_but_keeps_spike_and_ends():
    pts = [(float(i), 0.0) for i in range(20_000)]
    pts[12_345] = (12_345.0, 99.0)
    kept = decks._decimate(pts)
    assert len(kept) <= decks.MAX_POINTS
    assert (12_345.0, 99.0) in kept and kept[0] == pts[0] and kept[-1] == pts[-1]
    assert kept == sorted(kept)
    doc = curves_html({"m": pts})
    assert len(doc) < 60_000 and "max 99" in doc


# ---------------------------------------------------------------------------------- samples

def test_samples_escape_hostile_model_output():
    df = rollouts([0.0] * len(HOSTILE))
    df["response"] = HOSTILE
    df["prompt"] = HOSTILE[::-1]
    df["domain"] = HOSTILE
    df["reward_error"] = HOSTILE
    doc = samples_html(df, n=len(HOSTILE))
    p = check(doc)
    text = "".join(p.text)
    for h in HOSTILE[:4]:
        assert h in text                   # shown as text, never parsed as markup
    assert "<script>" not in doc and "<img" not in doc and "\x00" not in doc


def test_samples_best_worst_random():
    df = rollouts([0.5, 0.9, float("nan"), 0.1, 0.7, 0.3], reward_error=[None, None, "timeout after 5.0s",
                                                                         None, None, None])
    df.index = [10, 10, 11, 12, 13, 14]    # duplicate, non-default index must not matter
    doc = samples_html(df, n=2, seed=3)
    check(doc)
    best, worst, rand = doc.split("<h3>")[1:]
    assert "best 2" in best and "worst 2" in worst and "random 2 (seed 3)" in rand
    assert best.index("response 1<") < best.index("response 4<") and "response 0<" not in best
    assert worst.index("response 3<") < worst.index("response 5<") and "response 2<" not in worst
    assert rand.count("<tr>") == 3         # header + 2
    assert samples_html(df, n=2, seed=3) == doc                    # seeded
    assert ">reward_error</th>" in doc
    assert "prompt 1\nline two" in best    # newline kept; CSS pre-wrap shows it
    everything = samples_html(df, n=6)
    assert everything.split("<h3>")[2].rstrip().count("timeout after 5.0s") == 1   # NaN reward last


def test_samples_truncate_long_text_with_full_text_in_title():
    long = "x" * 5_000 + "<b>end</b>"
    df = rollouts([1.0])
    df["response"] = [long]
    p = check(samples_html(df, n=1))
    titles = [v for k, v in p.attrs if k == "title"]
    assert long in titles                  # full text, unescaped back by the parser
    assert f"… [{len(long)} chars]" in "".join(p.text)
    huge = rollouts([1.0])
    huge["response"] = ["y" * 100_000]
    assert len(samples_html(huge, n=1)) < 3 * (decks.TITLE_LIMIT + 10_000)


def test_samples_empty_and_bad_input():
    assert "no samples" in samples_html(rollouts([]))
    with pytest.raises(ValueError, match=r"lacks column\(s\) \['reward'\]"):
        samples_html(pd.DataFrame({"prompt": ["p"], "response": ["r"]}))
    with pytest.raises(ValueError, match="n must be >= 1, got 0"):
        samples_html(rollouts([1.0]), n=0)
    check(samples_html(rollouts(["bad", None, 1.0]), n=3))        # non-numeric rewards sort last


# ---------------------------------------------------------------------------------- timings

def test_timings_bars_seconds_and_shares():
    doc = timings_html({"rollout": 30.0, "score": 10.0, "train_step": 55.0, "publish_weights": 5.0})
    p = check(doc)
    text = "".join(p.text)
    assert p.tags.count("rect") == 4 and doc.count("<svg") == 1
    for piece in ("rollout", "30.0 s · 30.0%", "10.0 s · 10.0%", "55.0 s · 55.0%", "5.00 s · 5.0%", "total 1m 40.0s"):
        assert piece in text


def test_timings_odd_values():
    doc = timings_html({"a": float("nan"), "b": -1.0, "c": 0.0, "<i>d</i>": 0.0})
    p = check(doc)
    assert p.tags.count("rect") == 2 and "0 ms · 0.0%" in doc                  # total 0: no division error
    assert "skipped (not a finite, non-negative time): a, b" in "".join(p.text)
    assert "<i>d</i>" in "".join(p.text)
    assert "no timings" in timings_html({})


# ---------------------------------------------------------------------------------- report

LINEAGE = [("final policy", "runs/r-1/policy/v0002"), ("base model", "models/tiny-abc/v0000"),
           ("dataset", "datasets/synthetic-0123456789ab/train (64 rows)"), ("config hash", "c0ffee123456"),
           ("parent chain", "runs/r-1/policy/v0002 ← runs/r-1/policy/v0001 ← models/tiny-abc/v0000")]


def full_report() -> str:
    df = rollouts([0.1, 0.9, 0.4], answer=["17", None, "olleh"])
    df.loc[1, "response"] = HOSTILE[0]
    return report_html(title="run <42>", history=HISTORY, samples=df,
                       timings={"rollout": 3.0, "train_step": 1.0},
                       summary={"run_id": "r-1", "iterations": 30, "eval/accuracy": decks.gain_text(0.08, 0.04),
                                "reward/mean": 0.68, "note": HOSTILE[1]},
                       lineage=LINEAGE)


@pytest.mark.parametrize("before,after,text", [
    (0.08, 0.04, "0.08 → 0.04 (×0.5)"),                  # a halving reads as one, not as "improvement 0.5"
    (0.2, 0.5, "0.2 → 0.5 (×2.5)"),
    (0.3, 0.3, "0.3 → 0.3 (×1)"),
    (0.0, 0.25, "0 → 0.25 (no ratio: it started at 0)"),
    (1 / 3, 0.5, "0.3333 → 0.5 (×1.5)"),
])
def test_gain_text_before_after_ratio(before, after, text):
    assert decks.gain_text(before, after) == text


def test_samples_show_the_reference_answer_and_reward():
    df = rollouts([1.0, 0.0], answer=["42", None])
    df["response"] = ["the answer is 42", "the answer is 41"]
    doc = samples_html(df, n=2)
    check(doc)
    best = doc.split("<h3>")[1]
    assert ">reference answer</th>" in best and ">reward</th>" in best
    row = best.split("<tr>")[2]                           # the best row: its response, reference and reward
    assert "the answer is 42" in row and '<td class="fr-text">42</td>' in row and '<td class="fr-num">1</td>' in row
    assert '<td class="fr-text"></td>' in best.split("<tr>")[3]   # no reference (code tests, environments): empty


def test_report_is_a_standalone_document():
    doc = full_report()
    p = check(doc)
    assert doc.startswith("<!doctype html>") and p.tags.count("style") == 1 and p.tags[0] == "html"
    assert doc.count("<svg") == len(HISTORY) + 1                       # curves + timings
    text = "".join(p.text)
    for piece in ("run <42>", "Summary", "iterations", "0.68", HOSTILE[1], "Training curves",
                  "Stage timings", "Samples (3 rows)", HOSTILE[0], "0.08 → 0.04 (×0.5)", "reference answer", "olleh"):
        assert piece in text
    assert text.index("Lineage") < text.index("Training curves")
    for label, value in LINEAGE:
        assert label in text and value in text
    minimal = report_html(title="t", history={})
    check(minimal)
    assert "Samples" not in minimal and "Stage timings" not in minimal


def test_write_report_creates_folders_atomically(tmp_path):
    path = str(tmp_path / "runs" / "r1" / "report.html")
    doc = full_report()
    assert write_report(path, doc) == path
    assert open(path, encoding="utf-8").read() == doc
    assert os.listdir(tmp_path / "runs" / "r1") == ["report.html"]       # no temp file left
    write_report(path, "<p>second</p>")
    assert open(path, encoding="utf-8").read() == "<p>second</p>"


def test_module_imports_nothing_heavy():
    code = ("import sys, infra.decks; heavy = [m for m in ('torch', 'ray', 'flytekit', 'pandas') "
            "if m in sys.modules]; assert not heavy, heavy")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=os.path.abspath(os.path.join(os.path.dirname(__file__), "..", "..")))


# ---------------------------------------------------------------------------------- decks

def test_publish_deck_outside_a_task_is_a_no_op(monkeypatch):
    from flytekit import FlyteContextManager
    before = list(FlyteContextManager.current_context().user_space_params.decks)
    publish_deck("report", full_report())
    assert FlyteContextManager.current_context().user_space_params.decks == before
    monkeypatch.setitem(sys.modules, "flytekit", None)                 # flytekit missing: still safe
    publish_deck("report", "<p>x</p>")


def test_publish_deck_inside_a_task_adds_a_fragment():
    import flytekit

    @flytekit.task(enable_deck=True)
    def make_report() -> list[str]:
        publish_deck("report", full_report())
        publish_deck("timings", timings_html({"rollout": 1.0}))
        return [f"{d.name}|{d.html[:40]}" for d in flytekit.current_context().decks]

    got = make_report()
    report = next(g for g in got if g.startswith("report|"))
    assert report.startswith("report|<style>")                        # document shell stripped
    assert any(g.startswith("timings|<style>") for g in got)


# ---------------------------------------------------------------------------------- browser

@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian `chromium` not installed (apt-get install -y chromium) — render check skipped")
def test_report_renders_in_headless_chromium(tmp_path):
    from PIL import Image

    page = write_report(str(tmp_path / "report.html"), full_report())
    png = tmp_path / "shot.png"
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
           "--host-resolver-rules=MAP * ~NOTFOUND", f"--user-data-dir={tmp_path / 'profile'}",
           f"--screenshot={png}", "--window-size=1200,1600", f"file://{page}"]
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert png.exists(), f"no screenshot; chromium exit {run.returncode}: {run.stderr[-2000:]}"
    img = Image.open(png).convert("RGB")
    assert img.size == (1200, 1600)
    colors = img.getcolors(maxcolors=1 << 24)                           # [(count, (r, g, b)), ...]
    non_white = sum(n for n, (r, g, b) in colors if r + g + b < 720)
    blue = sum(n for n, (r, g, b) in colors if b > 150 and r < 110)     # curve lines and timing bars
    assert non_white > 0.01 * 1200 * 1600, f"page looks blank: {non_white} non-white pixels"
    assert blue > 500, f"no chart colour on the page: {blue} blue pixels"
