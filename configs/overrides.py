"""Command-line overrides (`--set a.b=c`) and the import check of every function a config names.

Both run where the config is loaded (`configs/schema.py` `load_config`), so `pyflyte run` (the
`prepare_run` task), the retrain workflow and `flyroll eval` apply the same rules before anything
starts:

- `parse_overrides(["rollout.temperature=0.7", ...])` -> {"rollout.temperature": 0.7, ...}: the
  text after the first `=` is read as one YAML value, as if it stood in the preset (0.7 -> float,
  true -> bool, [a, b] -> list, 1e-5 -> the string "1e-5", which a float field accepts).
- `check_functions(cfg)`: every reward function `reward.functions` names (a registered name or
  "package.module:function") is imported now; one that cannot be is a ConfigError naming the field
  and the import error, instead of a run whose every sample scores 0. The working directory is put
  on sys.path first (`working_dir_on_path`), so a `my_rewards.py` beside the command is found the
  same way by every entry point -- as the Ray workers of a local run find it (Ray adds the driver's
  working directory to theirs).
"""

from __future__ import annotations

import os
import sys

import yaml


class OverrideError(ValueError):
    """A `--set` item that is not `dotted.key=value`; load_config callers see it as a ConfigError."""


def parse_overrides(items: list[str] | tuple[str, ...] | None) -> dict[str, object]:
    """{dotted key: YAML value} of `key=value` items, in order (a key given twice: the last wins, as in a
    shell's repeated flags)."""
    out: dict[str, object] = {}
    for item in items or ():
        key, eq, text = item.partition("=")
        key = key.strip()
        if not eq or not key or any(not part for part in key.split(".")):
            raise OverrideError(f"--set {item!r}: expected KEY=VALUE with a dotted key, e.g. rollout.temperature=0.7")
        try:
            out[key] = yaml.safe_load(text) if text.strip() else ""
        except yaml.YAMLError as e:
            raise OverrideError(f"--set {item!r}: the value of {key} is not a YAML value ({e})") from None
    return out


def working_dir_on_path() -> None:
    """Put the working directory first on sys.path (console scripts such as pyflyte and flyroll start
    with their bin folder there instead), so a user's reward module beside the command imports."""
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.insert(0, cwd)


def check_functions(cfg) -> list[str]:
    """Import every reward function `cfg.reward.functions` names; return the error lines (one per
    field that cannot be resolved), empty when all import. Model rewards ('judge', 'reward_model')
    are checked by the schema itself (their `model` must be set)."""
    from engines.rewards import get_reward
    from engines.rewards.models import MODEL_REWARDS

    working_dir_on_path()
    errors = []
    for domain, name in sorted(cfg.reward.functions.items()):
        if name in MODEL_REWARDS:
            continue
        try:
            fn = get_reward(name)
        except KeyError as e:  # unknown name, or ImportError / AttributeError, as get_reward words it
            errors.append(f"  reward.functions.{domain}: {e.args[0]} (the working directory {os.getcwd()} is on sys.path)")
            continue
        except Exception as e:  # noqa: BLE001 -- the user's module raised while it was imported
            errors.append(f"  reward.functions.{domain}: reward function {name!r} cannot be imported: "
                          f"{type(e).__name__}: {e}")
            continue
        if not callable(fn):
            errors.append(f"  reward.functions.{domain}: {name!r} is a {type(fn).__name__}, not a function "
                          "fn(response: str, sample: dict) -> float")
    return errors
