"""`flyroll`: the operational commands that are not workflows.

    flyroll eval --model SPEC --data TABLE           accuracy per domain as JSON (SPEC: as model.path)
    flyroll sandbox PROGRAM.py [--tests T.py]        run model-written code in the sandbox
    flyroll stack up|down|status                     local S3 + MLflow services on loopback
    flyroll lineage VERSION_OR_RUN                   model lineage back to the base model
    flyroll bench [--models tiny,smollm2] [...]      flyroll vs TRL GRPOTrainer throughput (docs/benchmarks.md)
    flyroll bench --learning --config C --budget-min M   flyroll vs TRL accuracy vs wall time

Each subcommand lives beside the code it drives and is imported lazily, so `flyroll --help`
stays fast. The commands of infra/ and the floors below it are listed here; a package on a floor
above infra/ (which infra/ must not import) adds its own through the entry-point group
`flyroll.commands` of its distribution: pyproject.toml declares `bench` (benchmarks/bench.py) there,
and `pip install -e .` registers it.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from importlib.metadata import EntryPoint, entry_points

from engines.models.threads import set_wait_policy

set_wait_policy()  # before any subcommand loads torch (engines/models/threads.py): bench, eval and their children

# subcommand -> ("module:function" taking (argv: list[str]) -> int, one line of help)
CORE = {
    "eval": ("infra.eval_cli:main", "evaluate a policy on an eval table, accuracy per domain as JSON"),
    "sandbox": ("engines.sandbox.runner:cli_main", "run a program in the code sandbox, print the verdict as JSON"),
    "stack": ("infra.stack:cli_main", "start/stop/show the local S3 + MLflow service stack"),
    "lineage": ("infra.lineage:cli_main", "print a model version's lineage back to the base model"),
}
GROUP = "flyroll.commands"


def commands(registered: list[EntryPoint] | None = None) -> dict[str, tuple[str, str]]:
    """CORE plus the commands installed packages declare under GROUP (`registered`: those entry
    points, default: the installed ones). A registered command's help is the first line of its
    function's docstring, read only for `flyroll --help`."""
    found = dict(CORE)
    for ep in entry_points(group=GROUP) if registered is None else registered:
        found.setdefault(ep.name, (ep.value, ""))
    return found


def _load(target: str):
    module, func = target.split(":")
    return getattr(importlib.import_module(module), func)


def _help(name: str, target: str, text: str) -> str:
    if not text:
        try:
            text = ((_load(target).__doc__ or "").strip().splitlines() or [""])[0]
        except (ImportError, AttributeError) as e:
            text = f"not available in this install ({e})"
    return f"{name}: {text}"


def main(argv: list[str] | None = None, registered: list[EntryPoint] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    table = commands(registered)
    parser = argparse.ArgumentParser(
        prog="flyroll", description=__doc__.split("\n")[0],
        epilog=f"More commands come from installed packages (entry-point group {GROUP!r}; `pip install -e .` "
               "registers the ones pyproject.toml declares).")
    asked = not argv or argv[0] in ("-h", "--help")
    parser.add_argument("command", choices=sorted(table),
                        help="; ".join(_help(k, *v) for k, v in table.items()) if asked else None)
    if asked:
        parser.print_help()
        return 0
    name = argv[0]
    if name not in table:
        parser.print_usage(sys.stderr)
        print(f"flyroll: unknown command {name!r}; expected one of {sorted(table)}. A package's commands are "
              f"registered (entry-point group {GROUP!r}) when it is installed: pip install -e .", file=sys.stderr)
        return 2
    target, _ = table[name]
    try:
        fn = _load(target)
    except (ImportError, AttributeError) as e:
        print(f"flyroll {name}: not available in this install ({e})", file=sys.stderr)
        return 2
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
