"""Partial rollout (`rollout.partial_rollout_max_split`, issue 23): unfinished samples are carried into the
next iteration with their tokens so far. The round bookkeeping over a fake engine (engines/generation/partial_rollout.py),
the config's refusals, the real rollout task with N = 1 against today's table, and one pyflyte run
of the e2e config with N = 3 read back from the store."""

from __future__ import annotations

import pandas as pd
import pytest

from engines.generation.partial_rollout import cut_at_stop, is_finished, partial_rollout, segment_length

M, B, G = 7, 2, 2  # max_new_tokens, groups per batch, samples per group


def _length(pos: int, sid: int) -> int:
    """The fake policy's full response length for (stream position, sample): 1..M+2 (> M: cut at M)."""
    return 1 + (pos * 5 + sid * 3) % (M + 2)


def _fake(calls: list):
    """(draw, sample_new, continue_, decode) of a fake engine: token t of sample (pos, sid) is
    1000 * pos + 10 * sid + t, its log-prob -t; it stops (EOS) at `_length` tokens."""
    def draw(start, count):
        return pd.DataFrame({"prompt_id": [f"p{start + k}" for k in range(count)], "pos": range(start, start + count)})

    def segment(pos, sid, have, budget):
        n = min(budget, _length(pos, sid) - have)
        ids = [1000 * pos + 10 * sid + t for t in range(have, have + max(n, 0))]
        return ids, [-float(t) for t in range(have, have + len(ids))], "stop" if have + len(ids) >= _length(pos, sid) else "length"

    def sample_new(prompts, budget, round_):
        calls.append(("new", budget, round_))
        groups = []
        for _, p in prompts.iterrows():
            group = []
            for sid in range(G):
                ids, lps, reason = segment(p["pos"], sid, 0, budget)
                group.append({"prompt_id": p["prompt_id"], "group_id": f"x:{p['prompt_id']}", "sample_id": sid,
                              "prompt_token_ids": [p["pos"], sid], "response": "", "response_token_ids": ids,
                              "behaviour_logprobs": lps, "finish_reason": reason, "policy_version": 9})
            groups.append(group)
        return groups

    def continue_(sequences, budget, round_):
        calls.append(("more", budget, round_))
        return [segment(seq[0], seq[1], len(seq) - 2, budget) for seq in sequences]

    def decode(token_lists):
        return [" ".join(map(str, ids)) for ids in token_lists]

    return draw, sample_new, continue_, decode


def _iterations(split: int, n: int = 3) -> tuple[list, list]:
    """(n iterations' IterationRollout over the fake engine, its calls: (kind, max_new_tokens, round))."""
    log: list = []
    draw, sample_new, continue_, decode = _fake(log)
    carry, position, out = [], 0, []
    for version in range(n):
        res = partial_rollout(carry, position, batch=B, group_size=G, max_new_tokens=M, max_split=split, version=version,
                              draw=draw, sample_new=sample_new, continue_=continue_, decode=decode)
        out.append(res)
        carry, position = res.carry, res.position
    return out, log


def test_rounds_fill_each_batch_with_the_oldest_complete_groups_and_carry_the_rest():
    its, calls = _iterations(split=3)  # S = ceil(7 / 3) = 3 tokens per round
    assert segment_length(M, 3) == 3
    seen_batches = []
    for version, res in enumerate(its):
        groups = pd.DataFrame(res.batch).groupby("stream_position")
        assert len(res.batch) == B * G and groups.ngroups == B
        for pos, g in groups:  # complete groups: every sample stopped at its own length or at M
            assert sorted(g["sample_id"]) == list(range(G))
            for _, s in g.iterrows():
                want = min(_length(pos, s["sample_id"]), M)
                assert s["response_token_ids"] == [1000 * pos + 10 * s["sample_id"] + t for t in range(want)]
                assert s["behaviour_logprobs"] == [-float(t) for t in range(want)]
                assert s["finish_reason"] == ("stop" if _length(pos, s["sample_id"]) <= M else "length")
                assert len(s["policy_versions"]) == -(-max(want, 1) // 3) and s["policy_version"] == s["policy_versions"][-1]
                assert s["response"] == " ".join(map(str, s["response_token_ids"])) or len(s["policy_versions"]) == 1
        carried = {s["stream_position"] for s in res.carry}
        left = pd.DataFrame(res.carry).groupby("stream_position") if res.carry else []
        complete_left = [p for p, g in left if len(g) == G and all(is_finished(s, M) for _, s in g.iterrows())]
        assert all(p > max(groups.groups) for p in complete_left)  # the batch took the oldest complete groups
        seen_batches.append(sorted(groups.groups))
        # no prompt lost or repeated: everything drawn so far is in a batch or in the carry
        assert sorted(p for b in seen_batches for p in b) + sorted(carried) == list(range(res.position))
    assert all(2 <= res.metrics["rollout/partial_rounds"] <= 3 for res in its[:1]) and all(res.metrics["rollout/partial_rounds"] <= 3 for res in its)
    later = [s for res in its[1:] for s in res.batch]
    assert any(len(s["policy_versions"]) > 1 and s["policy_versions"][0] < s["policy_version"] for s in later)
    assert sum(m.metrics["rollout/partial_stale_samples"] for m in its[1:]) > 0
    # new prompts get S tokens; a continuation at most M minus its length: 3, or 1 for the third segment
    assert {b for call, b, _ in calls if call == "new"} == {3}
    assert {b for call, b, _ in calls if call == "more"} == {3, 1}
    assert all(res.metrics["rollout/partial_carried_groups"] == len({s["stream_position"] for s in res.carry}) for res in its)


def test_a_carried_sample_continues_from_its_tokens_so_far():
    its, _ = _iterations(split=3, n=2)
    before = {(s["stream_position"], s["sample_id"]): s for s in its[0].carry}
    after = {(s["stream_position"], s["sample_id"]): s for s in its[1].batch + its[1].carry}
    assert before and set(before) <= set(after)
    for key, s in before.items():
        assert after[key]["response_token_ids"][: len(s["response_token_ids"])] == s["response_token_ids"]
        assert after[key]["policy_versions"][: len(s["policy_versions"])] == s["policy_versions"]
    assert any(len(after[k]["response_token_ids"]) > len(s["response_token_ids"]) for k, s in before.items())


def test_one_split_is_one_round_of_the_first_prompts():
    res, _ = _iterations(split=1, n=2)
    for i, r in enumerate(res):
        assert r.carry == [] and r.metrics["rollout/partial_rounds"] == 1.0 and r.position == B * (i + 1)
        assert sorted({s["stream_position"] for s in r.batch}) == list(range(B * i, B * (i + 1)))


def test_a_stop_string_across_a_segment_boundary_ends_the_sample():
    decode = lambda lists: ["".join(chr(96 + t) for t in ids) for ids in lists]  # noqa: E731  1 -> a, 2 -> b, ...
    s = {"response_token_ids": [1, 2, 3, 4, 5], "behaviour_logprobs": [-1.0] * 5, "finish_reason": "length"}
    (cut,) = cut_at_stop([s], [2], decode, ("bcd",))      # "ab" | "cde": "bcd" completes at token 4
    assert cut["response_token_ids"] == [1, 2, 3, 4] and cut["behaviour_logprobs"] == [-1.0] * 4
    assert cut["finish_reason"] == "stop" and cut["response"] == "abcd"
    assert cut_at_stop([s], [2], decode, ("zz",)) == [{**s, "response": "abcde"}]
    assert cut_at_stop([s], [2], decode, ()) == [{**s, "response": "abcde"}]


@pytest.mark.parametrize("extra, named", [
    ({"algorithm": {"filter_groups": True, "tis_cap": 2.0}}, "algorithm.filter_groups"),
    ({"rollout": {"score_while_generating": True}, "algorithm": {"tis_cap": 2.0}}, "rollout.score_while_generating"),
    ({"pipeline": {"off_policy_steps": 1}, "algorithm": {"tis_cap": 2.0}}, "pipeline.off_policy_steps=1"),
    ({"data": {"domain_weights": {"arithmetic": 1.0}}, "algorithm": {"tis_cap": 2.0}}, "data.domain_weights"),
    ({"env": {"name": "frozenlake"}, "algorithm": {"tis_cap": 2.0}}, "env"),
    ({}, "set algorithm.tis_cap"),
])
def test_partial_rollout_config_refusals_name_both_fields(extra, named):
    from configs.schema import ConfigError, parse_config

    data = {"rollout": {"partial_rollout_max_split": 2}}
    for section, values in extra.items():
        data[section] = {**data.get(section, {}), **values}
    with pytest.raises(ConfigError, match=r"rollout.partial_rollout_max_split=2") as err:
        parse_config(data)
    assert named in str(err.value)
    assert parse_config({"rollout": {"partial_rollout_max_split": 2}, "algorithm": {"tis_cap": 2.0}})


def _spec(tmp_path, **rollout):
    from configs.schema import parse_config
    from tasks.run.types import RunSpec

    cfg = parse_config({"rollout": {"partial_rollout_max_split": 3, **rollout}, "algorithm": {"tis_cap": 2.0}})
    return RunSpec(config_json=cfg.to_json(), config_hash="h", run_id="pr-h", store_uri=str(tmp_path / "store"),
                   tracking_uri="", mlflow_run_id="")


def test_the_carry_is_published_read_back_replaced_by_a_rerun_and_never_silently_missing(tmp_path):
    from tasks.run.keys import carry_key
    from tasks.loop.partial_rollout import publish_carry, read_carry
    from tasks.run.types import PolicyRef

    spec, policy = _spec(tmp_path), PolicyRef(key="models/base", version=0)
    sample = {"prompt_id": "p1", "group_id": "1:p1", "sample_id": 0, "domain": "arithmetic", "prompt": "1+1=",
              "answer": "2", "metadata": {"k": [1]}, "prompt_token_ids": [5, 6], "response": "ab",
              "response_token_ids": [7, 8], "behaviour_logprobs": [-0.5, -0.25], "finish_reason": "length",
              "policy_version": 0, "policy_versions": [0], "stream_position": 4}
    assert read_carry(spec, 1) == ([], 0)                     # the run's first iteration starts from nothing
    with pytest.raises(FileNotFoundError, match=carry_key(spec, 2)):
        read_carry(spec, 3)                                   # never a silent fresh start
    publish_carry(spec, [], 5, policy, 2)                     # an empty carry reads back as one
    assert read_carry(spec, 3) == ([], 5)
    publish_carry(spec, [sample], 9, policy, 2)               # a rerun of iteration 2 replaces its carry
    assert read_carry(spec, 3) == ([sample], 9)
    publish_carry(spec, [sample], 9, policy, 2)               # the same carry again: kept as it is
    assert read_carry(spec, 3) == ([sample], 9)


def test_one_split_through_the_real_actors_is_todays_rollout_table(tmp_path, monkeypatch, tiny_model_dir):
    """tasks/loop/partial_rollout.py `partial_batch` with N = 1 over the real Ray generation actors on the
    tiny model gives, in iterations 1 and 2 (the second from the first's carry), exactly the table
    the real rollout task gives today, plus `policy_versions`."""
    import tasks.stages.rollout
    from infra.ray_session import shutdown
    from tasks.stages.fused import _between_tasks
    from tasks.actors.pools import generation_pool
    from tasks.loop.prompts import read_table
    from tasks.loop.partial_rollout import partial_batch, read_carry
    from tests.support.rollout import _parity_rollout_run

    spec, policy, dataset = _parity_rollout_run(tmp_path, monkeypatch, tiny_model_dir, "plain", {})
    try:
        theirs = [tasks.stages.rollout.rollout(spec=spec, policy=policy, dataset=dataset, iteration=i) for i in (1, 2)]
        workers, train = generation_pool(spec, policy), read_table(spec, dataset.train_key)
        ours = [partial_batch(spec, workers, policy, train, i) for i in (1, 2)]
    finally:
        shutdown()
    assert read_carry(spec, 3) == ([], 6)
    for (mine, metrics), table in zip(ours, theirs):
        assert [list(v) for v in mine["policy_versions"]] == [[0]] * 6 and metrics["rollout/partial_rounds"] == 1.0
        pd.testing.assert_frame_equal(_between_tasks(mine.drop(columns=["policy_versions"])), _between_tasks(table),
                                      check_exact=True)


@pytest.mark.slow
def test_pyflyte_run_carries_unfinished_samples_across_iterations(tmp_path):
    """tests/configs/e2e.yaml (B = 4, G = 4, max_new_tokens 6) with N = 3 (2 tokens a round), 3
    iterations through the real workflow: every rollout table has B x G rows of at most 6 tokens
    with aligned log-probs; later iterations train on samples begun by an older policy, continued
    from exactly the tokens the previous carry held, and the update's importance weights correct
    them; every drawn prompt is in a batch or in the last carry."""
    import json

    from infra.store import ArtifactStore
    from tasks.loop.prompts import stream_prompts
    from tests.support.workflow import _config, _mlflow, _pyflyte_run

    config = _config(tmp_path, rollout={"partial_rollout_max_split": 3}, algorithm={"tis_cap": 2.0},
                     loop={"iterations": 3, "eval_every": 3})
    proc = _pyflyte_run(tmp_path, "--config", str(config))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    store = ArtifactStore(str(tmp_path / "runs" / "store"))

    def read(key: str, name: str) -> str:
        return f"{store.fetch(key, str(tmp_path / 'read' / key))}/{name}"

    (run,) = {k.split("/")[1] for k in store.list("runs")}
    tables = [pd.read_parquet(read(f"runs/{run}/rollouts/i{i:04d}", "rollout.parquet")) for i in (1, 2, 3)]
    carries = [pd.read_parquet(read(f"runs/{run}/rollout_carry/i{i:04d}", "carry.parquet")) for i in (1, 2, 3)]
    with open(read(f"runs/{run}/rollout_carry/i0003", "stream.json")) as f:
        position = json.load(f)["next_position"]
    for i in (1, 2, 3):  # each carry names the policy that generated its iteration's segments, as the table does
        carry, table = store.manifest(f"runs/{run}/rollout_carry/i{i:04d}"), store.manifest(f"runs/{run}/rollouts/i{i:04d}")
        assert carry.parents[:1] == table.parents[:1] and carry.metadata["iteration"] == i
    for t in tables:
        assert len(t) == 16 and t["group_id"].nunique() == 4 and (t.groupby("group_id").size() == 4).all()
        lengths = t["response_token_ids"].map(len)
        assert (lengths == t["behaviour_logprobs"].map(len)).all() and lengths.max() <= 6
        assert (t["policy_version"] == t["policy_versions"].map(lambda v: v[-1])).all()
    older = pd.concat(tables[1:])
    assert (older["policy_versions"].map(len) > 1).any() and (older["policy_versions"].map(lambda v: v[0] < v[-1])).any()
    continued = 0
    for carry, table in zip(carries, tables[1:]):  # a carried sample's tokens start with those it was carried with
        now = {(g, s): list(ids) for g, s, ids in zip(table["group_id"], table["sample_id"], table["response_token_ids"])}
        for g, s, ids in zip(carry["group_id"], carry["sample_id"], carry["response_token_ids"]):
            if (g, s) in now:
                assert now[(g, s)][: len(ids)] == list(ids)
                continued += len(now[(g, s)]) > len(ids)
    assert continued > 0
    (train_key,) = [k for k in store.list("datasets") if k.endswith("/train")]
    (name,) = store.manifest(train_key).files
    drawn = stream_prompts(pd.read_parquet(read(train_key, name)), 0, position, seed=0)["prompt_id"].astype(str)
    used = pd.concat([t.drop_duplicates("group_id") for t in (*tables, carries[2])])["prompt_id"].astype(str)
    assert len(drawn) == 12 + carries[2]["group_id"].nunique() and sorted(drawn) == sorted(used)
    c, parent = _mlflow(tmp_path)
    history = lambda key: dict(sorted((m.step, m.value) for m in c.get_metric_history(parent.info.run_id, key)))  # noqa: E731
    assert sorted(history("rollout/partial_carried_groups")) == [1, 2, 3] and history("rollout/partial_rounds")[1] >= 2
    assert max(history("rollout/partial_rounds").values()) <= 3
    assert history("rollout/partial_stale_samples")[1] == 0 and sum(history("rollout/partial_stale_samples").values()) > 0
    tis = history("actor/tis_weight_mean")
    assert abs(tis[1] - 1.0) < 1e-3 and max(abs(tis[i] - 1.0) for i in (2, 3)) > 1e-4, tis
