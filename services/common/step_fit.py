"""A pool's step time as a function of what the step computes, fitted from measured steps:

    step_ms(tokens, kv) = fixed_ms + ms_per_token * tokens + ms_per_kv_token * kv

Used by the router's latency model (services/router/latency_model.py: kv = KV tokens held, from
the pools' stats).
"""
from __future__ import annotations

from dataclasses import dataclass, field

FADE = 0.9                  # weight left to older samples at each new one


@dataclass(slots=True)
class StepFit:
    """step_ms = fixed_ms + ms_per_token * tokens + ms_per_kv_token * KV tokens, by least squares
    over faded samples (each the mean over the steps between two reports). Coefficients stay
    >= 0: a term the samples cannot separate (every step the same size, or KV growing with the
    batch) is dropped and the others refitted; with one batch size only, a third of the step
    is taken as fixed (what the engine's profile shows at small batches) until other sizes come."""
    sums: list = field(default_factory=lambda: [[0.0] * 4 for _ in range(3)])  # X'WX | X'Wy, features 1, x, z
    fade: float = FADE                   # 1.0: every sample counts alike (a whole run's fit)
    fixed_ms: float = 0.0
    ms_per_token: float = 0.0
    ms_per_kv_token: float = 0.0
    solved: bool = True                  # the coefficients include every sample added

    @property
    def known(self) -> bool:
        return self.sums[0][0] > 0

    def add(self, tokens: float, kv_tokens: float, ms: float, weight: float) -> None:
        features, fade = (1.0, tokens, kv_tokens), self.fade
        for i, row in enumerate(self.sums):
            for j in range(3):
                row[j] = fade * row[j] + weight * features[i] * features[j]
            row[3] = fade * row[3] + weight * features[i] * ms
        self.solved = False

    def solve(self) -> None:
        """The coefficients from the samples so far (when asked: many reports, few predictions);
        nothing to do when no sample came since the last time."""
        if self.solved:
            return
        self.solved = True
        for terms in ((0, 1, 2), (0, 1), (0, 2)):
            solved = self._solve(terms)
            if solved is not None and all(c >= 0 for c in solved.values()):
                self.fixed_ms, self.ms_per_token, self.ms_per_kv_token = (solved.get(i, 0.0) for i in range(3))
                return
        mean_x, mean_y = self.sums[0][1] / self.sums[0][0], self.sums[0][3] / self.sums[0][0]
        self.fixed_ms, self.ms_per_kv_token = mean_y / 3, 0.0
        self.ms_per_token = (mean_y - self.fixed_ms) / max(mean_x, 1.0)

    def _solve(self, terms: tuple) -> dict | None:
        """Least squares on a subset of the features (Gaussian elimination); None if singular."""
        n = len(terms)
        rows = [[self.sums[i][j] for j in terms] + [self.sums[i][3]] for i in terms]
        for col in range(n):
            pivot = max(range(col, n), key=lambda r: abs(rows[r][col]))
            scale = max(abs(rows[r][col]) for r in range(n)) or 1.0
            if abs(rows[pivot][col]) < 1e-9 * scale:
                return None
            rows[col], rows[pivot] = rows[pivot], rows[col]
            for r in range(n):
                if r != col:
                    f = rows[r][col] / rows[col][col]
                    rows[r] = [a - f * b for a, b in zip(rows[r], rows[col])]
        return {t: rows[k][n] / rows[k][k] for k, t in enumerate(terms)}

    def step_ms(self, tokens: float, kv_tokens: float = 0.0) -> float:
        return self.fixed_ms + self.ms_per_token * tokens + self.ms_per_kv_token * kv_tokens
