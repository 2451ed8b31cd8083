"""Run a Python script or module as if some packages were not installed (what a lent GPU box lacks):

    python tests/support/hidden_packages.py flytekit,ray,mlflow -- benchmarks/gpu_rl_check.py --smoke --device cpu
    python tests/support/hidden_packages.py flytekit,ray,mlflow -- -m some.module ARGS
    python tests/support/hidden_packages.py flytekit,ray,mlflow -- -c "import flytekit"   (or - to read the code from stdin)

The path finder on sys.meta_path is wrapped so that it finds nothing under the hidden top-level
names: an import of one raises ModuleNotFoundError and `importlib.util.find_spec` returns None, as
for a package that is absent (a finder that raised ImportError in find_spec would also break the
availability probes of transformers and accelerate, which call find_spec). Their distributions are
hidden from importlib.metadata too. Modules already imported when this starts (a namespace package a
.pth file set up) are left alone.
"""

from __future__ import annotations

import importlib.machinery
import os
import runpy
import sys


class HidingFinder:
    def __init__(self, inner, hidden: set[str]):
        self.inner, self.hidden = inner, hidden

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in self.hidden:
            return None
        return self.inner.find_spec(name, path, target)

    def find_distributions(self, context=None):
        for d in self.inner.find_distributions(context):
            if (d.metadata["Name"] or "").lower().replace("_", "-") not in self.hidden:
                yield d

    def __getattr__(self, name):
        return getattr(self.inner, name)


def hide(names) -> None:
    hidden = {n.strip() for n in names if n.strip()}
    sys.meta_path[:] = [HidingFinder(f, hidden) if f is importlib.machinery.PathFinder else f for f in sys.meta_path]


def main() -> None:
    # run as a script, this file's folder (tests/support/, which holds engines.py and training.py) is first on
    # sys.path and would shadow the project's packages of those names: the code run here never sees it
    here = os.path.dirname(os.path.abspath(__file__))
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
    names, sep, rest = sys.argv[1], sys.argv[2], sys.argv[3:]
    assert sep == "--", "usage: hidden_packages.py NAME,NAME -- script.py ARGS | -m module ARGS | -c CODE ARGS | - ARGS"
    hide(names.split(","))
    if rest[0] in ("-c", "-"):  # as `python -c CODE` / `python - ARGS < code`: the current folder first on sys.path
        code = rest[1] if rest[0] == "-c" else sys.stdin.read()
        sys.argv = ["-c", *rest[2:]] if rest[0] == "-c" else ["-", *rest[1:]]
        sys.path.insert(0, "")
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})
    elif rest[0] == "-m":
        sys.argv = [rest[1], *rest[2:]]
        runpy.run_module(rest[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = rest
        runpy.run_path(rest[0], run_name="__main__")


if __name__ == "__main__":
    main()
