"""The simulator against reality: predict a real bench/cost_report.py run and compare.

The run's two pools are simulated on the step-time fits measured in that run (this machine's CPU
worker on SmolLM2), its requests arrive at their times with their lengths, each routing mode goes
through the real router, and the pools are scheduled by the real scheduler (step-level pools).
Compared per mode: total cost units and P99 TTFT per class (the bar), P50s and the scheduler-side
P99s as well. Three predictions side by side:

- "simulated": at the machine's pace measured in the run (bench/sim/pace.py), routed by the
  simulator's own router: the prediction judged;
- "real routes": the same, each request sent where the real router sent it: the pools' model
  alone, without the routing decisions that went the other way;
- "mean pace": routed by the simulator, every step at the fit's mean (the step model alone).

Two things the real router saw are given to the simulated one as they were: the prompt length
it routed by (its estimate from the text, about a quarter of the tokens the chat template makes
here) and each request's time outside the pools (client TTFT - scheduler TTFT: client, router,
gRPC hops, tokenizing), which the simulator does not model; it is added to the request's
simulated TTFT and so to what the router learns its margins from (actual / predicted).

Next to each real P99, the interval it would move within from sampling alone
(bench/harness.py bootstrap_interval); `repeat` compares two real runs of the same workload,
which is the floor any prediction can reach.
"""
from __future__ import annotations

import json
from pathlib import Path
from statistics import median

from bench.harness import bootstrap_interval, quantile
from bench.sim.accelerators import local_cpu
from bench.sim.cluster import PoolPlan, SimCluster
from bench.sim.pace import MachinePace
from bench.sim.workload import SimRequest
from services.common.priority import parse_priority

CLASSES = ("high", "medium", "low")
TOLERANCE = 0.20          # cost and P99 TTFT per class within 20% of the real run
VARIANTS = (("simulated", True, False), ("real routes", True, True), ("mean pace", False, False))
# The scheduler's TTFT split where the run recorded it: queued (until a step or cut-in first computed
# the request) and computing (from then to its first token). Not judged: where a P99 misses, which.
SPLIT_ROWS = ((0.5, "scheduler_queue_ms", "P50 queued", False), (0.5, "compute_ms", "P50 computing", False))
REAL_VALUES = {"ttft_ms": lambda r: r["ttft_ms"], "scheduler_ttft_ms": lambda r: r["scheduler_ttft_ms"],
               "scheduler_queue_ms": lambda r: r["scheduler_queue_ms"],
               "compute_ms": lambda r: r["scheduler_ttft_ms"] - r["scheduler_queue_ms"]}
SIM_VALUES = {"ttft_ms": lambda s: s.ttft_ms, "scheduler_ttft_ms": lambda s: s.pool_ttft_ms,
              "scheduler_queue_ms": lambda s: s.pool_queue_ms,
              "compute_ms": lambda s: s.pool_ttft_ms - s.pool_queue_ms}


def simulate_run(real: dict, mode: str, done: list[dict], pace: MachinePace | None,
                 real_routes: bool) -> tuple[list[SimRequest], float, dict]:
    """The run's completed requests (`done`, by arrival) simulated: their simulated twins, the
    simulated cost units, the simulated router's margin per pool at the end, each pool's figures (pool_figures)."""
    fits = real["modes"][mode]["step_fits"]
    plans = []
    for name, cost in real["pools"].items():
        fit = fits.get(name) or next(iter(fits.values()))     # an unused pool: same hardware here
        accelerator = local_cpu(fit["fixed_ms"], fit["ms_per_token"], fit["ms_per_kv_token"],
                                fit["kv_tokens"] or 64_000, real["max_running"], real["max_step_tokens"])
        plans.append(PoolPlan(name, accelerator, cost, primary=name == real["primary"], pace=pace))
    requests = [SimRequest(i, r["arrival_s"], parse_priority(r["priority"]), r["prompt_tokens"], r["output_tokens"],
                           pool=r["pool"] if real_routes else "", routed_prompt_tokens=r["routed_prompt_tokens"],
                           outside_ms=r["ttft_ms"] - r["scheduler_ttft_ms"], cached_tokens=r.get("cached_tokens", 0),
                           prompt_ids=r.get("prompt_ids"))
                for i, r in enumerate(done)]
    cluster = SimCluster(plans, mode, pool_kind="step", prefix_caching=all(r.prompt_ids for r in requests))
    result = cluster.run(requests, max(r.arrival for r in requests) + 1, label=f"replay {mode}")
    pools = {pool.name: pool_figures(pool.steps, pool.step_seconds, pool.step_tokens, pool.step_kv_tokens,
                                     pool.cut_in_steps) for pool in cluster.pools}
    return requests, result.cost_units, {name: m.margin for name, m in cluster.router.models.items()}, pools


def pool_figures(steps: int, seconds: float, tokens: int, kv_tokens: int, cut_ins: int | None) -> dict:
    """A pool over a run: its steps, and per step the time, tokens computed and KV tokens held."""
    per = max(steps, 1)
    return {"steps": steps, "ms_per_step": seconds * 1000 / per, "tokens_per_step": tokens / per,
            "kv_tokens_per_step": kv_tokens / per, "cut_ins": cut_ins}


def with_routed_prompts(real: dict, records: list[dict]) -> list[dict]:
    """The records, each with the prompt length the real router routed by. Runs recorded before
    cost_report kept it: the same workload made again from its seed (records are in its order)."""
    if all("routed_prompt_tokens" in r for r in records):
        return records
    from bench.cost_report import workload  # grpc and the cluster: only when needed
    from services.control.limits import estimated_prompt_tokens
    from services.tools.client import chat_request
    prompts = workload(real["requests"], real["rate"], real["seed"])
    if any(abs(r["arrival_s"] - at) > 1e-6 for r, (at, _, _) in zip(records, prompts)):
        raise SystemExit("the run's requests are not its seed's workload: cannot tell the routed prompt lengths")
    return [{**r, "routed_prompt_tokens": estimated_prompt_tokens(chat_request(prompt))}
            for r, (_, _, prompt) in zip(records, prompts, strict=True)]


def with_prompt_ids(real: dict, records: list[dict]) -> list[dict]:
    """The records, each with its prompt's token ids as the scheduler made them (the model's chat
    template and tokenizer on the seed's workload), so that the simulated pools' prefix caches share
    what the real ones shared: the blocks a cached prefix holds count in the KV each step reads (the
    step-time fit's KV term was measured on them). A record whose ids come out another length than it
    reported keeps none: the whole run is then replayed with cached tokens counted instead."""
    from bench.cost_report import workload
    from services.common.tokenizer import TextTokenizer
    from services.engine.default_model import default_model_dir
    tokenizer = TextTokenizer.from_model_dir(default_model_dir())
    ids = {}
    for at, _, prompt in workload(real["requests"], real["rate"], real["seed"]):
        ids[round(at, 6)] = tokenizer.encode_chat([{"role": "user", "content": prompt}])
    out = [{**r, "prompt_ids": ids.get(round(r["arrival_s"], 6))} for r in records]
    if any(r["prompt_ids"] is None or len(r["prompt_ids"]) != r["prompt_tokens"] for r in out):
        print("the run's prompts do not tokenize to the lengths it recorded: replayed with cached tokens counted")
        return records
    return out


def _pct(a: float, b: float) -> float:
    return a / b - 1 if b else 0.0


def replay(path: Path) -> dict:
    """Print and return, per routing mode of the run in `path`, real vs the three predictions."""
    real = json.loads(path.read_text())
    out: dict = {"source": str(path)}
    worst = dict.fromkeys((v for v, _, _ in VARIANTS), 0.0)
    print(f"\nsimulator vs the real run in {path} ({real['requests']} requests at {real['rate']:g}/s)\n")
    header = "".join(f"{v:>13}{'diff':>8}" for v, _, _ in VARIANTS)
    print(f"{'':<10}{'':<22}{'real':>9}{header}{'real, resampled 90%':>22}")
    for mode, run in real["modes"].items():
        if not run["step_fits"]:
            raise SystemExit(f"mode {mode} has no step-time fit (no pool computed a step)")
        done = sorted((r for r in with_prompt_ids(real, with_routed_prompts(real, run["requests"])) if r["ok"]),
                      key=lambda r: r["arrival_s"])
        pace = MachinePace.measured(run["pace_samples"], run["step_fits"]) if run.get("pace_samples") else None
        sims = {v: simulate_run(real, mode, done, pace if paced else None, routes) for v, paced, routes in VARIANTS}
        outside = median([r["ttft_ms"] - r["scheduler_ttft_ms"] for r in done])
        out[mode] = {"outside_pool_ms_median": outside}
        if pace is not None:
            low, mid, high = pace.spread()
            out[mode]["pace"] = {"lowest": low, "median": mid, "highest": high}
            print(f"{mode:<10}machine pace (measured / fitted step time, 5 s windows) {low:.2f} .. {mid:.2f} .. "
                  f"{high:.2f}; {outside:.0f} ms outside the pools (median)")
        if run.get("router_margins"):
            real_end = run["router_margins"][-1][1]
            simulated_end = sims["simulated"][2]
            out[mode]["router_margins"] = {"real_at_end": real_end, "simulated_at_end": simulated_end}
            print(f"{mode:<10}router margins at the end, real / simulated: " + ", ".join(
                f"{pool} {real_end.get(pool, float('nan')):.2f} / {simulated_end.get(pool, float('nan')):.2f}"
                for pool in real["pools"]))
        # Each pool as a whole, real (its stats' counters at the end) and simulated: does the pool
        # model run as many steps, as long, holding as much? (Cut-ins: runs since cost_report kept them.)
        out[mode]["pools"] = {}
        for pool, series in (run.get("pace_samples") or {}).items():
            if not series or not series[-1][2]:
                continue
            _, seconds, steps, tokens, kv_tokens, *cut_ins = series[-1]
            real_pool = pool_figures(steps, seconds, tokens, kv_tokens, cut_ins[0] if cut_ins else None)
            sim_pool = sims["simulated"][3][pool]
            out[mode]["pools"][pool] = {"real": real_pool, "simulated": sim_pool}
            print(f"{mode:<10}pool {pool}, real / simulated: {steps} / {sim_pool['steps']} steps; a step "
                  + ", ".join(f"{real_pool[k]:.1f} / {sim_pool[k]:.1f} {unit}" for k, unit in
                              (("ms_per_step", "ms"), ("tokens_per_step", "tokens"), ("kv_tokens_per_step", "KV tokens")))
                  + (f"; cut-ins {cut_ins[0]} / {sim_pool['cut_ins']}" if cut_ins else ""))
        rows = [("cost units", run["total_cost_units"], {v: s[1] for v, s in sims.items()}, None, True)]
        for q, key, name, judged in ((0.99, "ttft_ms", "P99 TTFT", True), (0.5, "ttft_ms", "P50 TTFT", False),
                                     (0.99, "scheduler_ttft_ms", "P99 sched.", False), *SPLIT_ROWS):
            if (q, key, name, judged) in SPLIT_ROWS and any(r.get("scheduler_queue_ms") is None for r in done):
                continue                        # a run recorded before cost_report kept queue times
            for c in CLASSES:
                mine = [i for i, r in enumerate(done) if r["priority"] == c]
                values = [REAL_VALUES[key](done[i]) for i in mine]
                predicted = {v: quantile([SIM_VALUES[key](s[0][i]) for i in mine], q) for v, s in sims.items()}
                interval = bootstrap_interval(values, q) if judged else None
                rows.append((f"{c} {name} ms", quantile(values, q), predicted, interval, judged))
        for label, measured, predicted, interval, judged in rows:
            cells = ""
            for v in predicted:
                diff = _pct(predicted[v], measured)
                if judged:
                    worst[v] = max(worst[v], abs(diff))
                cells += f"{predicted[v]:>13,.0f}{diff:>+8.0%}"
            spread = f"{interval[0]:,.0f} .. {interval[1]:,.0f}" if interval else ""
            print(f"{mode:<10}{label:<22}{measured:>9,.0f}{cells}{spread:>22}")
            out[mode][label] = {"real": measured, "real_resampled_90": interval,
                                **{v: {"predicted": p, "difference": _pct(p, measured)} for v, p in predicted.items()}}
    print(f"\nlargest difference on cost and P99 TTFT (tolerance {TOLERANCE:.0%}): "
          + ", ".join(f"{v} {w:.0%}" for v, w in worst.items())
          + f": the simulation {'agrees' if worst['simulated'] <= TOLERANCE else 'does NOT agree'}")
    out.update(worst_difference=worst["simulated"], worst_by_variant=worst, agree=worst["simulated"] <= TOLERANCE)
    return out


def repeat(first: Path, second: Path) -> dict:
    """Two real runs of the same workload (same seed): how far apart their cost and P99s are."""
    a, b = json.loads(first.read_text()), json.loads(second.read_text())
    print(f"\nreal vs real: {first} and {second}, the same workload run twice\n")
    print(f"{'':<10}{'':<22}{'first':>9}{'second':>9}{'diff':>8}")
    out, worst = {}, 0.0
    for mode in [m for m in a["modes"] if m in b["modes"]]:
        rows = [("cost units", a["modes"][mode]["total_cost_units"], b["modes"][mode]["total_cost_units"])]
        for c in CLASSES:
            key = f"{c}_p99_ttft_ms"
            rows.append((f"{c} P99 TTFT ms", a["modes"][mode][key], b["modes"][mode][key]))
        out[mode] = {}
        for label, x, y in rows:
            diff = _pct(y, x)
            worst = max(worst, abs(diff))
            print(f"{mode:<10}{label:<22}{x:>9,.0f}{y:>9,.0f}{diff:>+8.0%}")
            out[mode][label] = {"first": x, "second": y, "difference": diff}
    print(f"\nlargest difference between the two real runs: {worst:.0%}")
    out["worst_difference"] = worst
    return out
