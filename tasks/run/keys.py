"""The artifact-store keys of a run: the one place that spells `runs/<run_id>/...`.

    runs/<run_id>/policy/vNNNN          a policy version (weights, tokenizer, trainer state; tasks/stages/weight_sync.py)
    runs/<run_id>/rollouts/iNNNN        iteration NNNN's complete rollout table (tasks/stages/reference.py)
    runs/<run_id>/rollout_carry/iNNNN   the samples iteration NNNN carries into the next (tasks/loop/partial_rollout.py)

A policy version is one typed reference, `PolicyKey` (run id + version); `parse_policy_key` takes a
key apart, `PolicyKey.key` puts it together. Keys outside a run (`models/...`, `datasets/...`) are
named where they are made (tasks/stages/prepare.py).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tasks.run.types import RunSpec

RUNS = "runs"

_POLICY = re.compile(rf"{RUNS}/(?P<run_id>.+)/policy/v(?P<version>\d+)")
_SERIES_VERSION = re.compile(rf"(?P<series>{RUNS}/.+)/v(?P<version>\d+)")  # any versioned series of a run
_VERSION_NAME = re.compile(r"v(\d+)")


@dataclass(frozen=True)
class PolicyKey:
    """Policy version `version` of run `run_id`: key `runs/<run_id>/policy/v<version:04d>`."""

    run_id: str
    version: int

    @property
    def key(self) -> str:
        return f"{policy_prefix(self.run_id)}{version_name(self.version)}"

    def __str__(self) -> str:
        return self.key


def version_name(version: int) -> str:
    """The last part of a version's key: `v0007`."""
    return f"v{version:04d}"


def parse_version_name(name: str) -> int | None:
    """7 for `v0007`; None for any other name."""
    m = _VERSION_NAME.fullmatch(name)
    return int(m.group(1)) if m else None


def policy_prefix(run_id: str) -> str:
    """The folder of run `run_id`'s policy versions, with its trailing slash (for `ArtifactStore.list`)."""
    return f"{RUNS}/{run_id}/policy/"


def policy_key(spec: RunSpec, version: int) -> str:
    """`runs/<run_id>/policy/vNNNN`: version `version` of the run's policy."""
    return PolicyKey(spec.run_id, version).key


def parse_policy_key(key: str) -> PolicyKey | None:
    """The run and version of a policy key `runs/<run_id>/policy/vNNNN`; None for any other key
    (a base model `models/...`, a reference, a rollout table)."""
    m = _POLICY.fullmatch(key)
    return PolicyKey(m.group("run_id"), int(m.group("version"))) if m else None


def is_policy_of(run_id: str, key: str) -> bool:
    """Whether `key` is one of run `run_id`'s own policy versions."""
    p = parse_policy_key(key)
    return p is not None and p.run_id == run_id


def is_run_key(key: str) -> bool:
    """Whether `key` is a run's own artifact (`runs/...`), as opposed to a base or imported model."""
    return key.startswith(f"{RUNS}/")


def series_version(key: str) -> tuple[str, int] | None:
    """(series folder, version) of a versioned key of a run, `runs/.../vNNNN` -> (`runs/...`, NNNN);
    None for keys outside a run's series (the base model `models/...` stays cached)."""
    m = _SERIES_VERSION.fullmatch(key)
    return (m.group("series"), int(m.group("version"))) if m else None


def rollout_table_key(spec: RunSpec, iteration: int) -> str:
    """Where the reference stage publishes iteration `iteration`'s complete rollout table."""
    return f"{RUNS}/{spec.run_id}/rollouts/i{iteration:04d}"


def carry_key(spec: RunSpec, iteration: int) -> str:
    """Where the rollout task of `iteration` publishes the samples it carries into the next one."""
    return f"{RUNS}/{spec.run_id}/rollout_carry/i{iteration:04d}"
