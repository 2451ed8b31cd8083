"""Peak host memory (RSS) of the pipeline with colocated generation engines asleep between rollouts
(`placement.offload_generation`), the trainer's state offloaded while they run
(`placement.offload_train`) and the reference's models dropped between its forwards
(`placement.offload_reference`), and with the three roles in one process per training worker
(`placement.hybrid`, tasks/actors/hybrid.py), against the same pipeline with everything resident.

    OMP_NUM_THREADS=1 .venv/bin/python -m benchmarks.colocation_memory --models tiny,smollm2 --iterations 2 \
        --offload none,weights,weights:all:ref,weights:all:ref:hybrid

Per model (`tiny`: the default policy's shape, random init; `smollm2`: SmolLM2-135M-Instruct, as
`flyroll bench` prepares them, benchmarks/bench.py) it runs the real workflow (`pyflyte run
workflows/rlvr.py rlvr`, the shared local Ray instance, hf engine, the bench pipeline's settings:
B x G = 8 x 8, 32 new tokens, benchmarks/bench_pipeline.py `pipeline_config`) once per
`--offload` row, one after the other: `GEN[:TRAIN[:FLAG...]]` = offload_generation, offload_train
(default none) and, with `ref`, offload_reference true, with `hybrid`, placement.hybrid true (one
HybridWorker process hosts what TrainWorker, GenerationWorker and ReferenceWorker host apart). Every config has `placement.colocate:
[[actor_train, actor_infer, reference]]`, `sync.method` from `--sync` (live by default) and one torch thread per actor
(`run.torch_threads: 1`, OMP_NUM_THREADS=1). While each runs, every Ray worker process under the
pyflyte process is sampled every `--interval` s: its peak RSS (VmHWM, exact) per actor, and the
peak of the sum of their RSS (sampled), which is what the host must hold at once. Beside it: the
sum of the per-actor peaks (what separate devices, one per actor, would need in all) and
max(TrainWorker, GenerationWorker) peak (the colocation ideal, max(train, generate); in a hybrid row
the HybridWorker's peak, which holds both).

On one CPU host a disaggregated placement (no colocate group) runs exactly the same processes as
`offload none` (the local shared Ray reserves no CPUs; config-wise colocation only changes Ray's
fractional reservations), so its total is that row's; on separate devices each role's device would
need its own actors' peak (the per-actor columns). RSS counts shared library pages in every process
(torch alone ~300 MB each), so the RSS totals overstate the unique memory by that much, equally in
every row. The `pss` column is the peak of the summed PSS (`/proc/<pid>/smaps_rollup`: each shared
page divided among the processes that map it), the memory the actors really hold at once; it is
read every `--pss-every` samples, since smaps_rollup walks the page tables (a few ms per GB).
Each row also records what its run logged per iteration (`RESULT_KEYS`: policy loss, entropy, grad
norm, KL, reward, eval accuracy), and the end says whether every row of a model logged the same.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
import threading
import time
from types import SimpleNamespace

from benchmarks.bench import prepare_model_in_child
from benchmarks.bench_pipeline import pipeline_config, workflow_command
from benchmarks.harness import REPO


def _status_kb(pid: int, *keys: str) -> dict[str, int]:
    with open(f"/proc/{pid}/status") as f:
        return {k: int(v.split()[0]) for k, v in (line.split(":", 1) for line in f) if k in keys}


def _pss_kb(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("Pss:"))


class RaySampler(threading.Thread):
    """Samples the Ray worker processes (`ray::<Class>...` titles) under `root_pid` every `interval` s."""

    def __init__(self, root_pid: int, interval: float, pss_every: int = 4):
        super().__init__(daemon=True)
        self.root, self.interval, self.pss_every, self.stop = root_pid, interval, pss_every, threading.Event()
        self.actors: dict[int, dict] = {}   # pid -> {"actor": class, "peak_rss_mb": VmHWM}
        self.peak_total_mb, self.peak_pss_mb, self.samples = 0.0, 0.0, 0

    def run(self) -> None:
        import psutil

        root = psutil.Process(self.root)
        while not self.stop.wait(self.interval):
            total = pss = 0.0
            with_pss = self.samples % self.pss_every == 0
            try:
                procs = root.children(recursive=True)
            except psutil.Error:
                return
            for p in procs:
                try:
                    title = (p.cmdline() or [""])[0]
                    if not title.startswith("ray::"):
                        continue
                    kb = _status_kb(p.pid, "VmRSS", "VmHWM")
                    if with_pss:
                        kb["Pss"] = _pss_kb(p.pid)
                except (psutil.Error, OSError, ValueError, StopIteration):
                    continue
                # "ray::<actor name>:<Class>.<method>" for a named actor, "ray::<Class>..." otherwise
                name = title.removeprefix("ray::").split()[0].split(":")[-1].split(".")[0]
                if name.endswith("Agent"):  # Ray's own dashboard / runtime-env agents, not flyroll actors
                    continue
                seen = self.actors.setdefault(p.pid, {"actor": name, "peak_rss_mb": 0.0})
                if seen["actor"] == "IDLE":  # an idle pooled worker that became an actor
                    seen["actor"] = name
                seen["peak_rss_mb"] = max(seen["peak_rss_mb"], kb.get("VmHWM", 0) / 1024)
                total += kb.get("VmRSS", 0) / 1024
                pss += kb.get("Pss", 0) / 1024
            self.peak_total_mb = max(self.peak_total_mb, total)
            self.peak_pss_mb = max(self.peak_pss_mb, pss)
            self.samples += 1


def placement(row: str) -> dict:
    """The placement section of an `--offload` row, GEN[:TRAIN[:FLAG...]] with flags `ref` and `hybrid`."""
    gen, train, *flags = row.split(":") + ([] if ":" in row else ["none"])
    if set(flags) - {"", "ref", "hybrid"}:
        raise SystemExit(f"--offload row {row!r}: the parts after the second are 'ref', 'hybrid' or nothing")
    return {"colocate": [["actor_train", "actor_infer", "reference"]], "offload_generation": gen,
            "offload_train": train, "offload_reference": "ref" in flags, "hybrid": "hybrid" in flags}


RESULT_KEYS = ("actor/pg_loss", "actor/entropy", "actor/grad_norm", "reference/kl_k3", "reward/mean", "eval/accuracy")


def logged_results(tracking_uri: str) -> dict[str, list[float]]:
    """What the run learned, per iteration (RESULT_KEYS' histories): the placement settings move
    memory, not results, so every row of a model should log the same values."""
    from infra import tracking

    c = tracking.client(tracking_uri)
    exp = c.get_experiment_by_name("flyroll")
    (run,) = [r for r in c.search_runs([exp.experiment_id]) if "mlflow.parentRunId" not in r.data.tags]
    return {k: [m.value for m in sorted(c.get_metric_history(run.info.run_id, k), key=lambda m: m.step)] for k in RESULT_KEYS}


def run_one(name: str, model_dir: str, chat: bool, offload: str, args, workdir: str) -> dict:
    bench = SimpleNamespace(prompts=8, samples=8, max_new=32, lr=1e-6, micro_tokens=2048, threads=1, pipeline=args.iterations)
    root = os.path.join(workdir, f"{name}-{offload.replace(':', '-')}")
    cfg = pipeline_config(name, model_dir, chat, "hf", bench, os.path.join(root, "runs"))
    cfg["run"]["name"] = f"coloc-{name}-{offload.replace(':', '-')}"
    cfg["placement"] = placement(offload)
    cfg["sync"] = {"method": args.sync}
    cmd, env = workflow_command(cfg, root, FLYROLL_RAY="shared", OMP_NUM_THREADS="1", FLYROLL_MAX_TORCH_THREADS="1")
    print(f"[{name} offload={offload}] {' '.join(cmd)} (log {root}/pyflyte.log)", flush=True)
    start, load = time.time(), os.getloadavg()[0]
    with open(os.path.join(root, "pyflyte.log"), "w") as log:
        proc = subprocess.Popen(cmd, cwd=str(REPO), env=env, stdout=log, stderr=subprocess.STDOUT)
        sampler = RaySampler(proc.pid, args.interval, args.pss_every)
        sampler.start()
        rc = proc.wait()
        sampler.stop.set()
        sampler.join()
    row = {"model": name, "offload": offload, "sync": args.sync, "seconds": round(time.time() - start, 1), "exit": rc,
           "peak_total_mb": round(sampler.peak_total_mb), "peak_total_pss_mb": round(sampler.peak_pss_mb),
           "samples": sampler.samples,
           "load_1m": [round(load, 1), round(os.getloadavg()[0], 1)]}  # the box's load at the start and the end
    by_actor: dict[str, list[float]] = {}
    for a in sampler.actors.values():
        if a["actor"] != "IDLE":
            by_actor.setdefault(a["actor"], []).append(round(a["peak_rss_mb"]))
    row["actors_peak_mb"] = {k: sorted(v, reverse=True) for k, v in sorted(by_actor.items())}
    row["sum_actor_peaks_mb"] = round(sum(v[0] for v in by_actor.values() if v))
    row["max_train_gen_mb"] = round(max((by_actor.get(a) or [0])[0] for a in ("TrainWorker", "GenerationWorker", "HybridWorker")))
    if rc:
        row["error"] = f"pyflyte exited {rc}"
    else:
        row["results"] = logged_results(cfg["run"]["tracking_uri"])
        with open(os.path.join(root, "pyflyte.log")) as f:
            print(f.read()[-4000:], flush=True)
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="tiny", help="comma list of tiny, smollm2")
    ap.add_argument("--offload", default="none,weights,weights:all:ref",
                    help="rows in run order, each GEN[:TRAIN[:FLAG...]]: offload_generation, offload_train, then 'ref' = "
                         "offload_reference, 'hybrid' = placement.hybrid (the three roles in one process per training worker)")
    ap.add_argument("--sync", choices=("live", "store"), default="live", help="sync.method of every run")
    ap.add_argument("--iterations", type=int, default=2, help="loop.iterations of each run")
    ap.add_argument("--interval", type=float, default=0.05, help="seconds between RSS samples")
    ap.add_argument("--pss-every", type=int, default=4, help="read PSS (smaps_rollup) every N samples")
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="flyroll-coloc-") as workdir:
        for name in args.models.split(","):
            model_dir, chat = prepare_model_in_child(name, workdir)
            for offload in args.offload.split(","):
                rows.append(run_one(name, model_dir, chat, offload, args, workdir))
                print(json.dumps(rows[-1]), flush=True)
    print(f"\npeak RSS, MB (torch threads 1 per actor; sync.method {args.sync}; {args.iterations} iterations; "
          "total = peak of the sum over Ray actor processes, sampled; pss = the same for PSS (shared pages divided "
          "among the processes that map them); per actor = its VmHWM; sum = the per-actor peaks added (the largest "
          "process of each actor); max = max(TrainWorker, GenerationWorker, HybridWorker))")
    actors = sorted({a for r in rows for a in r["actors_peak_mb"]})
    print(f"{'model':8} {'offload':16} {'total':>7} {'pss':>7} {'sum':>7} {'max':>7} " + " ".join(f"{a:>22}" for a in actors) + f" {'s':>6}")
    for r in rows:
        cells = " ".join(f"{'+'.join(map(str, r['actors_peak_mb'].get(a, []))) or '-':>22}" for a in actors)
        print(f"{r['model']:8} {r['offload']:16} {r['peak_total_mb']:>7} {r['peak_total_pss_mb']:>7} {r['sum_actor_peaks_mb']:>7} {r['max_train_gen_mb']:>7} {cells} {r['seconds']:>6}" + (f"  {r['error']}" if r.get("error") else ""))
    for name in dict.fromkeys(r["model"] for r in rows):
        logged = [r for r in rows if r["model"] == name and "results" in r]
        same = all(r["results"] == logged[0]["results"] for r in logged)
        print(f"{name}: {', '.join(RESULT_KEYS)} per iteration {'identical' if same else 'DIFFER'} across "
              f"{len(logged)} finished row(s)" + ("" if same else ": " + "; ".join(f"{r['offload']} {r['results']}" for r in logged)))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
