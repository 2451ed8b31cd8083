"""`flyroll bench --learning`'s evaluation of the checkpoints and its report (tables, plot).

The driver is benchmarks/bench_learning.py; its module docstring says what is compared.
"""

from __future__ import annotations

import time


def curve_svg(curves: dict[str, list[tuple[float, float]]], budget_s: float) -> str:
    """The accuracy-vs-wall-time curves as one SVG line plot (x: minutes, y: accuracy 0..max)."""
    W, H, L, R, T, B = 640, 320, 56, 110, 12, 36
    ymax = max([a for c in curves.values() for _, a in c] + [0.05]) * 1.1
    xmax = max(budget_s, 1.0)
    px = lambda t: L + (W - L - R) * t / xmax  # noqa: E731
    py = lambda a: H - B - (H - T - B) * a / ymax  # noqa: E731
    parts = [f'<svg viewBox="0 0 {W} {H}" xmlns="http://www.w3.org/2000/svg" font-size="11">',
             f'<line x1="{L}" y1="{H - B}" x2="{W - R}" y2="{H - B}" stroke="#888"/>',
             f'<line x1="{L}" y1="{T}" x2="{L}" y2="{H - B}" stroke="#888"/>']
    for i in range(5):
        a, t = ymax * i / 4, xmax * i / 4
        parts.append(f'<text x="{L - 6}" y="{py(a) + 4:.1f}" text-anchor="end">{a:.2f}</text>')
        parts.append(f'<text x="{px(t):.1f}" y="{H - B + 16}" text-anchor="middle">{t / 60:.1f}</text>')
    parts.append(f'<text x="{(L + W - R) / 2}" y="{H - 4}" text-anchor="middle">wall time (min from process start)</text>')
    for k, (system, curve) in enumerate(curves.items()):
        color = ("#1f77b4", "#d62728", "#2ca02c")[k % 3]
        pts = " ".join(f"{px(t):.1f},{py(a):.1f}" for t, a in sorted(curve))
        parts.append(f'<polyline points="{pts}" fill="none" stroke="{color}" stroke-width="2"/>')
        parts += [f'<circle cx="{px(t):.1f}" cy="{py(a):.1f}" r="3" fill="{color}"><title>{system} {t:.0f} s: {a:.3f}'
                  f'</title></circle>' for t, a in curve]
        parts.append(f'<text x="{W - R + 8}" y="{T + 14 + 16 * k}" fill="{color}">{system}</text>')
    return "\n".join(parts + ["</svg>"])


def evaluate_points(points: list[dict], table, cfg, threads: int, pass_k: int) -> None:
    """Adds "metrics" to each point (its "dir" a model directory): engines/rewards/evaluation.py `evaluate`
    on `table` with the config's max new tokens, chat template, reward routing and stop strings."""
    import inspect

    import torch

    from engines.rewards.evaluation import evaluate
    from engines.generation.engine import HFGenerationEngine
    from engines.models.modeling import load_policy

    torch.set_num_threads(threads)
    accepts = inspect.signature(evaluate).parameters
    extra = {"stop": tuple(cfg.rollout.stop)} if "stop" in accepts else {}
    if pass_k and "samples" in accepts:
        extra |= {"samples": pass_k, "temperature": cfg.rollout.temperature, "seed": cfg.run.seed}
    rw = cfg.reward
    for p in points:
        t0 = time.time()
        model, tok = load_policy(p["dir"])
        engine = HFGenerationEngine(model, tok, micro_batch=cfg.rollout.micro_batch)
        p["metrics"], _ = evaluate(engine, tok, table, max_new_tokens=cfg.rollout.max_new_tokens,
                                   apply_chat_template=cfg.model.apply_chat_template, reward=rw, **extra)
        p["eval_s"] = time.time() - t0
        print(f"  evaluated {p['system']} t={p['t']:.0f} s: accuracy {p['metrics']['accuracy']:.3f} ({p['eval_s']:.0f} s)", flush=True)
        del model, engine


def print_tables(curves: dict[str, list[dict]], levels: list[dict]) -> None:
    from rich.console import Console
    from rich.table import Table

    keys = sorted({k for pts in curves.values() for p in pts for k in p["metrics"]
                   if k.startswith("accuracy/") or k.startswith("pass_at_")})
    t = Table(title="accuracy vs wall time (seconds from process start; greedy accuracy on the eval split)")
    for col in ("system", "t s", "checkpoint", "accuracy", *keys):
        t.add_column(col, justify="left" if col == "system" else "right")
    for system, pts in curves.items():
        for p in pts:
            t.add_row(system, f"{p['t']:.0f}", str(p.get("version", p.get("step", "base"))), f"{p['metrics']['accuracy']:.3f}",
                      *(f"{p['metrics'][k]:.3f}" if k in p["metrics"] else "—" for k in keys))
    Console(width=max(160, 50 + sum(len(k) + 3 for k in keys))).print(t)
    if not levels:
        print("time to accuracy: no level above the base model's accuracy was reached by every system")
        return
    t = Table(title="time to reach an accuracy (first checkpoint at/above it; linearly interpolated) and TRL / flyroll")
    for col in ("accuracy", *(f"{s} first / interp s" for s in curves), "TRL/flyroll first", "TRL/flyroll interp"):
        t.add_column(col, justify="right")
    f = lambda x, spec=".0f": "—" if x is None else format(x, spec)  # noqa: E731
    for r in levels:
        t.add_row(f"{r['accuracy']:.3f}", *(f"{f(r[f'{s}_first_s'])} / {f(r[f'{s}_interp_s'])}" for s in curves),
                  f(r.get("ratio_first"), ".2f"), f(r.get("ratio_interp"), ".2f"))
    Console(width=200).print(t)


def report_html(result: dict, curves: dict[str, list[tuple[float, float]]]) -> str:
    """The report page: the curves as an SVG plot, the time -> accuracy table, the level table."""
    from html import escape

    rows = "".join(f"<tr><td>{escape(s)}</td><td>{p['t']:.0f}</td><td>{p['metrics']['accuracy']:.3f}</td></tr>"
                   for s, pts in result["curves"].items() for p in pts)
    lv = "".join(f"<tr><td>{r['accuracy']:.3f}</td>" + "".join(
        f"<td>{'—' if r.get(k) is None else format(r[k], '.2f')}</td>"
        for k in ("flyroll_interp_s", "TRL_interp_s", "ratio_interp")) + "</tr>" for r in result["levels"])
    s = result["settings"]
    return (f"<!doctype html><meta charset='utf-8'><title>flyroll bench --learning</title><body style='font-family:sans-serif'>"
            f"<h1>flyroll vs TRL: accuracy vs wall time</h1><p>config {escape(str(s['config']))}, budget {s['budget_min']} min "
            f"per system, {s['threads']} threads, generators {escape(str(s['generators'] or 'as in the config'))}</p>"
            f"{curve_svg(curves, s['budget_min'] * 60)}<h2>time → accuracy</h2><table border=1 cellpadding=3>"
            f"<tr><th>system</th><th>t s</th><th>accuracy</th></tr>{rows}</table><h2>time to reach an accuracy "
            f"(interpolated)</h2><table border=1 cellpadding=3><tr><th>accuracy</th><th>flyroll s</th><th>TRL s</th>"
            f"<th>TRL / flyroll</th></tr>{lv}</table></body>")
