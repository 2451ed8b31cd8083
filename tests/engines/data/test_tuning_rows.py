"""Demonstration and preference tables (engines/data/tuning_rows.py): both row forms, the formats
prompt tables read (JSONL, CSV, parquet), and every bad row skipped with its line and field."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from engines.data.tuning_rows import load_rows


def _jsonl(path, rows) -> str:
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    return str(path)


def test_demonstrations_in_both_forms(tmp_path):
    uri = _jsonl(tmp_path / "d.jsonl", [
        {"prompt": "1+2=", "response": "3", "domain": "arithmetic", "answer": 3, "source": "hand"},
        {"prompt": "2+2=", "completion": "4"},
        {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                      {"role": "assistant", "content": "hello"}]},
    ])
    res = load_rows(uri, "sft")
    assert not res.errors
    t = res.table
    assert list(t["response"]) == ["3", "4", "hello"]
    assert t.loc[0, "answer"] == "3" and json.loads(t.loc[0, "metadata"]) == {"source": "hand"}
    assert t.loc[1, "domain"] == "sft" and t.loc[1, "prompt_messages"] is None
    assert json.loads(t.loc[2, "prompt_messages"])[-1] == {"role": "user", "content": "hi"} and t.loc[2, "prompt"] == "hi"


@pytest.mark.parametrize("row,reason", [
    ({"prompt": "1+2=", "response": "  "}, "response is blank"),
    ({"prompt": "1+2="}, "lacks 'response'"),
    ({"response": "3"}, "lacks 'prompt'"),
    ({"prompt": "a", "response": "b", "messages": [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}]},
     "both 'messages' and 'prompt'"),
    ({"messages": [{"role": "user", "content": "a"}, {"role": "user", "content": "b"}]}, "must be the assistant's"),
    ({"messages": [{"role": "robot", "content": "a"}, {"role": "assistant", "content": "b"}]}, "messages.0.role"),
    ({"prompt": 5, "response": "b"}, "prompt"),
    ("[1, 2]", "expected a JSON object"),
    ("{not json", "line 2"),
])
def test_bad_demonstrations_are_skipped_naming_line_and_field(tmp_path, row, reason):
    uri = _jsonl(tmp_path / "d.jsonl", [{"prompt": "ok", "response": "fine"}, row])
    res = load_rows(uri, "sft")
    assert len(res.table) == 1 and len(res.errors) == 1 and res.errors[0].line == 2
    assert reason in res.summary()


@pytest.mark.parametrize("row,reason", [
    ({"prompt": "q", "chosen": "a", "rejected": "a"}, "chosen and rejected are identical"),
    ({"prompt": "q", "chosen": "", "rejected": "a"}, "chosen is blank"),
    ({"prompt": "q", "chosen": "a"}, "rejected"),
    ({"prompt": "", "chosen": "a", "rejected": "b"}, "prompt is blank"),
    ({"prompt": "q", "chosen": [{"role": "user", "content": "a"}], "rejected": "b"}, "one assistant message"),
])
def test_bad_pairs_are_skipped_naming_the_field(tmp_path, row, reason):
    uri = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "b"}, row])
    res = load_rows(uri, "preference")
    assert len(res.table) == 1 and res.errors[0].line == 2 and reason in res.summary()


def test_pairs_in_trl_conversational_form_and_from_csv_and_parquet(tmp_path):
    conv = {"prompt": [{"role": "user", "content": "q"}], "chosen": [{"role": "assistant", "content": "good"}],
            "rejected": [{"role": "assistant", "content": "bad"}]}
    t = load_rows(_jsonl(tmp_path / "p.jsonl", [conv]), "preference").table
    assert (t.loc[0, "chosen"], t.loc[0, "rejected"], t.loc[0, "prompt"]) == ("good", "bad", "q")
    pd.DataFrame([{"prompt": "q", "chosen": "a", "rejected": "b"}]).to_csv(tmp_path / "p.csv", index=False)
    assert list(load_rows(str(tmp_path / "p.csv"), "preference").table["chosen"]) == ["a"]
    pd.DataFrame([{"prompt": "q", "response": "a"}]).to_parquet(tmp_path / "d.parquet")
    assert list(load_rows(str(tmp_path / "d.parquet"), "sft").table["response"]) == ["a"]


def test_a_file_without_one_good_row_is_refused_naming_it(tmp_path):
    uri = _jsonl(tmp_path / "p.jsonl", [{"prompt": "q", "chosen": "a", "rejected": "a"}])
    with pytest.raises(ValueError, match=r"preference file .*p.jsonl' has no valid row.*identical"):
        load_rows(uri, "preference")
