"""benchmarks/bench_sft.py's measurement: the peak memory it reports is the child's, sampled while it runs."""

from __future__ import annotations

import sys

from benchmarks.bench_sft import run_measured


def test_run_measured_reports_a_childs_peak_memory_and_exit_code(tmp_path):
    code = "import time; x = bytearray(400 * 2**20); x[::4096] = b'1' * len(x[::4096]); time.sleep(1.5)"
    res = run_measured([sys.executable, "-c", code], {}, str(tmp_path / "log"), cwd=str(tmp_path))
    assert res["rc"] == 0 and res["wall_s"] >= 1.5
    assert 0.38 <= res["peak_rss_gb"] < 1.5, res      # the 400 MiB it touched, plus the interpreter
    fail = run_measured([sys.executable, "-c", "import sys; sys.exit(3)"], {}, str(tmp_path / "log2"), cwd=str(tmp_path))
    assert fail["rc"] == 3
