"""How a config key is declared: `setting()` gives its default, one line of meaning, and the values it
takes (`Bounds`, choices, one per class); config.py declares every key with it, config_file.py
checks files against it and config_doc.py renders docs/configuration.md from it."""
from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, field


@dataclass(frozen=True, slots=True)
class Bounds:
    """The numbers a key takes: low..high, low excluded when `open_low`."""
    low: float = -math.inf
    high: float = math.inf
    open_low: bool = False
    meaning: str = ""                    # what special values mean, e.g. "-1: off"

    def admits(self, value: float) -> bool:
        return (self.low < value if self.open_low else self.low <= value) and value <= self.high

    def __str__(self) -> str:
        low, high = _number(self.low), _number(self.high)
        if self.high == math.inf:
            text = f"> {low}" if self.open_low else f">= {low}"
        else:
            text = f"in ({low}, {high}]" if self.open_low else f"in {low}..{high}"
        return f"{text} ({self.meaning})" if self.meaning else text


def _number(value: float) -> str:
    return str(int(value)) if math.isfinite(value) and value == int(value) else f"{value:g}"


PORT = Bounds(0, 65535, meaning="0: a free port")
PORT_OR_OFF = Bounds(-1, 65535, meaning="0: a free port, -1: off")
POSITIVE = Bounds(0, open_low=True)
NON_NEGATIVE = Bounds(0)
SHARE = Bounds(0, 1, open_low=True)      # (0, 1]


def setting(default=MISSING, doc: str = "", *, factory=None, kind: type | None = None,
            choices: tuple = (), bounds: Bounds | None = None, per_class: bool = False, note: str = ""):
    """A config key: its default (or `factory`), one line saying what it does, and what it takes:
    one of `choices`, a number within `bounds`, or with `per_class` a list of three (High, Medium,
    Low) each within them. `kind` is the type where the default is None; `note` shows in the docs'
    values column where the rule is not one of these (a cross-key rule, a format)."""
    if default is not MISSING and default is not None:
        kind = kind or type(default)
    meta = {"doc": doc, "kind": kind, "choices": choices, "bounds": bounds, "per_class": per_class, "note": note}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


class ConfigError(ValueError):
    """The configuration file is wrong; the message names the key."""
