"""`flyroll bench` and benchmarks/gpu_mfu.py: the CLI answers, the arithmetic of the tables (hand-worked
values), flyroll's step worker on the tiny model (both weight-sync paths), and the GPU script's CPU
smoke run. No timing is asserted (speed lives in benchmarks/)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.bench import parse_args, summarise, with_ratios
from benchmarks.bench_pipeline import iteration_breakdown, mean_breakdown, mode_rows
from benchmarks.harness import ratio

REPO = Path(__file__).resolve().parents[2]


def declared_commands():
    """The `flyroll.commands` entry points pyproject.toml declares (what `pip install -e .` registers)."""
    import tomllib
    from importlib.metadata import EntryPoint

    group = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["entry-points"]["flyroll.commands"]
    return [EntryPoint(name=k, value=v, group="flyroll.commands") for k, v in group.items()]


def test_bench_help_lists_the_options():
    r = subprocess.run([sys.executable, "-m", "benchmarks.bench", "--help"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    for opt in ("--models", "--engines", "--batches", "--threads", "--max-new", "--json", "--pipeline", "--reward", "--sync"):
        assert opt in r.stdout


def test_flyroll_bench_is_the_command_pyproject_registers(capsys):
    """infra/ must not import benchmarks/ (a floor above it): `flyroll bench` reaches benchmarks/bench.py
    through the entry point pyproject.toml declares; infra/cli.py only reads the group."""
    from benchmarks.bench import cli_main
    from infra import cli

    registered = declared_commands()
    assert {ep.name: ep.load() for ep in registered} == {"bench": cli_main}
    assert cli.main(["--help"], registered=registered) == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps the lines
    assert "bench: flyroll vs TRL GRPOTrainer throughput" in out and "eval: evaluate a policy" in out
    with pytest.raises(SystemExit) as e:  # dispatched: bench's own parser answers
        cli.main(["bench", "--help"], registered=registered)
    assert e.value.code == 0 and "--pipeline" in capsys.readouterr().out
    assert cli.main(["bench"], registered=[]) == 2  # not registered (an install older than pyproject.toml): said so
    err = capsys.readouterr().err
    assert "unknown command 'bench'" in err and "pip install -e ." in err


def test_bad_options_are_named():
    with pytest.raises(SystemExit) as e:
        parse_args(["--models", "tiny,gpt5"])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        parse_args(["--engines", "sglang"])
    args = parse_args(["--models", "tiny", "--engines", "hf", "--batches", "2"])
    assert (args.models, args.engines, args.batches, args.threads, args.max_new) == ("tiny", "hf", 2, 2, 32)
    assert args.flyroll_memory == "release" and parse_args(["--flyroll-memory", "keep"]).flyroll_memory == "keep"
    assert args.sync == "memory" and parse_args(["--sync", "files"]).sync == "files"
    with pytest.raises(SystemExit):
        parse_args(["--sync", "nccl"])


@pytest.mark.parametrize("sync", ["memory", "files"])
def test_flyroll_step_worker_trains_and_syncs_the_engine(tiny_model_dir, sync, monkeypatch):
    """One timed step of benchmarks/flyroll_grpo_step.py: the update changes the policy and, either
    way of syncing, the generation engine ends up with exactly the trained weights."""
    import torch

    from benchmarks.bench import problems_for

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    import flyroll_grpo_step

    # the worker sets process-wide state: keep pytest's malloc settings and thread count as they are
    monkeypatch.setattr("engines.models.host_memory.keep_freed_memory", lambda: False)
    spec = {"engine": "hf", "model_dir": tiny_model_dir, "chat": False, "problems": problems_for(2), "samples": 4,
            "max_new": 6, "threads": torch.get_num_threads(), "lr": 1e-2, "micro_tokens": 4096, "kv_cache_gb": 1, "reward": "shaped", "sync": sync}
    step, close = flyroll_grpo_step.build(spec)
    scope = dict(zip(step.__code__.co_freevars, (c.cell_contents for c in step.__closure__)))
    policy, engine = scope["policy"], scope["engine"]
    before = {n: p.detach().clone() for n, p in policy.named_parameters()}
    try:
        r = step(2001)
    finally:
        close()
    assert r["samples"] == 8 and r["trained_rows"] > 0 and r["sync_s"] >= 0
    served = dict(engine.model.named_parameters())
    assert any(not torch.equal(before[n], p) for n, p in policy.named_parameters())
    for n, p in policy.named_parameters():
        assert torch.equal(served[n], p), n
        assert served[n].data_ptr() != p.data_ptr()


def test_summarise_is_totals_over_time_not_a_mean_of_rates():
    steps = [{"s": 2.0, "samples": 64, "tokens": 640, "gen_s": 1.0, "score_s": 0.1, "train_s": 0.8, "sync_s": 0.1},
             {"s": 6.0, "samples": 64, "tokens": 960, "gen_s": 5.0, "score_s": 0.1, "train_s": 0.8, "sync_s": 0.1}]
    s = summarise(steps)
    # 128 samples / 8 s = 16 /s (the mean of 32 and 10.67 would be 21.3); 1600 tokens / 8 s = 200 /s
    assert s["samples_per_s"] == pytest.approx(16.0)
    assert s["tokens_per_s"] == pytest.approx(200.0)
    assert s["step_s"] == pytest.approx(4.0) and s["median_step_s"] == pytest.approx(4.0)  # (2 + 6) / 2
    assert s["gen_s"] == pytest.approx(3.0)
    assert s["mean_response_tokens"] == pytest.approx(12.5)
    assert "gen_s" not in summarise([{"s": 1.0, "samples": 8, "tokens": 8}])  # TRL reports no parts


def test_summarise_reports_the_largest_resident_memory_of_the_steps():
    steps = [{"s": 1.0, "samples": 8, "tokens": 8, "rss_gb": 3.0, "peak_rss_gb": 8.0},
             {"s": 1.0, "samples": 8, "tokens": 8, "rss_gb": 2.5, "peak_rss_gb": 8.5}]
    s = summarise(steps)
    assert (s["rss_gb"], s["peak_rss_gb"]) == (3.0, 8.5)
    assert "rss_gb" not in summarise([{"s": 1.0, "samples": 8, "tokens": 8}])  # no /proc: no column value


def test_summarise_reports_the_rows_flyroll_trained():
    steps = [{"s": 1.0, "samples": 64, "tokens": 8, "trained_rows": 64}, {"s": 1.0, "samples": 64, "tokens": 8, "trained_rows": 1}]
    assert summarise(steps)["trained_rows"] == 32.5
    assert "trained_rows" not in summarise([{"s": 1.0, "samples": 8, "tokens": 8}])  # TRL: every row


def test_bench_rewards(monkeypatch):
    """Both workers score with benchmarks/bench_reward.py: `exact` is 1/0 on the first line; `shaped`
    adds 0.5 for the answer anywhere (as a word) and a brevity term below 0.2, so garbage ties rarely."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_reward import bench_reward

    assert bench_reward("exact", " 11\nbecause", "11") == bench_reward("shaped", "11", "11") == 1.0
    assert bench_reward("exact", "it is 11.", "11") == 0.0
    assert bench_reward("shaped", "it is 11.", "11") == 0.5
    assert bench_reward("shaped", "it is 110", "11") < 0.2  # not the answer as a word of its own
    garbage = ["I think so", "A longer answer that says nothing", "x" * 300, ""]
    assert [bench_reward("shaped", t, "5") for t in garbage] == pytest.approx([0.2 * (1 - len(t) / 200) if len(t) < 200 else 0.0
                                                                             for t in garbage])
    with pytest.raises(ValueError, match="reward 'f1'"):
        bench_reward("f1", "5", "4")


def test_worker_rss_is_read_from_proc(monkeypatch):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[2] / "benchmarks"))  # as the worker scripts find it
    from worker_memory import rss_gb

    r = rss_gb()
    assert 0.01 < r["rss_gb"] <= r["peak_rss_gb"] < 64  # this pytest process: tens of MB to a few GB


def test_ratios_are_against_trl_of_the_same_model_and_pair():
    trl = "TRL 1.16 GRPOTrainer"
    rows = [{"model": "tiny", "pair": "flyroll hf", "system": "flyroll hf", "samples_per_s": 30.0, "tokens_per_s": 300.0},
            {"model": "tiny", "pair": "flyroll hf", "system": trl, "samples_per_s": 10.0, "tokens_per_s": 150.0},
            {"model": "tiny", "pair": "flyroll vllm", "system": "flyroll vllm", "samples_per_s": 60.0, "tokens_per_s": 600.0},
            {"model": "tiny", "pair": "flyroll vllm", "system": trl, "samples_per_s": 12.0, "tokens_per_s": 200.0},
            {"model": "smollm2", "pair": "flyroll hf", "system": "flyroll hf", "samples_per_s": 5.0, "tokens_per_s": 50.0},
            {"model": "smollm2", "pair": "flyroll hf", "system": trl, "error": "TRL process exited 1"}]
    out = with_ratios(rows)
    assert out[0]["samples_ratio"] == pytest.approx(3.0) and out[0]["tokens_ratio"] == pytest.approx(2.0)
    assert out[1]["samples_ratio"] == pytest.approx(1.0)
    assert out[2]["samples_ratio"] == pytest.approx(5.0) and out[2]["tokens_ratio"] == pytest.approx(3.0)  # its own TRL steps
    assert out[4]["samples_ratio"] is None  # TRL failed for this model: no ratio, not a crash
    assert ratio(1.0, 0.0) is None and ratio(None, 2.0) is None


def test_pair_ratios_are_per_alternated_step():
    trl = "TRL 1.16 GRPOTrainer"
    steps = lambda *secs: [{"s": s, "samples": 64, "tokens": 640} for s in secs]
    rows = [{"model": "smollm2", "pair": "flyroll hf", "system": "flyroll hf", "samples_per_s": 3.0, "tokens_per_s": 30.0,
             "per_step": steps(10.0, 20.0, 16.0)},
            {"model": "smollm2", "pair": "flyroll hf", "system": trl, "samples_per_s": 1.0, "tokens_per_s": 10.0,
             "per_step": steps(30.0, 50.0, 64.0)}]
    out = with_ratios(rows)
    assert out[0]["pair_ratios"] == pytest.approx([3.0, 2.5, 4.0])  # step i of flyroll against step i of TRL
    assert (out[0]["pair_ratio_median"], out[0]["pair_ratio_min"], out[0]["pair_ratio_max"]) == pytest.approx((3.0, 2.5, 4.0))
    assert "pair_ratios" not in out[1]  # the baseline has no ratio to itself
    rows[1].pop("per_step")
    assert "pair_ratios" not in with_ratios(rows)[0]  # no per-step timings: only the overall ratio


def _points():
    # stage -> {iteration: (timestamp at the stage's end, seconds)}; evaluation at 0 starts iteration 1,
    # evaluation after iteration 2 (ends at 125) starts iteration 3
    return {
        "evaluation": {0: (100.0, 5.0), 2: (125.0, 3.0)},
        "rollout": {1: (104.0, 3.0), 2: (114.0, 3.0), 3: (129.0, 2.0)},
        "scoring": {1: (105.0, 0.5), 2: (115.0, 0.5), 3: (130.0, 0.5)},
        "reference": {1: (107.0, 1.5), 2: (117.0, 1.5), 3: (132.0, 1.0)},
        "training": {1: (109.0, 2.0), 2: (120.0, 2.0), 3: (134.0, 1.5)},
        "weight_sync": {1: (110.0, 0.5), 2: (121.0, 0.5), 3: (135.0, 0.5)},
    }


def test_iteration_wall_and_orchestration_from_stage_end_times():
    its = iteration_breakdown(_points())
    assert [it["iteration"] for it in its] == [1, 2, 3]
    # iteration 1: 110 - 100 = 10 s wall; stages 3 + 0.5 + 1.5 + 2 + 0.5 = 7.5 s -> orchestration 2.5 s
    assert its[0]["wall_s"] == pytest.approx(10.0) and its[0]["orchestration_s"] == pytest.approx(2.5)
    # iteration 2: 121 - 110 = 11 s; stages 7.5 s -> 3.5 s
    assert its[1]["wall_s"] == pytest.approx(11.0) and its[1]["orchestration_s"] == pytest.approx(3.5)
    # iteration 3 starts after the evaluation (125), not after weight sync 2 (121): 135 - 125 = 10 s;
    # stages 2 + 0.5 + 1 + 1.5 + 0.5 = 5.5 s -> 4.5 s
    assert its[2]["wall_s"] == pytest.approx(10.0) and its[2]["orchestration_s"] == pytest.approx(4.5)


def test_incomplete_iterations_are_skipped():
    pts = _points()
    del pts["training"][2]
    pts["evaluation"] = {}  # no start for iteration 1
    assert [it["iteration"] for it in iteration_breakdown(pts)] == [3]


def test_mean_breakdown_shares_sum_to_one():
    its = iteration_breakdown(_points())[1:]
    m = mean_breakdown(its, samples=64)
    # mean wall (11 + 10) / 2 = 10.5 s; orchestration (3.5 + 4.5) / 2 = 4 s -> 38.1%; 64 / 10.5 = 6.1 samples/s
    assert m["wall_s"] == pytest.approx(10.5)
    assert m["orchestration_share"] == pytest.approx(4.0 / 10.5)
    assert m["samples_per_s"] == pytest.approx(64 / 10.5)
    shares = [v for k, v in m.items() if k.endswith("_share")]
    assert len(shares) == 6 and sum(shares) == pytest.approx(1.0)


def _mode_points(ray_starts: dict[str, dict[int, float]]):
    # two iterations, the same stage ends and seconds in every mode; only the Ray start points differ
    pts = {k: v for k, v in _points().items() if k != "evaluation"}
    pts = {s: {i: p for i, p in v.items() if i <= 2} for s, v in pts.items()} | {"evaluation": {0: (100.0, 5.0)}}
    return pts | {f"{s}_ray_start": {i: (0.0, v) for i, v in by_it.items()} for s, by_it in ray_starts.items()}


def test_modes_side_by_side_count_a_fused_cluster_once():
    stages = ("rollout", "scoring", "reference", "training", "weight_sync")
    per_task = {s: {1: 0.4 + k / 10, 2: 0.3 + k / 10} for k, s in enumerate(stages)}  # a cluster per stage task
    fused = {s: {1: 1.2, 2: 1.2} for s in stages}  # one cluster for the chunk: every stage logs its start
    results = [{"model": "tiny", "engine": "hf", "mode": m, "per_iteration": iteration_breakdown(_mode_points(r))}
               for m, r in (("shared", {}), ("per-task", per_task), ("fused", fused))]
    results.append({"model": "tiny", "engine": "hf", "mode": "fused", "error": "pyflyte exited 1"})
    rows = {(r["mode"], r.get("iterations")): r for r in mode_rows(results)}
    # the same stage points in every mode: wall 10 / 11 s, compute 7.5 s, orchestration 2.5 / 3.5 s
    for mode in ("shared", "per-task", "fused"):
        assert rows[mode, "1"]["wall_s"] == pytest.approx(10.0) and rows[mode, "2"]["wall_s"] == pytest.approx(11.0)
        assert rows[mode, "1-2"]["compute_s"] == pytest.approx(7.5)
        assert rows[mode, "1-2"]["orchestration_s"] == pytest.approx(3.0)
    assert rows["shared", "1"]["ray_start_s"] == 0.0 and rows["shared", "2"]["other_s"] == pytest.approx(3.5)
    # per-task: five clusters an iteration, 0.4 + 0.5 + ... + 0.8 = 3.0 s, then 0.3 + ... + 0.7 = 2.5 s
    assert rows["per-task", "1"]["ray_start_s"] == pytest.approx(3.0)
    assert rows["per-task", "2"]["ray_start_s"] == pytest.approx(2.5)
    assert rows["per-task", "2"]["other_s"] == pytest.approx(1.0)
    assert rows["per-task", "1-2"]["ray_start_s"] == pytest.approx(2.75)
    # fused: one 1.2 s start, on iteration 1's clock (not 5 x 1.2, not again in iteration 2); 0.6 s spread over 2
    assert rows["fused", "1"]["ray_start_s"] == pytest.approx(1.2)
    assert rows["fused", "1"]["other_s"] == pytest.approx(2.5 - 1.2)
    assert rows["fused", "2"]["ray_start_s"] == 0.0
    assert rows["fused", "1-2"]["ray_start_s"] == pytest.approx(0.6)
    assert rows["fused", None]["error"] == "pyflyte exited 1"
    assert len(rows) == 10


def test_pipeline_modes_are_checked():
    assert parse_args(["--pipeline", "2"]).pipeline_modes == "shared,per-task,fused"
    assert parse_args(["--modes", "fused"]).pipeline_modes == "fused"
    assert parse_args(["--modes", "fused,async"]).pipeline_modes == "fused,async"
    assert parse_args(["--modes", "fused,fused-live"]).pipeline_modes == "fused,fused-live"
    assert parse_args(["--modes", "fused-live,fused-live-lean"]).pipeline_modes == "fused-live,fused-live-lean"
    with pytest.raises(SystemExit) as e:
        parse_args(["--modes", "shared,ray"])
    assert e.value.code == 2


def test_pipeline_as_step_config_matches_the_bench_step():
    """--pipeline-as-step: the workflow's config at the step's settings -- no KL, the step's reward
    routed to both synthetic domains (and importable, as the config check asks), and in the
    cluster-shaped modes every engine actor reserving --threads CPUs (its thread cap); the schema
    accepts it. Without the flag: the preset's KL and the domains' own rewards."""
    from benchmarks.bench_pipeline import pipeline_config
    from configs.overrides import check_functions
    from configs.schema import FlyrollConfig
    from infra.resources import actor_options_for

    args = parse_args(["--pipeline", "3", "--pipeline-as-step", "--threads", "2", "--reward", "exact"])
    fused = FlyrollConfig.model_validate(pipeline_config("smollm2", "/m", True, "hf", args, "/tmp/o", "fused-live"))
    assert fused.algorithm.kl_coef == 0.0 and fused.sync.method == "live"
    assert dict(fused.reward.functions) == {"arithmetic": "benchmarks.bench_reward:exact_reward",
                                            "reverse": "benchmarks.bench_reward:exact_reward"}
    assert check_functions(fused) == []
    assert [actor_options_for(fused, r, False)["num_cpus"] for r in ("actor_train", "actor_infer", "reference")] == [2.0] * 3
    shared = FlyrollConfig.model_validate(pipeline_config("smollm2", "/m", True, "hf", args, "/tmp/o", "shared"))
    assert shared.placement.actor_train.cpu is None  # a shared local run reserves no CPUs: no cap
    plain = FlyrollConfig.model_validate(pipeline_config("smollm2", "/m", True, "hf", parse_args(["--pipeline", "3"]),
                                                         "/tmp/o", "fused"))
    assert plain.algorithm.kl_coef == 0.001 and not plain.reward.functions and plain.placement.actor_train.cpu is None

    from benchmarks.bench_reward import exact_reward, shaped_reward

    assert shaped_reward("it is 11.", {"answer": 11}) == 0.5 and exact_reward("11", {"answer": "11"}) == 1.0


def test_gpu_mfu_smoke_runs_on_cpu(capsys):
    import torch

    from benchmarks import gpu_mfu

    torch.set_num_threads(1)
    assert gpu_mfu.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert "train: flyroll GRPO step" in out and "generate: HF engine" in out
    if not torch.cuda.is_available():
        assert gpu_mfu.main([]) == 2  # the full run needs CUDA and says so
        assert "needs a CUDA GPU" in capsys.readouterr().err


def test_box_probe_measures_this_machine(capsys):
    """The real probe (benchmarks/box_probe.py, as `flyroll bench` runs it): numbers a person can
    compare across runs, and a line that says what they are."""
    from benchmarks.harness import box_probe

    p = box_probe(1, "start")
    assert p is not None, capsys.readouterr().out
    assert p["gemm_gflops"] > 0 and p["copy_gbps"] > 0 and p["threads"] == 1
    assert p["fault_s_per_gib"] > 0  # first touches of a fresh mapping cost more than rewriting it
    line = capsys.readouterr().out
    assert line.startswith("box (start): GEMM ") and "page faults" in line


def test_box_probe_failure_is_reported_not_fatal(tmp_path, monkeypatch, capsys):
    import benchmarks.harness as bench

    (tmp_path / "box_probe.py").write_text("import sys\nsys.exit('no numpy here')\n")
    monkeypatch.setattr(bench, "BENCH_DIR", tmp_path)
    assert bench.box_probe(2, "end") is None
    assert "box probe (end) failed: no numpy here" in capsys.readouterr().out
    (tmp_path / "box_probe.py").write_text("import json\nprint(json.dumps({'gemm_gflops': 1.0}))\n")  # no line for people
    assert bench.box_probe(2, "end") == {"gemm_gflops": 1.0}
    assert "box (end): (the probe printed no summary line)" in capsys.readouterr().out


def test_rollout_side_config_merges_sections_without_touching_the_preset():
    """benchmarks/rollout_sides.py: a side is the preset with its sections' fields replaced; the
    preset's other fields and the parsed preset itself stay as they were."""
    from benchmarks.rollout_sides import side_config

    raw = {"run": {"name": "x", "seed": 3}, "rollout": {"max_new_tokens": 16, "temperature": 1.0}}
    cfg = side_config(raw, "split-8", {"rollout": {"max_new_tokens": 128, "partial_rollout_max_split": 8},
                                       "algorithm": {"tis_cap": 2.0}},
                      prefix="partial-bench", out="/tmp/o", iterations=3, threads=2)
    assert cfg["run"] == {"name": "partial-bench-split-8", "seed": 3, "output_dir": "/tmp/o", "torch_threads": 2}
    assert cfg["rollout"] == {"max_new_tokens": 128, "temperature": 1.0, "partial_rollout_max_split": 8}
    assert cfg["algorithm"] == {"tis_cap": 2.0} and cfg["loop"] == {"iterations": 3}
    assert raw == {"run": {"name": "x", "seed": 3}, "rollout": {"max_new_tokens": 16, "temperature": 1.0}}
    assert "torch_threads" not in side_config(raw, "whole", {}, prefix="p", out="/o", iterations=0, threads=0)["run"]
