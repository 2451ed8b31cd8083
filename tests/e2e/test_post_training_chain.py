"""SFT, then RL, then DPO through the real `pyflyte run` (local Flyte, shared local Ray, SQLite MLflow,
local store), chained: `workflows/post_train.py` runs SFT and RL from its final policy as one
execution, and a DPO run starts from the RL run's final version (`model.path` = its store key).
Asserted: each version published with its kind, config hash and dataset, registered in MLflow with
its lineage tags; the held-out loss and the reward-based eval logged; `flyroll lineage` walks
dpo → rl → sft → the bootstrapped base; the bad rows of the files skipped and named."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from configs.data.make_tiny_data import rows
from tests.support.workflow import PYFLYTE, REPO, _env

pytestmark = pytest.mark.slow

FLYROLL = str(Path(sys.executable).with_name("flyroll"))


def _write(path: Path, records: list, bad: list[str] = ()) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records) + "".join(b + "\n" for b in bad))
    return str(path)


def _config(tmp: Path, name: str, **sections) -> Path:
    """tests/configs/e2e.yaml's model, rewards and run settings, without its RL-only sections."""
    e2e = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    cfg = {"run": {**e2e["run"], "output_dir": str(tmp / "runs"), "name": name}, "model": e2e["model"],
           "reward": e2e["reward"], "rollout": {"max_new_tokens": e2e["rollout"]["max_new_tokens"]},
           "training": {"lr": 1e-4}}
    for section, values in sections.items():
        cfg.setdefault(section, {}).update(values)
    path = tmp / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _run(tmp: Path, workflow: str, *args: str, entry: str = "") -> subprocess.CompletedProcess:
    proc = subprocess.run([PYFLYTE, "run", str(REPO / f"workflows/{workflow}.py"), entry or workflow, *args],
                          cwd=tmp, env=_env(tmp), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    return proc


def _parent_run(c, exp, kind: str):
    """The first parent run of `kind` (the on-policy DPO run comes after the file one)."""
    runs = sorted([r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("flyroll.kind") == kind
                   and "mlflow.parentRunId" not in r.data.tags], key=lambda r: r.info.start_time)
    return runs[0]


@pytest.fixture(scope="module")
def chain(tmp_path_factory):
    """`post_train`: an SFT run (2 versions of 2 steps) on 48 demonstrations with 2 bad lines, then one
    RL iteration from its final policy; then a DPO run (2 versions) from the RL policy on 40 pairs
    with 2 bad lines."""
    from mlflow.tracking import MlflowClient

    tmp = tmp_path_factory.mktemp("post")
    demos = _write(tmp / "demos.jsonl", rows(48, 3, pairs=False),
                   ['{"prompt": "1+1=", "response": ""}', '{"prompt": "2+2="}'])
    pairs = _write(tmp / "pairs.jsonl", rows(60, 4, pairs=True)[:40],
                   ['{"prompt": "1+1=", "chosen": "2", "rejected": "2"}', "not json"])
    sft_cfg = _config(tmp, "sft", sft={"train_uri": demos, "eval_size": 8, "batch_size": 8, "steps": 4,
                                       "steps_per_version": 2, "eval_every": 1})
    rl = yaml.safe_load((REPO / "tests/configs/e2e.yaml").read_text())
    rl["run"].update(output_dir=str(tmp / "runs"), name="rl")
    rl["loop"] = {"iterations": 1, "eval_every": 1}
    (tmp / "rl.yaml").write_text(yaml.safe_dump(rl))
    first = _run(tmp, "post_train", "--sft_config", str(sft_cfg), "--rl_config", str(tmp / "rl.yaml"), "--promote")
    c = MlflowClient(tracking_uri=f"sqlite:///{tmp / 'runs' / 'mlflow.db'}")
    exp = c.get_experiment_by_name("flyroll")
    sft_run, rl_run = _parent_run(c, exp, "sft"), _parent_run(c, exp, "rl")
    dpo_cfg = _config(tmp, "dpo", model={"path": rl_run.data.tags["flyroll.final_policy"]},
                      dpo={"train_uri": pairs, "eval_size": 8, "batch_size": 4, "steps": 4, "steps_per_version": 2,
                           "beta": 0.5})
    dpo = _run(tmp, "dpo", "--config", str(dpo_cfg))
    dpo_run = _parent_run(c, exp, "dpo")
    # two smaller students of the DPO policy (same char tokenizer), the second with another divergence
    student = {"bootstrap": {"hidden_size": 16, "num_layers": 1, "num_heads": 2, "steps": 10, "num_examples": 200}}
    distill = {"teacher": dpo_run.data.tags["flyroll.final_policy"], "train_uri": demos, "eval_size": 8, "top_k": 8,
               "batch_size": 8, "steps": 2, "steps_per_version": 2}
    _run(tmp, "distill", "--config", str(_config(tmp, "distill", model=student, distill=distill)))
    _run(tmp, "distill", "--config", str(_config(tmp, "distill2", model=student,
                                                 distill={**distill, "divergence": "jsd", "jsd_beta": 0.3})))
    # on-policy distillation of the DPO policy into the small student: 1 iteration of 4 prompts x 2 samples
    on_policy_distill = _config(tmp, "opd", model={**student, "reference_path": distill["teacher"]},
                                data={"train_size": 16, "eval_size": 8},
                                rollout={"prompts_per_iteration": 4, "samples_per_prompt": 2},
                                algorithm={"advantage": "on_policy_distill", "gamma": 0.0, "kl_coef": 0.0},
                                training={"mini_batch_size": 8}, loop={"iterations": 1, "eval_every": 1})
    _run(tmp, "distill", "--config", str(on_policy_distill), entry="distill_on_policy")
    # DPO from on-policy pairs, from the SFT policy: one round of 4 prompts x 4 samples on the e2e reward
    on_policy = _config(tmp, "onpolicy", model={"path": sft_run.data.tags["flyroll.final_policy"]},
                        data={"train_size": 16, "eval_size": 8},
                        rollout={"prompts_per_iteration": 4, "samples_per_prompt": 4, "max_new_tokens": 6},
                        dpo={"pairs": "on_policy", "rounds": 1, "batch_size": 4, "beta": 0.5})
    _run(tmp, "dpo", "--config", str(on_policy))
    on_policy_run = [r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("flyroll.run_id", "").startswith("onpolicy")
                     and "mlflow.parentRunId" not in r.data.tags][0]
    distills = sorted([r for r in c.search_runs([exp.experiment_id]) if r.data.tags.get("flyroll.kind") == "distill"
                       and "mlflow.parentRunId" not in r.data.tags], key=lambda r: r.info.start_time)
    return {"tmp": tmp, "client": c, "sft": sft_run, "rl": rl_run, "dpo": dpo_run, "distill": distills, "on_policy": on_policy_run,
            "on_policy_distill": _parent_run(c, exp, "on_policy_distill"),
            "sft_out": first.stdout + first.stderr, "dpo_out": dpo.stdout + dpo.stderr, "store": tmp / "runs" / "store"}


def _manifest(store: Path, key: str) -> dict:
    return json.loads((store / key / "MANIFEST.json").read_text())


def test_sft_publishes_versions_with_their_kind_loss_and_lineage(chain):
    c, run, store = chain["client"], chain["sft"], chain["store"]
    run_id = run.data.tags["flyroll.run_id"]
    v1, v2 = (_manifest(store, f"runs/{run_id}/policy/v000{i}") for i in (1, 2))
    assert v2["parents"] == [f"runs/{run_id}/policy/v0001"] and v1["parents"][0].startswith("models/tiny-")
    for m in (v1, v2):
        assert m["metadata"]["kind"] == "sft" and "rollout_table" not in m["metadata"]
        assert m["metadata"]["dataset"].startswith("datasets/sft-") and m["metadata"]["model_version"]
    assert "trainer_state.pt" in v2["files"]   # a rerun resumes exactly; v1's is pruned (run.keep_trainer_states: 1)
    assert "trainer_state.pt" not in v1["files"] and "trainer_state.pt" in v1["metadata"]["pruned"]
    history = {k: [x.value for x in sorted(c.get_metric_history(run.info.run_id, k), key=lambda x: x.step)]
               for k in ("sft/loss", "eval/loss", "eval/accuracy", "sft/steps_done")}
    assert history["sft/steps_done"] == [2.0, 4.0]
    assert len(history["eval/loss"]) == 2 and all(0 < v < 20 for v in history["eval/loss"])
    assert len(history["eval/accuracy"]) == 3   # the start, then every version
    assert run.data.tags["flyroll.status"] == "complete"
    versions = c.search_model_versions("name='flyroll-policy'")
    sft_versions = [v for v in versions if v.tags.get("flyroll.kind") == "sft"]
    assert len(sft_versions) == 2 and all(v.tags["flyroll.dataset"].startswith("datasets/sft-") for v in sft_versions)


def test_bad_rows_are_skipped_and_named(chain):
    from mlflow.artifacts import download_artifacts

    def report(run):
        return Path(download_artifacts(run_id=run.info.run_id, artifact_path="data/skipped_rows.txt",
                                       tracking_uri=f"sqlite:///{chain['tmp'] / 'runs' / 'mlflow.db'}")).read_text()

    sft, dpo = report(chain["sft"]), report(chain["dpo"])
    assert "48 rows kept, 2 skipped" in sft and "line 49: row: Value error, response is blank" in sft
    assert "line 50" in sft and "lacks 'response'" in sft
    assert "line 41" in dpo and "chosen and rejected are identical" in dpo and "line 42: not valid JSON" in dpo


def test_dpo_trains_from_the_rl_policy_with_trl_metrics(chain):
    c, run = chain["client"], chain["dpo"]
    metrics = run.data.metrics
    for k in ("dpo/loss", "rewards/margins", "rewards/accuracies", "logps/chosen", "eval/dpo_loss",
              "eval/rewards/accuracies"):
        assert k in metrics, sorted(metrics)
    first = min(c.get_metric_history(run.info.run_id, "dpo/loss"), key=lambda m: m.step)
    assert first.value == pytest.approx(0.6931, abs=0.05)   # the policy starts at its reference: log 2
    assert run.data.tags["flyroll.reference"] == chain["rl"].data.tags["flyroll.final_policy"]


def test_rl_starts_from_the_sft_policy(chain):
    sft_final = chain["sft"].data.tags["flyroll.final_policy"]
    rl_id = chain["rl"].data.tags["flyroll.run_id"]
    v1 = _manifest(chain["store"], f"runs/{rl_id}/policy/v0001")
    assert v1["parents"] == [sft_final] and "rollout_table" in v1["metadata"]
    assert chain["rl"].data.params["model.path"] == sft_final


def test_lineage_walks_dpo_rl_sft_to_the_base(chain):
    final = chain["dpo"].data.tags["flyroll.final_policy"]
    proc = subprocess.run([FLYROLL, "lineage", final, "--json", "--store", str(chain["store"]), "--tracking-uri",
                           f"sqlite:///{chain['tmp'] / 'runs' / 'mlflow.db'}"], cwd=chain["tmp"], env=_env(chain["tmp"]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rec = json.loads(proc.stdout)
    assert [v["run_kind"] for v in rec["chain"]] == ["dpo", "dpo", "rl", "sft", "sft", None]
    assert rec["base_model"].startswith("models/tiny-")
    hashes = {v["metadata"].get("config_hash") for v in rec["chain"][:5]}
    assert hashes == {chain[k].data.tags["flyroll.config_hash"] for k in ("dpo", "rl", "sft")}
    assert {d["key"].split("/")[1].split("-")[0] for d in rec["datasets"]} == {"sft", "dpo", "synthetic"}
    text = subprocess.run([FLYROLL, "lineage", final, "--store", str(chain["store"]), "--tracking-uri",
                           f"sqlite:///{chain['tmp'] / 'runs' / 'mlflow.db'}"], cwd=chain["tmp"], env=_env(chain["tmp"]),
                          capture_output=True, text=True, timeout=120).stdout
    assert "dpo version 2" in text and "rl iteration 1" in text and "sft version 2" in text


def test_distillation_stores_the_teachers_topk_once_and_trains_the_student(chain):
    c, (first, second) = chain["client"], chain["distill"]
    teacher = chain["dpo"].data.tags["flyroll.final_policy"]
    assert first.data.tags["flyroll.teacher"] == teacher
    for run in (first, second):
        for k in ("distill/loss", "distill/divergence", "distill/sft_nll", "eval/loss", "eval/divergence"):
            assert k in run.data.metrics, sorted(run.data.metrics)
        assert run.data.metrics["distill/divergence"] >= 0
    computed = [c.get_metric_history(r.info.run_id, "teacher_topk/computed")[0].value for r in (first, second)]
    assert computed == [2.0, 0.0]   # train and eval split once; the second student reuses them
    run_id = first.data.tags["flyroll.run_id"]
    v1 = _manifest(chain["store"], f"runs/{run_id}/policy/v0001")
    assert v1["metadata"]["kind"] == "distill" and v1["parents"][0].startswith("models/tiny-")
    data = v1["metadata"]["dataset"].rsplit("/", 1)[0]
    topk = [p for p in (chain["store"] / data).iterdir() if p.name.startswith("teacher-")]
    assert sorted(p.name.rsplit("-", 1)[1] for p in topk) == ["eval", "train"]
    m = _manifest(chain["store"], f"{data}/{topk[0].name}")
    assert m["parents"][1] == teacher and m["metadata"]["top_k"] == 8 and m["kind"] == "teacher_topk"


def test_on_policy_dpo_trains_on_the_best_and_worst_of_its_samples(chain):
    c, run = chain["client"], chain["on_policy"]
    m = run.data.metrics
    assert m["dpo/pairs"] >= 1 and m["dpo/pairs"] + m["dpo/groups_without_preference"] == 4
    assert m["dpo/reward_gap"] > 0 and "rewards/margins" in m and "rollout/samples" in m and m["rollout/samples"] == 16
    assert len(c.get_metric_history(run.info.run_id, "eval/accuracy")) == 2   # start and the last round
    run_id = run.data.tags["flyroll.run_id"]
    v1 = _manifest(chain["store"], f"runs/{run_id}/policy/v0001")
    assert v1["metadata"]["kind"] == "dpo" and v1["parents"] == [chain["sft"].data.tags["flyroll.final_policy"]]
    assert v1["metadata"]["dataset"].startswith("datasets/synthetic-")


def test_on_policy_distillation_scores_the_students_samples_with_the_teacher(chain):
    """distill_on_policy: the RL loop with the teacher as reference; its rollout table holds the teacher's
    log-probs of the student's own tokens (not a copy of π_old, as a kl_coef 0 RL run would), the update
    logs the reverse KL it trained on, and the version says its kind in the manifest and lineage."""
    import pandas as pd

    c, run, store = chain["client"], chain["on_policy_distill"], chain["store"]
    teacher = chain["dpo"].data.tags["flyroll.final_policy"]
    assert run.data.tags["flyroll.reference"] == teacher
    assert run.data.metrics["distill/reverse_kl"] > 0      # the student (10 bootstrap steps) is far from its teacher
    v1 = _manifest(store, f"runs/{run.data.tags['flyroll.run_id']}/policy/v0001")
    assert v1["metadata"]["kind"] == "on_policy_distill" and v1["parents"][0].startswith("models/tiny-")
    table = pd.read_parquet(next((store / v1["metadata"]["rollout_table"]).glob("*.parquet")))
    old = [x for row in table["old_logprobs"] for x in row]
    ref = [x for row in table["ref_logprobs"] for x in row]
    assert len(old) == len(ref) > 0 and max(abs(a - b) for a, b in zip(old, ref)) > 0.1
    proc = subprocess.run([FLYROLL, "lineage", run.data.tags["flyroll.final_policy"], "--store", str(store), "--tracking-uri",
                           f"sqlite:///{chain['tmp'] / 'runs' / 'mlflow.db'}"], cwd=chain["tmp"], env=_env(chain["tmp"]),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and "on_policy_distill iteration 1" in proc.stdout, proc.stdout + proc.stderr


def test_post_train_promotes_its_rl_result_and_measures_a_champion_without_a_score(chain):
    """--promote: the first RL result becomes the champion (none before). Then, with a champion set by hand
    that has no score on the RL eval split (the SFT version), `challenge` measures it there (the same
    accuracy `flyroll eval` gives), records it, keeps it against a worse challenger and compares the next
    challenger with the recorded score."""
    from configs.schema import load_config
    from tasks.run.types import DatasetRef, PolicyRef, RunSpec
    from workflows.post_train import challenge

    c, rl, uri = chain["client"], chain["rl"], f"sqlite:///{chain['tmp'] / 'runs' / 'mlflow.db'}"
    assert rl.data.tags["flyroll.promotion.decision"] == "promoted"
    assert rl.data.tags["flyroll.promotion.champion_score_source"] == "no champion of flyroll-policy yet"
    mv = c.get_model_version_by_alias("flyroll-policy", "champion")
    assert mv.tags["flyroll.key"] == rl.data.tags["flyroll.final_policy"] and mv.tags["flyroll.promoted"] == "true"

    sft_key = chain["sft"].data.tags["flyroll.final_policy"]
    sft_mv = [v for v in c.search_model_versions("name='flyroll-policy'") if v.tags.get("flyroll.key") == sft_key][0]
    assert "flyroll.eval_accuracy" not in sft_mv.tags
    c.set_registered_model_alias("flyroll-policy", "champion", sft_mv.version)
    cfg = load_config(str(chain["tmp"] / "rl.yaml"))
    spec = RunSpec(cfg.to_json(), cfg.hash(), rl.data.tags["flyroll.run_id"], str(chain["store"]), uri, rl.info.run_id)
    dataset = DatasetRef(train_key=mv.tags["flyroll.dataset"], eval_key=mv.tags["flyroll.eval_dataset"])
    candidate = PolicyRef(key=mv.tags["flyroll.key"], version=1, model_version=mv.version)
    assert challenge.task_function(spec=spec, enabled=True, candidate=candidate, accuracy=-1.0, dataset=dataset) is False
    tags = c.get_run(rl.info.run_id).data.tags
    assert tags["flyroll.promotion.champion_score_source"] == "measured by post_train"
    assert tags["flyroll.promotion.decision"] == "kept"
    assert c.get_model_version_by_alias("flyroll-policy", "champion").version == sft_mv.version
    recorded = c.get_model_version("flyroll-policy", sft_mv.version).tags
    assert recorded["flyroll.eval_dataset"] == dataset.eval_key
    table = next((chain["store"] / dataset.eval_key).glob("*.parquet"))
    proc = subprocess.run([FLYROLL, "eval", "--store", str(chain["store"]), "--model", sft_key, "--data", str(table),
                           "--config", str(chain["tmp"] / "rl.yaml")], cwd=REPO, env=_env(chain["tmp"]),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert float(recorded["flyroll.eval_accuracy"]) == pytest.approx(json.loads(proc.stdout)["accuracy"], abs=1e-6)
    # the next challenger is compared with the recorded score, not measured again
    assert challenge.task_function(spec=spec, enabled=True, candidate=candidate, accuracy=2.0, dataset=dataset) is True
    tags = c.get_run(rl.info.run_id).data.tags
    assert tags["flyroll.promotion.champion_score_source"] == "recorded" and tags["flyroll.promotion.decision"] == "promoted"
    assert c.get_model_version_by_alias("flyroll-policy", "champion").version == mv.version
    assert challenge.task_function(spec=spec, enabled=False, candidate=candidate, accuracy=9.0, dataset=dataset) is False
