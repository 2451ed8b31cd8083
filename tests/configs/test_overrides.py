"""Command-line overrides (`--set`) and the import check of the reward functions a config names:
configs/overrides.py through `load_config`, `flyroll eval --set`, and the workflows' `--set` through
the real `pyflyte run`."""

from __future__ import annotations

import json
import subprocess
import sys

from infra.eval_cli import main as eval_main  # first: it sets the OpenMP wait policy before torch loads

import pandas as pd  # noqa: E402
import pytest  # noqa: E402

from configs.overrides import OverrideError, parse_overrides  # noqa: E402
from configs.schema import ConfigError, load_config  # noqa: E402
from engines.rewards import REWARDS  # noqa: E402
from tests.support.workflow import PYFLYTE, REPO, _config, _env, _mlflow, _pyflyte_run

GRADED = "tests.support.rewards:graded"  # 1.0 when the response starts with a digit, else 0.5


# --- parsing -----------------------------------------------------------------------------------

def test_values_are_read_as_yaml():
    got = parse_overrides(["rollout.temperature=0.7", "training.compile=true", "rollout.stop=['\\n', '.']",
                           "run.name=a=b", "training.lr=1e-5", "model.path=", "rollout.max_new_tokens=16"])
    assert got == {"rollout.temperature": 0.7, "training.compile": True, "rollout.stop": ["\\n", "."],
                   "run.name": "a=b", "training.lr": "1e-5", "model.path": "", "rollout.max_new_tokens": 16}
    assert parse_overrides(["a.b=1", "a.b=2"]) == {"a.b": 2}  # the last of a key given twice wins


@pytest.mark.parametrize("item", ["rollout.temperature", "=0.7", "rollout..temperature=1", "run.name=[unclosed"])
def test_malformed_item_is_refused(item):
    with pytest.raises(OverrideError, match="--set"):
        parse_overrides([item])
    with pytest.raises(ConfigError, match="--set"):  # as load_config's callers see it
        load_config(None, [item])


def test_overrides_reach_the_config_and_change_the_run_id():
    """The run id is `<run.name>-<cfg.hash()>` (tasks/stages/prepare.py prepare_run): an override changes it."""
    plain = load_config(None)
    cfg = load_config(None, ["rollout.temperature=0.7", "training.lr=1e-5", "run.name=exp"])
    assert cfg.rollout.temperature == 0.7 and cfg.training.lr == 1e-5 and cfg.run.name == "exp"
    assert cfg.hash() != plain.hash()
    assert load_config(None, ["rollout.temperature=0.7"]).hash() != plain.hash()
    assert cfg.flat()["rollout.temperature"] == "0.7"  # the MLflow params carry the resolved value


@pytest.mark.parametrize("item, needle", [
    ("rollout.temprature=0.7", "rollout.temprature: unknown key"),
    ("rollout.temperature=hot", "rollout.temperature: got 'hot'"),
    ("temperature=0.7", "temperature: unknown key"),
    ("run.name.x=1", "override 'run.name.x': run.name is a value, not a section"),
])
def test_bad_override_is_a_config_error_naming_the_key(item, needle):
    with pytest.raises(ConfigError) as info:
        load_config(None, [item])
    assert needle in str(info.value)
    if "unknown key" in needle or "got" in needle:
        assert f"with --set {item.split('=')[0]}=" in str(info.value)  # the message says the value came from --set


# --- reward functions are imported when the config is checked ---------------------------------

@pytest.mark.parametrize("name, needle", [
    ("nosuch_flyroll_module:fn", "No module named 'nosuch_flyroll_module'"),
    ("tests.support.rewards:no_such_function", "has no attribute 'no_such_function'"),
    ("no_such_registered_reward", "no reward function for domain 'no_such_registered_reward'"),
])
def test_unimportable_reward_is_a_config_error_naming_the_field(tmp_path, name, needle):
    path = tmp_path / "c.yaml"
    path.write_text(f"reward:\n  functions: {{arithmetic: '{name}'}}\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "reward.functions.arithmetic:" in str(info.value) and needle in str(info.value)


def test_reward_module_in_the_working_directory_is_found(tmp_path, monkeypatch):
    """The rule of every entry point: the working directory is on sys.path when names are resolved."""
    (tmp_path / "flyroll_test_cwd_rewards.py").write_text(
        "def always(response, sample):\n    return 1.0\n")
    (tmp_path / "flyroll_test_cwd_broken.py").write_text("raise RuntimeError('broken at import')\n")
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if p not in ("", str(tmp_path))])
    for module in ("flyroll_test_cwd_rewards", "flyroll_test_cwd_broken"):
        monkeypatch.delitem(sys.modules, module, raising=False)
    monkeypatch.setattr("engines.rewards.REWARDS", dict(REWARDS))
    cfg = load_config(None, ["reward.functions.arithmetic=flyroll_test_cwd_rewards:always"])
    assert cfg.reward.functions == {"arithmetic": "flyroll_test_cwd_rewards:always"}
    with pytest.raises(ConfigError, match=r"reward.functions.reverse: .*RuntimeError: broken at import"):
        load_config(None, ["reward.functions.reverse=flyroll_test_cwd_broken:fn"])


def test_module_attribute_that_is_not_a_function_is_refused(tmp_path):
    with pytest.raises(ConfigError, match=r"reward.functions.arithmetic: 'tests.support.rewards:time' is a module"):
        load_config(None, ["reward.functions.arithmetic=tests.support.rewards:time"])


# --- flyroll eval --set --------------------------------------------------------------------------

def _eval(capsys, argv):
    rc = eval_main(argv)
    out, err = capsys.readouterr()
    return rc, (json.loads(out) if rc == 0 else None), err


def test_eval_set_routes_with_the_overridden_reward(tiny_model_dir, tmp_path, capsys):
    """--set reward.functions.mine=... (no --config: over the schema's defaults), repeated with a second
    setting: the graded reward scores the row (0.5 or 1.0, never 0)."""
    pd.DataFrame([{"prompt": "1+2=", "domain": "mine", "answer": "3"}]).to_json(tmp_path / "t.jsonl", orient="records", lines=True)
    base = ["--model", tiny_model_dir, "--unverified", "--data", str(tmp_path / "t.jsonl"), "--max-new-tokens", "2"]
    rc, _, err = _eval(capsys, base)
    assert rc == 2 and "domain 'mine'" in err  # nothing routes 'mine' by default
    rc, res, err = _eval(capsys, [*base, "--set", f"reward.functions.mine={GRADED}", "--set", "reward.timeout_s=30"])
    assert rc == 0, err
    assert res["reward/mine"] in (0.5, 1.0)
    (tmp_path / "cfg.yaml").write_text("reward:\n  functions: {mine: nosuch_flyroll_module:fn}\n")
    rc, res, err = _eval(capsys, [*base, "--config", str(tmp_path / "cfg.yaml"), "--set", f"reward.functions.mine={GRADED}"])
    assert rc == 0, err  # the override beats the preset's broken route


@pytest.mark.parametrize("item, needle", [
    ("reward.functions.mine=nosuch_flyroll_module:fn", "reward.functions.mine: reward function 'nosuch_flyroll_module:fn' cannot be imported"),
    ("reward.timeout=3", "reward.timeout: unknown key"),
    ("reward.timeout_s", "expected KEY=VALUE"),
])
def test_eval_bad_set_is_refused_before_the_model_loads(tmp_path, capsys, item, needle):
    pd.DataFrame([{"prompt": "x", "domain": "mine", "answer": "y"}]).to_csv(tmp_path / "t.csv", index=False)
    rc, _, err = _eval(capsys, ["--model", str(tmp_path / "no_model_here"), "--data", str(tmp_path / "t.csv"), "--set", item])
    assert rc == 2 and needle in err, err
    assert "no_model_here" not in err  # the config was refused first


# --- the workflows: pyflyte's form of a list input ------------------------------------------------

def test_repeated_set_is_refused_not_dropped():
    """pyflyte keeps the last of a repeated option; the workflows package refuses the repetition."""
    from workflows import _refuse_repeated_set

    _refuse_repeated_set(["pyflyte", "run", "workflows/rlvr.py", "rlvr", "--set", '["a=1"]'])
    with pytest.raises(SystemExit, match="--set is given more than once"):
        _refuse_repeated_set(["pyflyte", "run", "workflows/rlvr.py", "rlvr", "--set", '["a=1"]', "--set=[\"b=2\"]"])


@pytest.mark.slow  # ~15-25 s each: pyflyte loads the workflow and runs prepare_run
@pytest.mark.parametrize("workflow, item, needle", [
    ("workflows/agentic.py agentic", "rollout.temprature=0.7", "rollout.temprature: unknown key"),
    ("workflows/schedules.py retrain", "rollout.temprature=0.7", "rollout.temprature: unknown key"),
    # before: every sample scored 0 (the error only in reward_error) and the run ended "complete"
    ("workflows/rlvr.py rlvr", "reward.functions.arithmetic=nosuch_flyroll_module:fn",
     "reward.functions.arithmetic: reward function 'nosuch_flyroll_module:fn' cannot be imported"),
])
def test_pyflyte_bad_set_is_refused_before_any_cluster(tmp_path, workflow, item, needle):
    """Every workflow hands its `set` input to prepare_run, which refuses the bad setting first."""
    config = str(_config(tmp_path)) if "rlvr" in workflow else str(REPO / "configs/frozenlake.yaml")
    file, name = workflow.split()
    proc = subprocess.run([PYFLYTE, "run", str(REPO / file), name, "--config", config, "--set", json.dumps([item])],
                          cwd=tmp_path, env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    out = " ".join((proc.stdout + proc.stderr).split())  # pyflyte's traceback box wraps long lines
    assert proc.returncode != 0
    assert needle in out, out[-3000:]
    assert "Started a local Ray instance" not in out and not (tmp_path / "runs" / "store").exists()


@pytest.mark.slow
def test_pyflyte_set_reaches_the_run_and_its_run_id(tmp_path):
    """One iteration of tests/configs/e2e.yaml with --set: the first lines print the resolved config,
    MLflow holds the overridden params, and the run id is the resolved config's."""
    config = _config(tmp_path)
    items = ["loop.iterations=1", "loop.eval_every=1", "rollout.temperature=0.7"]
    proc = _pyflyte_run(tmp_path, "--config", str(config), "--set", json.dumps(items))
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    out = proc.stdout + proc.stderr  # the run's console is stderr
    assert "--set " + " ".join(items) in out and "temperature: 0.7" in out, out[:3000]
    resolved = load_config(config, items)
    c, run = _mlflow(tmp_path)
    assert run.data.params["rollout.temperature"] == "0.7" and run.data.params["loop.iterations"] == "1"
    assert run.data.tags["flyroll.run_id"] == f"e2e-{resolved.hash()}" != f"e2e-{load_config(config).hash()}"
    assert [m.step for m in c.get_metric_history(run.info.run_id, "actor/pg_loss")] == [1]
