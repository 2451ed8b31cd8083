"""The cluster path (docs/cluster.md): `pyflyte --pkgs workflows package` with the task ImageSpec and
the scheduled launch plans, the image's package list against pyproject.toml, and the registered
model name / champion alias a config derives.

Packaging asks flytekit to build each ImageSpec whose tag is not in a registry; CI must build and
push nothing, so the package command runs with an image builder (flytekit's own plugin point,
`ImageBuildEngine.register`) that records which specs it was asked for and builds none, as the
default builder does for an image already in the registry.
"""

from __future__ import annotations

import json
import subprocess
import sys
import tarfile
import tomllib

import pytest

from tests.support.workflow import REPO, _env

RECORDING_PYFLYTE = """
import json, sys
ASKED = sys.argv[1]
from flytekit.image_spec.image_spec import ImageBuildEngine, ImageSpecBuilder

class Recorder(ImageSpecBuilder):
    def should_build(self, spec):
        with open(ASKED, "a") as f:
            f.write(json.dumps({"name": spec.name, "image": spec.image_name(), "base": spec.base_image,
                                "index": spec.pip_extra_index_url, "env": spec.env}) + "\\n")
        return False  # as if the registry had it: nothing is built or pushed

    def build_image(self, spec):
        raise AssertionError("the test builder never builds")

ImageBuildEngine.register("recorder", Recorder(), priority=100)  # before any ImageSpec exists: theirs
from flytekit.clis.sdk_in_container.pyflyte import main
sys.argv = ["pyflyte", *sys.argv[2:]]
main()
"""

OTHER_PROJECT = """
from workflows.schedules import retrain_plan

weekly = retrain_plan("acme_weekly_retrain", "configs/gspo.yaml", "30 4 * * 1", iterations=2,
                      overrides=["run.experiment=acme", "training.lr=2e-5"])
"""


def _package(tmp_path, profile: str):
    """Package workflows + a project module that makes its own plan with retrain_plan; returns
    ({entity file name: bytes}, [the image specs the builder was asked about])."""
    (tmp_path / "acme").mkdir(exist_ok=True)
    (tmp_path / "acme" / "__init__.py").write_text("")
    (tmp_path / "acme" / "plans.py").write_text(OTHER_PROJECT)
    (tmp_path / "pyflyte.py").write_text(RECORDING_PYFLYTE)
    asked, out = tmp_path / f"asked-{profile}.jsonl", tmp_path / f"flyte-{profile}.tgz"
    env = {**_env(tmp_path), "PYTHONPATH": f"{REPO}:{tmp_path}", "FLYROLL_PROFILE": profile,
           "FLYROLL_IMAGE_REGISTRY": "localhost:30000"}
    proc = subprocess.run([sys.executable, str(tmp_path / "pyflyte.py"), str(asked), "--pkgs", "workflows,acme", "package",
                           "-f", "--output", str(out)], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with tarfile.open(out) as tar:
        files = {m.name: tar.extractfile(m).read() for m in tar.getmembers() if m.isfile()}
    return files, [json.loads(line) for line in asked.read_text().splitlines()]


def _launch_plan(files: dict, name: str):
    from flyteidl.admin import launch_plan_pb2

    (path,) = [n for n in files if n.endswith(f"_{name}_3.pb")]
    lp = launch_plan_pb2.LaunchPlan()
    lp.ParseFromString(files[path])
    return lp


def _overrides(lp) -> list[str]:
    default = lp.spec.default_inputs.parameters["set"].default
    assert default.HasField("collection")
    return [item.scalar.primitive.string_value for item in default.collection.literals]


def _task_images(files: dict) -> dict[str, str]:
    from flyteidl.admin import task_pb2

    images = {}
    for n, data in files.items():
        if n.endswith("_1.pb"):  # resource type 1 = task
            t = task_pb2.TaskSpec()
            t.ParseFromString(data)
            images[t.template.id.name] = t.template.container.image
    return images


def test_package_holds_the_scheduled_plans_and_every_task_names_the_cpu_image(tmp_path):
    files, asked = _package(tmp_path, "cpu")

    nightly = _launch_plan(files, "flyroll_nightly_retrain")
    assert nightly.spec.workflow_id.name == "workflows.schedules.retrain"
    assert nightly.spec.entity_metadata.schedule.cron_schedule.schedule == "0 3 * * *"
    d = {k: v.default.scalar.primitive for k, v in nightly.spec.default_inputs.parameters.items()}
    assert d["config"].string_value == "configs/tiny_s3.yaml" and d["iterations"].integer == 4
    assert _overrides(nightly) == []   # `--set`: none unless a launch names some

    weekly = _launch_plan(files, "acme_weekly_retrain")   # made by the factory in another package
    assert weekly.spec.workflow_id.name == "workflows.schedules.retrain"
    assert weekly.spec.entity_metadata.schedule.cron_schedule.schedule == "30 4 * * 1"
    d = {k: v.default.scalar.primitive for k, v in weekly.spec.default_inputs.parameters.items()}
    assert d["config"].string_value == "configs/gspo.yaml" and d["iterations"].integer == 2
    assert _overrides(weekly) == ["run.experiment=acme", "training.lr=2e-5"]

    (spec,) = {json.dumps(a, sort_keys=True) for a in asked}   # one image asked for, however many tasks
    spec = json.loads(spec)
    assert spec["name"] == "flyroll-cpu" and spec["image"].startswith("localhost:30000/flyroll-cpu:")
    assert spec["index"] == ["https://download.pytorch.org/whl/cpu"] and spec["base"] is None
    assert spec["env"]["FLYROLL_PROFILE"] == "cpu" and spec["env"]["FLYROLL_IMAGE_REGISTRY"] == "localhost:30000"
    images = _task_images(files)
    stages = {"tasks.stages.rollout.rollout", "tasks.stages.training.train", "tasks.stages.weight_sync.publish_weights",
              "tasks.stages.evaluation.evaluate", "workflows.schedules.promote", "workflows.rlvr.rl_loop",
              "workflows.post_train.challenge"}
    assert stages <= set(images), sorted(images)
    assert set(images.values()) == {spec["image"]}, images


@pytest.mark.slow
def test_gpu_profile_packages_every_task_with_the_cuda_image(tmp_path):
    files, asked = _package(tmp_path, "gpu")
    (spec,) = {json.dumps(a, sort_keys=True) for a in asked}
    spec = json.loads(spec)
    assert spec["name"] == "flyroll-gpu" and spec["base"].startswith("nvidia/cuda:") and spec["index"] is None
    assert spec["env"]["FLYROLL_PROFILE"] == "gpu"
    assert set(_task_images(files).values()) == {spec["image"]}


def test_image_packages_are_pyprojects_dependencies_and_extras():
    from infra.images import EXTRAS, PACKAGES, image_spec

    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = [*project["dependencies"], *(p for e in EXTRAS for p in project["optional-dependencies"][e])]
    assert list(PACKAGES) == wanted
    assert image_spec("cpu").packages == image_spec("gpu").packages == wanted
    with pytest.raises(ValueError, match="image variant 'tpu'"):
        image_spec("tpu")


def test_registered_model_and_champion_alias_come_from_the_config():
    from configs.schema import ConfigError, parse_config

    assert parse_config({}).run.registered_model == "flyroll-policy"
    assert parse_config({}).run.champion_alias == "champion"
    acme = parse_config({"run": {"experiment": "acme-math"}}).run
    assert acme.registered_model == "acme-math-policy"
    own = parse_config({"run": {"experiment": "acme-math", "model_name": "acme-prod", "champion_alias": "prod"}}).run
    assert (own.registered_model, own.champion_alias) == ("acme-prod", "prod")
    for bad in ("latest", "v3", "has space", "a/b"):
        with pytest.raises(ConfigError, match="run.champion_alias"):
            parse_config({"run": {"champion_alias": bad}})
    with pytest.raises(ConfigError, match="run.model_name"):
        parse_config({"run": {"model_name": ""}})


def test_two_projects_on_one_mlflow_keep_their_own_model_and_champion(tmp_path):
    """Policy versions and the champion alias of one project's model leave the other's alone (real
    MLflow, SQLite store)."""
    from configs.schema import parse_config
    from infra import tracking

    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    versions = {}
    for experiment in ("flyroll", "acme"):
        run_cfg = parse_config({"run": {"experiment": experiment}}).run
        run_id = tracking.start_parent_run(uri, experiment, "r", {}, {}, artifact_location=str(tmp_path / "art"))
        key = f"runs/{experiment}/policy/v0001"
        versions[experiment] = tracking.register_policy(uri, run_cfg.registered_model, run_id, f"file:///store/{key}", key, {})
        assert tracking.register_policy(uri, run_cfg.registered_model, run_id, f"file:///store/{key}", key, {}) == versions[experiment]
        tracking.set_alias(uri, run_cfg.registered_model, run_cfg.champion_alias, versions[experiment])
    c = tracking.client(uri)
    assert {m.name for m in c.search_registered_models()} == {"flyroll-policy", "acme-policy"}
    for experiment, model in (("flyroll", "flyroll-policy"), ("acme", "acme-policy")):
        champion = tracking.alias_version(uri, model, "champion")
        assert champion.tags["flyroll.key"] == f"runs/{experiment}/policy/v0001"
        assert tracking.find_model_version(uri, model, f"runs/{experiment}/policy/v0001").version == champion.version
    assert tracking.find_model_version(uri, "acme-policy", "runs/flyroll/policy/v0001") is None
    with pytest.raises(ValueError, match="models:/acme-policy/latest"):
        tracking.set_alias(uri, "acme-policy", "latest", versions["acme"])


def test_retrain_plan_refuses_a_bad_preset_cron_override_or_iteration_count():
    from configs.schema import ConfigError
    from workflows.schedules import retrain_plan

    with pytest.raises(ConfigError, match="configs/nope.yaml' does not exist"):
        retrain_plan("bad_preset", "configs/nope.yaml", "0 3 * * *")
    with pytest.raises(ValueError, match="Schedule is invalid"):
        retrain_plan("bad_cron", "configs/tiny.yaml", "61 3 * * *")
    with pytest.raises(ValueError, match="iterations=-1"):
        retrain_plan("bad_iterations", "configs/tiny.yaml", "0 3 * * *", iterations=-1)
    with pytest.raises(ConfigError, match="run.champion_alias"):
        retrain_plan("bad_override", "configs/tiny.yaml", "0 3 * * *", overrides=["run.champion_alias=latest"])


def test_post_train_plan_schedules_sft_then_rl_and_refuses_a_swapped_pair():
    from configs.schema import ConfigError
    from workflows.post_train import post_train_plan

    plan = post_train_plan("acme_post_train", "configs/sft_tiny.yaml", "configs/tiny.yaml", "0 5 * * 0",
                           rl_set=["loop.iterations=4"])
    assert plan.schedule.cron_schedule.schedule == "0 5 * * 0"
    defaults = {k: p.default for k, p in plan.parameters.parameters.items()}
    assert defaults["sft_config"].scalar.primitive.string_value == "configs/sft_tiny.yaml"
    assert defaults["rl_config"].scalar.primitive.string_value == "configs/tiny.yaml"
    assert defaults["promote"].scalar.primitive.boolean is True   # champion/challenger on every scheduled run
    with pytest.raises(ValueError, match="workflows/sft.py needs the config's sft section"):
        post_train_plan("swapped", "configs/tiny.yaml", "configs/sft_tiny.yaml", "0 5 * * 0")
    with pytest.raises(ConfigError, match="sft.nope"):
        post_train_plan("bad_override", "configs/sft_tiny.yaml", "configs/tiny.yaml", "0 5 * * 0", sft_set=["sft.nope=1"])
