"""`flyroll`: the operational commands that are not workflows.

    flyroll eval --model SPEC --data TABLE           accuracy per domain as JSON (SPEC: as model.path)
    flyroll sandbox PROGRAM.py [--tests T.py]        run model-written code in the sandbox
    flyroll stack up|down|status                     local S3 + MLflow services on loopback
    flyroll lineage VERSION_OR_RUN                   model lineage back to the base model
    flyroll bench [--models tiny,smollm2] [...]      flyroll vs TRL GRPOTrainer throughput (docs/benchmarks.md)
    flyroll bench --learning --config C --budget-min M   flyroll vs TRL accuracy vs wall time

Each subcommand lives beside the code it drives and is imported lazily, so `flyroll --help`
stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> "module:function" taking (argv: list[str]) -> int
_COMMANDS = {
    "eval": ("infra.eval_cli:main", "evaluate a policy on an eval table, accuracy per domain as JSON"),
    "sandbox": ("engines.sandbox:cli_main", "run a program in the code sandbox, print the verdict as JSON"),
    "stack": ("infra.stack:cli_main", "start/stop/show the local S3 + MLflow service stack"),
    "lineage": ("infra.lineage:cli_main", "print a model version's lineage back to the base model"),
    "bench": ("infra.bench:cli_main", "flyroll vs TRL GRPOTrainer throughput, side by side, and the pipeline's stage breakdown; --learning: accuracy vs wall time"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = argparse.ArgumentParser(prog="flyroll", description=__doc__.split("\n")[0])
    parser.add_argument("command", choices=sorted(_COMMANDS), help="; ".join(f"{k}: {v[1]}" for k, v in _COMMANDS.items()))
    if not argv or argv[0] in ("-h", "--help"):
        parser.print_help()
        return 0
    args = parser.parse_args(argv[:1])
    target, _ = _COMMANDS[args.command]
    module, func = target.split(":")
    try:
        fn = getattr(importlib.import_module(module), func)
    except (ImportError, AttributeError) as e:
        print(f"flyroll {args.command}: not available in this install ({e})", file=sys.stderr)
        return 2
    return int(fn(argv[1:]) or 0)


if __name__ == "__main__":
    sys.exit(main())
