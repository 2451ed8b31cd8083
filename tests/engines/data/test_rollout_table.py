"""The rollout table's one declaration (engines/data/rollout_table.py COLUMNS).

Tables built by the real writers on the tiny model (the rollout's `completion_rows` over
HFGenerationEngine completions, the agentic `episode_rows` over `run_episodes`, then `with_rewards` /
`scored_episodes` and `with_logprobs`) pass every stage boundary, also after parquet; each kind of
corruption fails naming the column, the dtype and the boundary; every column a writer emits is
declared; the update's tensors come from one conversion; sampling settings are read in one place.
Fast tier: no Ray cluster, no pyflyte.
"""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from engines.data.rollout_table import COLUMN, COLUMNS, DTYPES, ROLLOUT_COLUMNS, STAGES, TOKEN_FLOAT_COLUMNS, Column, columns_markdown
from tasks.run.common import check_columns

REPO = Path(__file__).resolve().parents[3]
DECLARED = {c.name for c in COLUMNS}
ALL = ("rollout", "scoring", "reference")


def _recomputed_logprobs(model, tok, df: pd.DataFrame) -> list[list[float]]:
    """The tiny policy's log-probs of each row's response (as the reference stage computes them)."""
    from engines.models.batching import batched_logprobs, collate

    responses = [list(r) for r in df["response_token_ids"]]
    lp = batched_logprobs(model, collate([list(p) for p in df["prompt_token_ids"]], responses, tok.pad_token_id))
    return [lp[i, : len(r)].tolist() for i, r in enumerate(responses)]


@pytest.fixture(scope="module")
def rlvr(tiny_policy) -> dict[str, pd.DataFrame]:
    """The RLVR table after each stage, built by the stages' own functions on the tiny policy."""
    from engines.data.datasets import encode_nested
    from engines.models.modeling import encode_prompts
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from tasks.stages.reference import with_logprobs
    from tasks.actors.pools import completion_rows
    from tasks.actors.pools import with_rewards

    model, tok = tiny_policy
    prompts = pd.DataFrame({"prompt_id": ["train-0", "train-1"], "domain": ["math", "code"], "prompt": ["1+1=", "def f():"],
                            "answer": ["2", None], "tests": [None, ["assert f() is None"]], "metadata": [{}, {"lang": "py"}]})
    ids = encode_prompts(tok, prompts["prompt"].tolist())
    completions = HFGenerationEngine(model, tok).generate(ids, SamplingParams(n=2, max_new_tokens=6, seed=0))
    groups = completion_rows([prompts.iloc[i] for i in range(len(prompts))], ids, completions, version=3, iteration=1)
    rollout = encode_nested(pd.DataFrame([r for g in groups for r in g]))  # as tasks/actors/pools.py sample_groups
    scored = with_rewards(rollout, [1.0, 0.0, 0.5, 0.0], [None, "reward raised: boom", None, None])
    old = _recomputed_logprobs(model, tok, scored)
    full = with_logprobs(scored, old, old, values=[[0.1] * len(r) for r in old])
    return {"rollout": rollout, "scoring": scored, "reference": full}


@pytest.fixture(scope="module")
def agentic(tiny_policy) -> dict[str, pd.DataFrame]:
    """The agentic table after each stage: FrozenLake episodes of the tiny policy (engines/agentic/env_manager.py)."""
    from engines.agentic.env_manager import run_episodes
    from engines.generation.engine import HFGenerationEngine, SamplingParams
    from tasks.stages.agentic import episode_rows, scored_episodes
    from tasks.stages.reference import with_logprobs

    model, tok = tiny_policy
    episodes = run_episodes(HFGenerationEngine(model, tok), tok, "frozenlake", [1, 2], group_size=2, max_turns=2,
                            max_context_tokens=120, sampling=SamplingParams(max_new_tokens=4, stop=("\n",), seed=0),
                            env_kwargs={"size": 3})
    rollout = episode_rows(episodes, iteration=1, domain="frozenlake", version=0)
    scored = scored_episodes(rollout)
    old = _recomputed_logprobs(model, tok, scored)
    return {"rollout": rollout, "scoring": scored, "reference": with_logprobs(scored, old, old)}


def _stages_of(stage: str) -> tuple[str, ...]:
    return ALL[: ALL.index(stage) + 1]


@pytest.mark.parametrize("path", ["rlvr", "agentic"])
def test_real_tables_pass_every_boundary_also_after_parquet(path, request, tmp_path):
    tables = request.getfixturevalue(path)
    for stage, df in tables.items():
        check_columns(df, *_stages_of(stage), at=f"leaving {stage}")
        df.to_parquet(tmp_path / f"{stage}.parquet", index=False)  # as a Flyte StructuredDataset
        back = pd.read_parquet(tmp_path / f"{stage}.parquet")
        assert isinstance(back["response_token_ids"].iloc[0], np.ndarray)  # parquet gives arrays back
        check_columns(back, *_stages_of(stage), at=f"entering the stage after {stage}")


@pytest.mark.parametrize("path", ["rlvr", "agentic"])
def test_every_column_a_writer_emits_is_declared_under_that_writer(path, request):
    tables = request.getfixturevalue(path)
    before: set[str] = set()
    for stage, df in tables.items():
        added = set(df.columns) - before
        assert added <= set(ROLLOUT_COLUMNS[stage]), f"{path} {stage} writes undeclared columns {added - set(ROLLOUT_COLUMNS[stage])}"
        required = {c.name for c in COLUMNS if c.writer == stage and not c.optional}
        assert required <= added
        before |= added
    assert before <= DECLARED
    if path == "agentic":  # every agentic column is written, and every rollout column the agentic rows have is declared
        partial_only = {"policy_versions"}  # written by the RLVR partial rollout (tests/tasks/loop/test_partial_rollout.py)
        assert set(tables["rollout"].columns) == set(ROLLOUT_COLUMNS["rollout"]) - partial_only


CORRUPTIONS = {
    "missing column": (lambda df: df.drop(columns=["reward"]), r"missing columns \['reward'\]"),
    "string in reward": (lambda df: df.assign(reward=[1.0, "abc", 0.5, 0.0]),
                         r"column 'reward' expected float, got object \(first value 'abc', row 1\)"),
    "int column as text": (lambda df: df.assign(sample_id=df["sample_id"].astype(str)), r"column 'sample_id' expected int, got"),
    "bool reward": (lambda df: df.assign(reward=[True, False, True, False]), r"column 'reward' expected float, got bool"),
    "text in a token list": (lambda df: df.assign(response_token_ids=[["a", "b"]] + list(df["response_token_ids"][1:])),
                             r"column 'response_token_ids' expected list\[int\], got list of str in row 0"),
    "scalar for a list": (lambda df: df.assign(ref_logprobs=[0.5] * len(df)), r"column 'ref_logprobs' expected list\[float\], got float in row 0"),
    "None where not allowed": (lambda df: df.assign(response=[None] + list(df["response"][1:])),
                               r"column 'response' expected str, got null in row 0"),
    "log-probs shorter than the response": (
        lambda df: df.assign(behaviour_logprobs=[list(df["behaviour_logprobs"].iloc[0])[:-1]] + list(df["behaviour_logprobs"][1:])),
        r"column 'behaviour_logprobs' must hold one entry per response token, but row 0 has \d+ for \d+ tokens"),
    "optional column, misaligned": (lambda df: df.assign(values=[[0.0]] * len(df)),
                                    r"column 'values' must hold one entry per response token"),
}


@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_each_corruption_names_column_dtype_and_boundary(kind, rlvr):
    corrupt, message = CORRUPTIONS[kind]
    df = corrupt(rlvr["reference"].copy())
    with pytest.raises(ValueError, match=r"^rollout table entering training: " + message):
        check_columns(df, *ALL, at="entering training")


def test_optional_columns_are_checked_when_present(agentic, rlvr):
    bad = agentic["scoring"].assign(success=["yes"] * len(agentic["scoring"]))
    with pytest.raises(ValueError, match=r"column 'success' expected bool, got (object|str) \(first value 'yes', row 0\)"):
        check_columns(bad, "rollout", "scoring", at="entering reference_forward")
    bad = agentic["rollout"].assign(loss_mask=[[1]] * len(agentic["rollout"]))
    with pytest.raises(ValueError, match=r"leaving rollout_episodes: column 'loss_mask' must hold one entry per response token"):
        check_columns(bad, "rollout", at="leaving rollout_episodes")
    assert not set(agentic["rollout"].columns) - DECLARED and "loss_mask" not in rlvr["rollout"]  # absent: not required


def test_declaration_is_well_formed_and_documented():
    assert len(DECLARED) == len(COLUMNS)
    assert {c.dtype for c in COLUMNS} <= set(DTYPES) and {c.writer for c in COLUMNS} == set(STAGES)
    assert TOKEN_FLOAT_COLUMNS == ("behaviour_logprobs", "ref_logprobs", "old_logprobs", "values")
    assert all(COLUMN[c].dtype == "list[float]" for c in TOKEN_FLOAT_COLUMNS)
    with pytest.raises(ValueError, match=r"column 'x': dtype must be one of .* got dtype 'list\[str\]'"):
        Column("x", "list[str]", "", "rollout")
    with pytest.raises(ValueError, match=r"unknown stage\(s\) \['training'\]"):
        check_columns(pd.DataFrame(), "training")
    doc = (REPO / "docs" / "data.md").read_text()
    assert columns_markdown() in doc  # regenerate with `python -m engines.data.rollout_table`
    documented = set(re.findall(r"^\| `(\w+)` \| (?:int|float|bool|str|list)", doc.split("## The rollout table")[1], re.M))
    assert documented == DECLARED


def test_update_tensors_come_from_one_conversion(rlvr, tiny_policy):
    """`RolloutBatch.from_table` converts every token-level column once ([B, T] float32, each row's
    list at its start, zero after); `prepare_update` reads those tensors (shifted old log-probs
    change the KL it measures)."""
    from engines.algorithms.config import AlgorithmConfig
    from engines.models.batching import collate
    from engines.training.rl_step import prepare_update
    from engines.data.rollout_table import batch_from_table

    _, tok = tiny_policy
    df = rlvr["reference"]
    batch = batch_from_table(df, tok.pad_token_id)
    T = batch.responses.shape[1]
    for name in TOKEN_FLOAT_COLUMNS:
        t = getattr(batch, name)
        assert t.shape == (len(df), T) and t.dtype == torch.float32, name
        for i, v in enumerate(df[name]):
            assert torch.equal(t[i, : len(v)], torch.tensor(list(v), dtype=torch.float32)) and not t[i, len(v):].any()
    tokens = collate([list(p) for p in df["prompt_token_ids"]], [list(r) for r in df["response_token_ids"]], tok.pad_token_id)
    assert torch.equal(batch.input_ids, tokens.input_ids) and torch.equal(batch.response_mask, tokens.response_mask)
    assert batch.response_lengths.tolist() == [len(r) for r in df["response_token_ids"]]
    # shifted old log-probs change the KL the update measures: the tensors given are what it reads
    kl_cfg = AlgorithmConfig(kl_coef=0.1, use_kl_loss=False)
    base = prepare_update(batch, kl_cfg).metrics
    moved = prepare_update(replace(batch, old_logprobs=batch.old_logprobs + 1.0), kl_cfg).metrics
    assert base["actor/kl_ctrl_current_kl"] == pytest.approx(0.0, abs=1e-6)  # old == ref in this table
    assert moved["actor/kl_ctrl_current_kl"] > 0.1 and moved["actor/reward_kl_penalty"] > 0.1


def test_sampling_settings_are_read_in_one_place(tmp_path):
    from configs.schema import parse_config
    from tasks.stages.agentic import _params
    from tasks.actors.pools import RayGeneration, rollout_sampling
    from tasks.run.types import RunSpec

    cfg = parse_config({"rollout": {"samples_per_prompt": 3, "temperature": 0.7, "top_p": 0.9, "max_new_tokens": 12,
                                    "stop": ["\n\n"]}, "run": {"seed": 5}})
    params = rollout_sampling(cfg, seed=11)
    assert (params.n, params.temperature, params.top_p, params.max_new_tokens, params.stop, params.seed) == (
        3, 0.7, 0.9, 12, ("\n\n",), 11)
    spec = RunSpec(cfg.to_json(), cfg.hash(), "schema-test", str(tmp_path), "", "")
    assert RayGeneration(spec, [], version=0, iteration=1, seed=4).params == rollout_sampling(cfg)
    assert _params(cfg, greedy=False, iteration=2) == replace(params, n=1, seed=5 * 100_003 + 2)
    assert _params(cfg, greedy=True) == replace(params, n=1, temperature=0.0, seed=None)
    assert _params(parse_config({}), greedy=True).stop == ("\n",)  # agentic turns end at a newline by default
    constructions = {p.name: p.read_text().count("SamplingParams(") for p in (REPO / "tasks").rglob("*.py")}
    assert {k: v for k, v in constructions.items() if v} == {"pools.py": 1}
