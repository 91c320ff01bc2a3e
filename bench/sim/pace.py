"""The pace of a real machine over a run, for replaying that run in the simulator.

A real run's step times are not the step-time fit's: on this 2-core machine the same step takes
30% more or less from one half-minute to the next (a cold start, the other pool's worker and the
client competing for the cores, whatever else runs). The fit gives the mean; the pace gives, per
window of the run, how much slower or faster than the fit the pools' steps actually ran:

    pace(window) = sum of the step seconds measured in it / sum of what the fit predicts for them

computed from the cumulative counters every pool's stats carry (step_seconds, worker_steps,
step_tokens, step_kv_tokens), sampled by bench/cost_report.py. The simulator multiplies its step
times by the pace of the window the step starts in: it replays the machine's speed, and still
predicts the queueing, the scheduling and the routing.
"""
from __future__ import annotations

WINDOW_S = 5.0
MIN_STEPS = 5                 # a window with fewer measured steps keeps the pace before it


class MachinePace:
    def __init__(self, factors: list[float], window_s: float = WINDOW_S):
        self.factors = factors or [1.0]
        self.window_s = window_s

    def __call__(self, t: float) -> float:
        index = min(max(int(t / self.window_s), 0), len(self.factors) - 1)
        return self.factors[index]

    @classmethod
    def measured(cls, samples: dict[str, list], fits: dict[str, dict], window_s: float = WINDOW_S) -> MachinePace:
        """samples: pool -> [[t_s, step_seconds, worker_steps, step_tokens, step_kv_tokens(, cut_ins)], ...]
        (cumulative counters, as reported); fits: pool -> {fixed_ms, ms_per_token, ms_per_kv_token}.
        All pools of the run share one pace: they share the machine."""
        actual: dict[int, float] = {}
        predicted: dict[int, float] = {}
        steps: dict[int, int] = {}
        for pool, series in samples.items():
            fit = fits.get(pool)
            if fit is None:
                continue
            for before, after in zip(series, series[1:]):
                d_steps = after[2] - before[2]
                if d_steps <= 0:
                    continue
                window = int(after[0] / window_s)
                actual[window] = actual.get(window, 0.0) + (after[1] - before[1]) * 1000
                predicted[window] = predicted.get(window, 0.0) + (
                    fit["fixed_ms"] * d_steps + fit["ms_per_token"] * (after[3] - before[3])
                    + fit["ms_per_kv_token"] * (after[4] - before[4]))
                steps[window] = steps.get(window, 0) + d_steps
        factors, last = [], 1.0
        for window in range(max(actual, default=-1) + 1):
            if steps.get(window, 0) >= MIN_STEPS and predicted[window] > 0:
                last = actual[window] / predicted[window]
            factors.append(last)
        return cls(factors, window_s)

    def spread(self) -> tuple[float, float, float]:
        """(lowest, median, highest) pace over the windows."""
        ordered = sorted(self.factors)
        return ordered[0], ordered[len(ordered) // 2], ordered[-1]
