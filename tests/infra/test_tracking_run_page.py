"""What a person reads first: the MLflow run page and report.html.

A small run is logged through the project's own tracking code (infra/tracking.py, infra/lineage.py)
into a real MLflow (SQLite for the fast tests, a real `mlflow server` for the browser test) over a
real local artifact store with a base model, a dataset and two policy versions. The slow test loads
the MLflow UI in headless Chromium and reads the rendered DOM: the run description (key charts with
before → after, lineage), the dataset input, the experiment opening on its Runs table, the key-chart
link opening MLflow's metric page, and report.html with its lineage block. Screenshots of the run page
and the report are written to the test's temp folder for a human; pytest deletes it after a pass
unless run with `-o tmp_path_retention_policy=all -s` (the paths are printed).
"""

from __future__ import annotations

import html
import json
import os
import re
import shutil
import subprocess
import time
from urllib.parse import unquote

import pytest

from infra import decks, lineage, tracking
from infra.store import ArtifactStore

DATASET_VERSION = "0123456789ab"
TRAIN = f"datasets/synthetic-{DATASET_VERSION}/train"
BASE = "models/tiny-abc123/v0000"
ACCURACY = [0.08, 0.06, 0.04]   # a run that got worse: the report must say ×0.5, not "improvement"


def make_store(root) -> ArtifactStore:
    """A base model, a train split and two policy versions trained from it, as real store versions."""
    store = ArtifactStore(str(root))
    files = root.parent / "files"
    files.mkdir()
    (files / "model.safetensors").write_bytes(b"weights")
    (files / "train.parquet").write_bytes(b"rows")
    store.publish(str(files), BASE, kind="checkpoint", producer="bootstrap_policy")
    store.publish_file(str(files / "train.parquet"), TRAIN, kind="dataset", producer="make_dataset",
                       metadata={"rows": 64, "domain_rows": {"arithmetic": 32, "reverse": 32}})
    parent = BASE
    for i in (1, 2):
        key = f"runs/r-1/policy/v{i:04d}"
        store.publish(str(files), key, kind="checkpoint", producer="weight_sync", parents=[parent],
                      metadata={"dataset": TRAIN, "iteration": i})
        parent = key
    return store


def log_small_run(uri: str, store: ArtifactStore) -> tuple[str, str, str]:
    """A parent run as prepare_run / the stages / finalize log it; returns (experiment id, run id, note)."""
    run_id = tracking.start_parent_run(uri, "flyroll", "r-1", {"algorithm.name": "grpo"}, {"flyroll.run_id": "r-1"})
    history: dict[str, list[tuple[int, float]]] = {}
    for step, acc in enumerate(ACCURACY):
        metrics = {"eval/accuracy": acc, "reward/mean": 0.1 * (step + 1), **{f"actor/m{i:02d}": i * step for i in range(12)}}
        tracking.log_metrics(uri, run_id, metrics, step)
        for k in ("eval/accuracy", "reward/mean"):
            history.setdefault(k, []).append((step, metrics[k]))
    for _ in range(2):  # a retried make_dataset logs it again: still one input
        tracking.log_dataset(uri, run_id, "synthetic/train", DATASET_VERSION, store.uri(TRAIN), "train", {"rows": 64})
    exp_id = tracking.client(uri).get_run(run_id).info.experiment_id
    rows = lineage.summary_rows(lineage.lineage("runs/r-1/policy/v0002", store.root, uri), "c0ffee123456")
    note = lineage.note_markdown(lineage.key_charts(history, ("eval/accuracy", "reward/mean", "eval/reward"),
                                                                 exp_id, run_id), rows)
    tracking.set_tags(uri, run_id, {tracking.NOTE: note})
    tracking.end_run(uri, run_id)
    return exp_id, run_id, note


def test_run_is_tagged_described_and_has_its_dataset(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    store = make_store(tmp_path / "store")
    exp_id, run_id, note = log_small_run(uri, store)
    c = tracking.client(uri)
    assert c.get_experiment(exp_id).tags[tracking.EXPERIMENT_KIND] == "custom_model_development"
    run = c.get_run(run_id)
    assert run.data.tags[tracking.NOTE] == note
    (inp,) = run.inputs.dataset_inputs
    assert (inp.dataset.name, inp.dataset.digest, inp.dataset.source_type) == ("synthetic/train", DATASET_VERSION, "local")
    assert json.loads(inp.dataset.source) == {"uri": store.uri(TRAIN)}
    assert {t.key: t.value for t in inp.tags} == {"mlflow.data.context": "train"}
    # key charts: before → after (×ratio), and a link to MLflow's metric page of that key and run
    assert "[eval/accuracy](#/metric/?" in note and "0.08 → 0.04 (×0.5), iteration 0 → 2" in note
    assert "[reward/mean](" in note and "eval/reward" not in note           # never logged: not listed
    link = unquote(re.search(r"\[eval/accuracy\]\(([^)]*)\)", note).group(1))
    assert f'runs=["{run_id}"]' in link and 'plot_metric_keys=["eval/accuracy"]' in link and f'experiments=["{exp_id}"]' in link
    for row in ("| final policy | runs/r-1/policy/v0002 |", f"| base model | {BASE} |", "| config hash | c0ffee123456 |",
                f"| dataset | {TRAIN} (64 rows) |", f"| parent chain | runs/r-1/policy/v0002 ← runs/r-1/policy/v0001 ← {BASE} |"):
        assert row.replace("_", "\\_") in note, row
    # a kind someone chose in the UI is kept by the next run
    c.set_experiment_tag(exp_id, tracking.EXPERIMENT_KIND, "finetuning")
    tracking.start_parent_run(uri, "flyroll", "r-2", {}, {})
    assert c.get_experiment(exp_id).tags[tracking.EXPERIMENT_KIND] == "finetuning"


def test_long_parent_chain_is_elided_and_bad_digest_refused(tmp_path):
    rec = {"policy": "p/v0009", "base_model": "base", "datasets": [], "chain": [{"key": f"p/v{i:04d}"} for i in range(9, 0, -1)] + [{"key": "base"}]}
    chain = dict(lineage.summary_rows(rec, "h"))["parent chain"]
    assert chain == "p/v0009 ← p/v0008 ← p/v0007 ← p/v0006 ← p/v0005 ← … 4 more … ← base"
    assert dict(lineage.summary_rows(rec, "h"))["model version"] == "not registered"
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    run_id = tracking.start_parent_run(uri, "e", "r", {}, {})
    with pytest.raises(ValueError, match="digest '.{64}' is 64 characters; MLflow keeps at most 36"):
        tracking.log_dataset(uri, run_id, "d/train", "f" * 64, "/store/d", "train")


def test_ui_links_open_the_training_view():
    assert tracking.ui_links("http://mlflow:5000/", "3", "abc") == (
        "http://mlflow:5000/#/experiments/3?workflowType=machine_learning\n"
        "  run: http://mlflow:5000/#/experiments/3/runs/abc?workflowType=machine_learning")
    local = tracking.ui_links("sqlite:////r/mlflow.db", "1", "abc")
    assert local.startswith("mlflow ui --backend-store-uri sqlite:////r/mlflow.db, then http://127.0.0.1:5000/#/experiments/1?")


# ---------------------------------------------------------------------------------- browser

def _chromium(tmp_path, url: str, screenshot: str | None = None) -> str:
    """The DOM of `url` after its scripts ran (virtual time), as text; optionally a screenshot too."""
    cmd = ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-sync",
           "--disable-background-networking", "--disable-component-update", "--hide-scrollbars",
           f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1400,1800", "--virtual-time-budget=15000"]
    if screenshot:
        subprocess.run([*cmd, f"--screenshot={screenshot}", url], capture_output=True, timeout=90, check=False)
    run = subprocess.run([*cmd, "--dump-dom", url], capture_output=True, text=True, timeout=90, check=False)
    assert run.stdout, f"chromium printed no DOM for {url}: exit {run.returncode}: {run.stderr[-2000:]}"
    return run.stdout


def _text(dom: str) -> str:
    dom = re.sub(r"<(script|style)\b.*?</\1>", " ", dom, flags=re.DOTALL)
    return re.sub(r"\s+", " ", html.unescape(re.sub(r"<[^>]+>", " ", dom)))


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("chromium") is None,
                    reason="Debian `chromium` not installed (apt-get install -y chromium) — browser check skipped")
def test_mlflow_run_page_and_report_in_headless_chromium(tmp_path):
    from infra.services import MlflowServer

    t0 = time.monotonic()
    store = make_store(tmp_path / "store")
    with MlflowServer(work_dir=str(tmp_path / "mlflow")) as server:
        uri = server.tracking_uri
        exp_id, run_id, _ = log_small_run(uri, store)
        run_url = f"{uri}/#/experiments/{exp_id}/runs/{run_id}?{tracking.TRAINING_VIEW}"
        dom = _chromium(tmp_path, run_url, screenshot=str(tmp_path / "run_page.png"))
        page = _text(dom)
        # the description comes first on the run's Overview: key charts, then the lineage
        assert page.index("Key charts:") < page.index("Lineage:") < page.index("Metrics (14)"), page[:3000]
        for piece in ("eval/accuracy 0.08 → 0.04 (×0.5), iteration 0 → 2", "reward/mean 0.1 → 0.3 (×3)",
                      f"Lineage: final policy: runs/r-1/policy/v0002; model version: not registered; base model: {BASE};",
                      "final policy runs/r-1/policy/v0002", f"base model {BASE}", "config hash c0ffee123456",
                      f"dataset {TRAIN} (64 rows)", f"parent chain runs/r-1/policy/v0002 ← runs/r-1/policy/v0001 ← {BASE}",
                      f"Datasets synthetic/train ({DATASET_VERSION}) train"):
            assert piece in page, f"{piece!r} not on the run page: {page[:3000]}"
        hrefs = [html.unescape(h) for h in re.findall(r'href="([^"]*#/metric/[^"]*)"', dom)]
        assert len(hrefs) == 2, hrefs                                    # eval/accuracy and reward/mean
        # the key chart's link opens MLflow's metric page with that metric's chart
        metric = _text(_chromium(tmp_path, hrefs[0] if hrefs[0].startswith("http") else f"{uri}/{hrefs[0].lstrip('/')}"))
        assert "Metric Details" in metric and "eval/accuracy 0.04 (step=2) 0.04 (step=2) 0.08 (step=0)" in metric, metric[:2000]
        # the experiment opens on its Runs table (not the GenAI overview), with the dataset column filled
        runs = _text(_chromium(tmp_path, f"{uri}/#/experiments/{exp_id}?{tracking.TRAINING_VIEW}"))
        assert "Runs - Experiment" in runs and f"synthetic/train ({DATASET_VERSION}) train" in runs, runs[:2000]
        rows = lineage.summary_rows(lineage.lineage("runs/r-1/policy/v0002", store.root, uri), "c0ffee123456")
    report = tmp_path / "report.html"
    decks.write_report(str(report), decks.report_html(
        title="flyroll r-1", history={"eval/accuracy": list(enumerate(ACCURACY))},
        summary={"eval/accuracy": decks.gain_text(ACCURACY[0], ACCURACY[-1])}, lineage=rows))
    text = _text(_chromium(tmp_path, f"file://{report}", screenshot=str(tmp_path / "report.png")))
    assert "eval/accuracy 0.08 → 0.04 (×0.5)" in text and text.index("Lineage") < text.index("Training curves"), text[:2000]
    assert f"parent chain runs/r-1/policy/v0002 ← runs/r-1/policy/v0001 ← {BASE}" in text
    assert os.path.getsize(tmp_path / "run_page.png") > 10_000 and os.path.getsize(tmp_path / "report.png") > 10_000
    print(f"screenshots: {tmp_path / 'run_page.png'} {tmp_path / 'report.png'} ({time.monotonic() - t0:.0f} s)")
