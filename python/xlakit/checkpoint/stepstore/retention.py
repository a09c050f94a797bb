"""Which steps a manager keeps: the most recent, every n-th, and the best by a metric.

The kept set is a pure function of the committed steps on disk and the
policy, so every rank of a job computes the same one from the same folder
(and the ranks check that they did before anything is deleted). The latest
step is always kept, and so is the best; a step is deleted only once a newer
one committed.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping
from dataclasses import dataclass

from xlakit.checkpoint.stepstore.steps import Scan, StepFolder

MODES = ("min", "max")


def _optional_count(name: str, value: object) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be a whole number or None, got {value!r} ({type(value).__name__})")
    if value < 1:
        raise ValueError(f"{name} must be at least 1 (or None for no limit), got {value!r}")


@dataclass(frozen=True)
class Retention:
    """What a manager keeps.

    Attributes:
        max_to_keep: keep the N most recent committed steps (None: keep all).
        keep_every_n_steps: also keep every step divisible by N, forever.
        best_metric: also keep the step whose metrics hold the best value of this name.
        best_mode: "min" or "max": which value of `best_metric` is best.
    """

    max_to_keep: int | None = None
    keep_every_n_steps: int | None = None
    best_metric: str | None = None
    best_mode: str = "min"

    def __post_init__(self) -> None:
        _optional_count("max_to_keep", self.max_to_keep)
        _optional_count("keep_every_n_steps", self.keep_every_n_steps)
        if self.best_metric is not None and (not isinstance(self.best_metric, str) or not self.best_metric):
            raise TypeError(f"best_metric must be a metric name (a non-empty string) or None, got "
                            f"{self.best_metric!r}")
        if self.best_mode not in MODES:
            raise ValueError(f"best_mode must be 'min' or 'max', got {self.best_mode!r}")


def metric_value(step: StepFolder, name: str) -> float | None:
    value = step.metrics.get(name)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value):
        return None
    return float(value)


def best(committed: dict[int, StepFolder], policy: Retention) -> int | None:
    """The committed step with the best `best_metric` (the later one on a tie); None without one."""
    if policy.best_metric is None:
        return None
    scored = [(v, s) for s, f in committed.items() if (v := metric_value(f, policy.best_metric)) is not None]
    if not scored:
        return None
    sign = 1.0 if policy.best_mode == "min" else -1.0
    return min(scored, key=lambda vs: (sign * vs[0], -vs[1]))[1]


def kept(committed: dict[int, StepFolder], policy: Retention) -> set[int]:
    """The committed steps the policy keeps (always the latest, and the best)."""
    steps = sorted(committed)
    if not steps:
        return set()
    keep = set(steps if policy.max_to_keep is None else steps[-policy.max_to_keep:])
    keep.add(steps[-1])
    if policy.keep_every_n_steps is not None:
        keep.update(s for s in steps if s % policy.keep_every_n_steps == 0)
    top = best(committed, policy)
    if top is not None:
        keep.add(top)
    return keep


def doomed(found: Scan, policy: Retention, *, saved: int) -> list[int]:
    """Step folders to delete after step `saved` committed: committed ones the policy drops
    (never `saved` itself, even when a forced save put it below the latest), and interrupted
    saves older than the latest committed step (a newer step superseded them)."""
    latest = found.latest
    if latest is None:
        return []
    keep = kept(found.committed, policy) | {saved}
    drop = [s for s in found.committed if s not in keep]
    drop += [s for s in found.pending if s < latest]
    return sorted(drop)


def check_metrics(metrics: Mapping | None, best_metric: str | None) -> dict[str, float]:
    """A step's metrics as numbers (one-element tensors read out); must hold `best_metric` if set."""
    if metrics is None:
        metrics = {}
    if not isinstance(metrics, Mapping):
        raise TypeError(f"metrics must be a mapping of names to numbers, got {type(metrics).__name__}")
    out: dict[str, float] = {}
    for name, value in metrics.items():
        if not isinstance(name, str):
            raise TypeError(f"metric names must be strings, got {name!r}")
        if type(value).__module__.split(".")[0] in ("torch", "numpy") and hasattr(value, "shape"):
            if math.prod(value.shape) != 1:  # a tensor, a numpy array or a numpy scalar (shape ())
                raise TypeError(f"metric {name!r} must be one number, got a {type(value).__name__} of shape "
                                f"{tuple(value.shape)}")
            value = value.item()
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            raise TypeError(f"metric {name!r} must be a number, got {value!r} ({type(value).__name__})")
        out[name] = int(value) if isinstance(value, numbers.Integral) else float(value)
    if best_metric is not None and best_metric not in out:
        raise ValueError(f"metrics must hold best_metric {best_metric!r} (the manager keeps the best step "
                         f"by it); got {sorted(out) or 'none'}")
    return out
