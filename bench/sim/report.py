"""What bench/simulate.py prints and draws: the routing modes side by side, the JSON keys, and
the plot of cost and SLO attainment as load grows."""
from __future__ import annotations

from pathlib import Path

from bench.sim.cluster import SimResult

CLASSES = ("high", "medium", "low")


def table(results: dict[str, SimResult]) -> str:
    modes = list(results)
    width = max(18, *(len(m) + 2 for m in modes))
    lines = [f"{'':<30}" + "".join(f"{m:>{width}}" for m in modes)]

    def row(label, values, fmt):
        lines.append(f"{label:<30}" + "".join(f"{format(v, fmt):>{width}}" for v in values))

    row("requests", [r.requests for r in results.values()], "d")
    row("cost units", [r.cost_units for r in results.values()], ",.0f")
    base = results.get("primary")
    if base is not None and base.cost_units:
        row("cost vs primary", [r.cost_units / base.cost_units - 1 for r in results.values()], "+.1%")
    for c in CLASSES:
        row(f"{c} SLO attainment", [r.slo_attainment[c] for r in results.values()], ".2%")
    for c in CLASSES:
        row(f"{c} P50 / P99 TTFT ms", [f"{r.p50_ttft_ms[c]:,.0f} / {r.p99_ttft_ms[c]:,.0f}"
                                       for r in results.values()], "")
    for device in next(iter(results.values())).utilisation:
        row(f"{device}: utilisation / requests", [f"{r.utilisation[device]:.0%} / {r.served_share[device]:.0%}"
                                                   for r in results.values()], "")
    row("unfinished", [r.unfinished for r in results.values()], "d")
    row("preemptions", [r.preemptions for r in results.values()], "d")
    row("TTFT prediction |err| p50/p90", [f"{r.prediction_error_ms.get('p50', 0):,.0f}/"
                                          f"{r.prediction_error_ms.get('p90', 0):,.0f} ms" for r in results.values()], "")
    row("route() mean / p99 us", [f"{r.decision_us['mean']:.1f} / {r.decision_us['p99']:.1f}"
                                  for r in results.values()], "")
    row("wall s (simulated s)", [f"{r.wall_s:.0f} ({r.simulated_s:.0f})" for r in results.values()], "")
    return "\n".join(lines)


def headline(results: dict[str, SimResult]) -> dict:
    """The JSON keys: cost_{mode}, slo_attainment_{class}_{mode} (mode with _)."""
    out = {}
    for mode, r in results.items():
        key = mode.replace("-", "_")
        out[f"cost_{key}"] = r.cost_units
        for c in CLASSES:
            out[f"slo_attainment_{c}_{key}"] = r.slo_attainment[c]
            out[f"p99_ttft_ms_{c}_{key}"] = r.p99_ttft_ms[c]
    return out


def plot(curve: dict, path: Path, title: str) -> None:
    """Three panels, one colour per routing mode: cost per request vs load; SLO attainment per
    class vs load; and the trade-off itself, cost against the worst of High's and Medium's
    attainment, each point a load."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (cost_ax, slo_ax, trade_ax) = plt.subplots(1, 3, figsize=(15, 4.4))
    colours = dict(zip(curve, ("tab:blue", "tab:orange", "tab:green", "tab:red")))
    for mode, points in curve.items():
        loads = [p["load"] for p in points]
        colour = colours[mode]
        cost_ax.plot(loads, [p["cost_per_request"] for p in points], marker="o", color=colour, label=mode)
        for c, style in (("high", "-"), ("medium", "--"), ("low", ":")):
            slo_ax.plot(loads, [100 * p[f"slo_attainment_{c}"] for p in points], style, marker=".", color=colour,
                        label=f"{mode}, {c}")
        worst = [100 * min(p["slo_attainment_high"], p["slo_attainment_medium"]) for p in points]
        trade_ax.plot([p["cost_per_request"] for p in points], worst, marker="o", color=colour, label=mode)
        for p, y in zip(points, worst):
            trade_ax.annotate(f"{p['load']:g}x", (p["cost_per_request"], y), textcoords="offset points",
                              xytext=(4, 4), fontsize=7, color=colour)
    cost_ax.set(xlabel="load (x the base rate)", ylabel="cost units per request", title="cost as load grows")
    slo_ax.set(xlabel="load (x the base rate)", ylabel="requests within their TTFT SLO, %",
               title="SLO attainment (High 200 ms, Medium 2 s, Low 30 s)")
    trade_ax.set(xlabel="cost units per request", ylabel="High and Medium within SLO (the worse), %",
                 title="cost against SLO attainment (points: load)")
    cost_ax.legend()
    slo_ax.legend(fontsize=7, ncol=2)
    trade_ax.legend()
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")
