"""The built-in measurements of `gqakit eval`, registered in the order they run and their
options appear: perplexity, decode speed, lm-evaluation-harness tasks, the serving check (eval/measurement.py).
`measurements()` is the registry with them in it."""

from __future__ import annotations

from typing import Any

from gqakit.eval.measurement import MEASUREMENTS, Measurement
from gqakit.eval.measures import perplexity, speed, tasks, serving  # noqa: F401  (each registers itself)


def measurements() -> dict[str, Measurement]:
    """Every registered measurement, the built-in ones first."""
    return MEASUREMENTS


def settings_from(values: dict[str, Any], given: set[str]) -> dict[str, Any]:
    """Each measurement's settings from the option values (`given`: the options the user set;
    the others keep their defaults), for those asked for; every check done as they are built."""
    out = {}
    for name, m in MEASUREMENTS.items():
        s = m.settings(m.flags.given({k: v for k, v in values.items() if k in given}))
        if s is not None:
            out[name] = s
    return out


def nothing_to_measure() -> str:
    """The error when no measurement was asked for."""
    return f"nothing to measure: pass {', '.join(m.asked_by for m in MEASUREMENTS.values())}, or several"


__all__ = ["measurements", "nothing_to_measure", "settings_from"]
