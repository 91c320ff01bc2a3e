"""Bills from ledger rows: totals grouped by day, priority, pool, model or tenant, whose lines add
up to the total (pure functions; `qos-serve billing report` prints them)."""
from __future__ import annotations

import calendar
import csv
import io
import time
from dataclasses import dataclass

GROUPS = ("tenant", "day", "priority", "pool", "model")
FIELDS = ("requests", "prompt_tokens", "completion_tokens", "amount")


@dataclass(slots=True)
class Line:
    group: str
    requests: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    amount: float = 0.0

    def add(self, row: dict) -> None:
        self.requests += 1
        self.prompt_tokens += row["prompt_tokens"]
        self.completion_tokens += row["completion_tokens"]
        self.amount += row["amount"]


def group_of(row: dict, by: str) -> str:
    if by == "day":
        return time.strftime("%Y-%m-%d", time.gmtime(row["finished_at"]))
    return str(row[by])


def report(rows: list[dict], by: str = "tenant") -> tuple[list[Line], Line]:
    """(one line per group, sorted; the total). The lines' sums are the total's, field by field."""
    if by not in GROUPS:
        raise ValueError(f"--by must be one of {', '.join(GROUPS)}, got {by!r}")
    lines: dict[str, Line] = {}
    total = Line("total")
    for row in rows:
        lines.setdefault(group_of(row, by), Line(group_of(row, by))).add(row)
        total.add(row)
    return [lines[k] for k in sorted(lines)], total


def parse_since(value: str | None) -> float | None:
    """YYYY-MM-DD (UTC midnight) or unix seconds -> unix seconds."""
    if value is None:
        return None
    try:
        return float(value)
    except ValueError:
        pass
    try:
        return float(calendar.timegm(time.strptime(value, "%Y-%m-%d")))
    except ValueError:
        raise ValueError(f"--since must be YYYY-MM-DD or unix seconds, got {value!r}") from None


def render(lines: list[Line], total: Line, by: str, as_csv: bool = False) -> str:
    if as_csv:
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow([by, *FIELDS])
        for line in [*lines, total]:
            writer.writerow([line.group, line.requests, line.prompt_tokens, line.completion_tokens,
                             f"{line.amount:.6f}"])
        return out.getvalue()
    width = max([len(by), 5, *(len(line.group) for line in lines)])
    head = f"{by:<{width}} {'requests':>9} {'prompt tok':>11} {'compl. tok':>11} {'amount':>12}"
    rows = [f"{line.group:<{width}} {line.requests:>9} {line.prompt_tokens:>11} "
            f"{line.completion_tokens:>11} {line.amount:>12.2f}" for line in [*lines, total]]
    return "\n".join([head, *rows[:-1], "-" * len(head), rows[-1]]) + "\n"
