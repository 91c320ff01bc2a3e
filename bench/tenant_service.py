#!/usr/bin/env python
"""Fairness between tenants inside a class, measured as VTC measures it.

VTC (Sheng et al., "Fairness in Serving Large Language Models", OSDI 2024) bounds the service two
continuously backlogged clients receive: over any interval in which both are backlogged, the
weighted tokens each was served differ by at most 2U, U = max(w_p * L_input, w_q * M), with
L_input the longest prompt and M the most tokens a running batch can hold; and a client that is
not backlogged never gets more than a backlogged one by more than that. This script measures our
scheduler the same way: the real scheduler (services/scheduler: tenant fair queueing inside a
class, tenant_queue.py) over a simulated worker in virtual time (bench/sim/virtual_pool.py), every
request of one class (Medium), tenants with different prompt and output lengths.

Service: tokens computed for a tenant's requests, prompt and output alike (w_p = w_q = 1: what
our tenant shares count), counted when a step is planned. Backlogged: the tenant has a request
waiting in the class's queue at the start of a step. Per scenario:

  max_service_diff  the largest difference over the run, for every pair of tenants f and g: over
                    every interval in which both were backlogged, |W_f - W_g|; over every interval
                    in which f was backlogged, W_g - W_f
  vtc_bound         2 * max(L_input, M); M = the tokens the class may hold (its KV cap of the pool),
                    or max_running full requests if fewer
  jain_index        Jain's index of the service received by the tenants backlogged through each
                    10-second window, averaged over the windows (1.0: equal shares)

Scenarios: two and eight tenants, all backlogged from the start, and on/off (some backlogged, the
others arriving in bursts with idle spells between). Each also with tenant fairness off (one FIFO
for the class), the baseline, which the bound does not hold for.

    python bench/tenant_service.py --json bench/results/tenant_service.json [--plot docs/tenant-service.png]
"""
from __future__ import annotations

import sys
from itertools import permutations
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.harness import make_parser, write_json  # noqa: E402
from bench.sim.accelerators import Accelerator  # noqa: E402
from bench.sim.virtual_pool import VirtualPool  # noqa: E402
from bench.sim.workload import SimRequest  # noqa: E402
from services.common.priority import MEDIUM  # noqa: E402
from services.scheduler.policy import QoSSettings  # noqa: E402

# A pool whose memory binds: 4,096 blocks of 16 tokens, 32 running, 512 tokens a step; steps of
# this machine's engine shape (the virtual times only place the on/off bursts).
POOL = Accelerator("tenant-bench", "cpu", 11.0, 0.18, 0.0005, 65_536, 32, 512)
SERIES_POINTS = 120         # of each tenant's accumulated service, kept in the JSON for the plot
JAIN_WINDOW_S = 10.0        # Jain's index per window of virtual seconds (a step serves one tenant's chunk)
SHAPES = {"long-prompt": (2048, 32), "long-output": (64, 512), "even": (512, 256), "chat": (128, 64)}


def backlogged(tenants: dict[str, str], work: int) -> list[tuple[float, str, int, int]]:
    """Each tenant's requests all at time 0, tenant by tenant (the first floods first): as many of
    its shape as make `work` tokens, so that every tenant stays backlogged about as long."""
    out = []
    for tenant, shape in tenants.items():
        prompt, output = SHAPES[shape]
        out += [(0.0, tenant, prompt, output)] * max(1, round(work / (prompt + output)))
    return out


def bursts(tenant: str, shape: str, size: int, every_s: float, until_s: float, first_s: float):
    """`size` requests at once every `every_s` seconds from `first_s`: on, then idle."""
    out, t = [], first_s
    while t < until_s:
        out += [(t, tenant, *SHAPES[shape])] * size
        t += every_s
    return out


def scenarios() -> dict[str, list[tuple[float, str, int, int]]]:
    eight = {f"t{i}": shape for i, shape in enumerate(list(SHAPES) * 2)}
    return {
        "2 backlogged": backlogged({"a": "long-prompt", "b": "long-output"}, 200_000),
        "8 backlogged": backlogged(eight, 40_000),
        "2 on/off": backlogged({"a": "long-prompt"}, 300_000) + bursts("b", "long-output", 40, 40.0, 160.0, 5.0),
        "8 on/off": backlogged({k: v for k, v in eight.items() if k < "t4"}, 60_000)
        + [r for i, k in enumerate(("t4", "t5", "t6", "t7"))
           for r in bursts(k, eight[k], 10 + 10 * i, 20.0 + 10 * i, 150.0, 3.0 * i)],
    }


class ServiceLog:
    """Each tenant's accumulated service and whether it was backlogged, at every step."""

    def __init__(self, tenant_of: dict[int, str], tenants: list[str]):
        self.tenant_of, self.tenants = tenant_of, tenants
        self.total = dict.fromkeys(tenants, 0)
        self.times: list[float] = []
        self.service: list[tuple[int, ...]] = []       # accumulated, per tenant, before each step
        self.backlog: list[frozenset[str]] = []
        self.pool: VirtualPool | None = None

    def end(self, now: float) -> None:
        """The totals after the last step (nobody waits any more)."""
        self.times.append(now)
        self.service.append(tuple(self.total[t] for t in self.tenants))
        self.backlog.append(frozenset())

    def on_step(self, plans: dict, now: float) -> None:
        waiting = frozenset(r.tenant for r in self.pool.batcher.policy.queue(MEDIUM))
        self.times.append(now)
        self.service.append(tuple(self.total[t] for t in self.tenants))
        self.backlog.append(waiting)
        for builder in plans.values():
            for seq_id, tokens in zip(builder.plan.scheduled_seq_ids, builder.plan.scheduled_num_tokens):
                self.total[self.tenant_of[seq_id]] += tokens


def max_service_diff(log: ServiceLog) -> int:
    """For every ordered pair (f, g): the most W_g - W_f grew over an interval in which f was
    backlogged (service read at step boundaries). Both orders cover |W_f - W_g| wherever both were."""
    worst = 0
    for f, g in permutations(range(len(log.tenants)), 2):
        tenant, low = log.tenants[f], None
        for service, waiting in zip(log.service, log.backlog):
            diff = service[g] - service[f]
            if low is not None:              # the step before this boundary was in f's run
                worst = max(worst, diff - low)
                low = min(low, diff)
            if tenant in waiting:
                low = diff if low is None else low
            else:
                low = None
    return worst


def jain(log: ServiceLog, window_s: float = JAIN_WINDOW_S) -> float:
    """Jain's index of the service the tenants backlogged through a window received in it, over
    consecutive windows, weighted by their length (windows with fewer than two such tenants skipped)."""
    weighted = total = 0.0
    k = 0
    while k < len(log.times) - 1:
        end = k
        while end < len(log.times) - 1 and log.times[end] - log.times[k] < window_s:
            end += 1
        both = [i for i, t in enumerate(log.tenants) if all(t in log.backlog[j] for j in range(k, end))]
        if len(both) >= 2:
            served = [log.service[end][i] - log.service[k][i] for i in both]
            if any(served):
                length = log.times[end] - log.times[k]
                weighted += length * sum(served) ** 2 / (len(served) * sum(x * x for x in served))
                total += length
        k = end
    return weighted / total if total else float("nan")


def vtc_bound(requests, pool: Accelerator, cap: float) -> int:
    longest_prompt = max(prompt for _, _, prompt, _ in requests)
    longest_request = max(prompt + output for _, _, prompt, output in requests)
    memory = min(int(cap * pool.kv_tokens), pool.max_running * longest_request)
    return 2 * max(longest_prompt, memory)


def run(requests, fair: bool) -> tuple[ServiceLog, VirtualPool]:
    ordered = sorted(enumerate(requests), key=lambda item: (item[1][0], item[0]))
    sims = [SimRequest(i, at, MEDIUM, prompt, output, tenant=tenant)
            for i, (_, (at, tenant, prompt, output)) in enumerate(ordered)]
    tenants = sorted({tenant for _, tenant, _, _ in requests})
    log = ServiceLog({r.request_id + 1: r.tenant for r in sims}, tenants)
    pool = VirtualPool(POOL, "qos", QoSSettings(tenant_fairness=fair), on_step=log.on_step)
    log.pool = pool
    log.end(pool.run(sims))
    return log, pool


def measure(name: str, requests) -> dict:
    cap = QoSSettings().kv_caps[MEDIUM]
    out = {"tenants": len({t for _, t, _, _ in requests}), "requests": len(requests),
           "vtc_bound": vtc_bound(requests, POOL, cap)}
    for label, fair in (("fair", True), ("fifo", False)):
        log, pool = run(requests, fair)
        diff = max_service_diff(log)
        out[label] = {"max_service_diff": diff, "jain_index": jain(log), "within_bound": diff <= out["vtc_bound"],
                      "steps": len(log.times), "virtual_s": log.times[-1] if log.times else 0.0,
                      "service": dict(log.total)}
        stride = max(1, len(log.times) // SERIES_POINTS)        # for the plot: enough to see the shares
        out[label]["series"] = {"t": [round(t, 2) for t in log.times[::stride]],
                                "service": [list(s) for s in log.service[::stride]], "tenants": log.tenants}
    return out


def plot(report: dict, path: Path) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    names = list(report["scenarios"])
    fig, axes = plt.subplots(2, len(names), figsize=(4.2 * len(names), 6.5), sharex="col")
    for col, name in enumerate(names):
        for row, label in enumerate(("fair", "fifo")):
            ax = axes[row][col]
            series = report["scenarios"][name][label]["series"]
            for i, tenant in enumerate(series["tenants"]):
                ax.plot(series["t"], [s[i] / 1000 for s in series["service"]], label=tenant, lw=1.2)
            ax.set_title(f"{name}, {'tenant fairness' if label == 'fair' else 'one FIFO'}", fontsize=9)
            ax.set_ylabel("service (k tokens)" if col == 0 else "")
            ax.grid(alpha=0.3)
            if row == 1:
                ax.set_xlabel("virtual seconds")
        axes[0][col].legend(fontsize=7, ncol=2)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")


def main() -> None:
    parser = make_parser(__doc__)
    parser.add_argument("--plot", type=Path, help="accumulated service per tenant over time (PNG)")
    args = parser.parse_args()
    report: dict = {"pool": {"kv_tokens": POOL.kv_tokens, "max_running": POOL.max_running,
                             "max_step_tokens": POOL.max_step_tokens}, "shapes": SHAPES, "scenarios": {}}
    print(f"{'scenario':<14}{'tenants':>8}{'VTC bound':>11}{'max diff':>10}{'Jain':>7}{'within':>8}"
          f"{'FIFO diff':>11}{'FIFO Jain':>10}")
    for name, requests in scenarios().items():
        r = report["scenarios"][name] = measure(name, requests)
        print(f"{name:<14}{r['tenants']:>8}{r['vtc_bound']:>11,}{r['fair']['max_service_diff']:>10,}"
              f"{r['fair']['jain_index']:>7.3f}{'yes' if r['fair']['within_bound'] else 'NO':>8}"
              f"{r['fifo']['max_service_diff']:>11,}{r['fifo']['jain_index']:>10.3f}")
    fair = [s["fair"] for s in report["scenarios"].values()]
    report.update(max_service_diff=max(s["max_service_diff"] for s in fair),
                  vtc_bound=min(s["vtc_bound"] for s in report["scenarios"].values()),
                  jain_index=min(s["jain_index"] for s in fair),
                  within_bound=all(s["within_bound"] for s in fair))
    print(f"\nworst over the scenarios: max service difference {report['max_service_diff']:,} tokens, "
          f"smallest VTC bound {report['vtc_bound']:,}, lowest Jain's index {report['jain_index']:.3f}: "
          f"{'within the bound everywhere' if report['within_bound'] else 'NOT within the bound'}")
    if args.plot:
        plot(report, args.plot)
    write_json(args.json, report)


if __name__ == "__main__":
    main()
