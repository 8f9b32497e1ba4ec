"""Delayed tensor scaling for 8-bit (HiF8, FP8) fake quantization: its settings and the names it shares.

The rules (contract: docs/design.md, section 2) are implemented once, in :mod:`hif8qat.scaling.rules` (cold start,
estimators, refresh, amax reduction, append), :mod:`hif8qat.scaling.forecast` (``exp_smooth``) and the scaler bank
(:mod:`hif8qat.scaling.bank`) that applies them to every quantizer of a model. This module holds what the rest of the
project shares without loading the bank: :class:`ScalingConfig` and its schedules, the names of the algorithms
and roles, and the layout of one quantizer's saved state and telemetry. The replay of an amax trace through the
bank is :mod:`hif8qat.scaling.replay`.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from hif8qat.formats.qdq import FORMAT_SETTINGS, HIF8_MAX, target_for
from hif8qat.scaling.rules import EPS

ESTIMATORS = ("max", "most_recent", "mean", "exp_smooth")
# Allowed ``algo`` values: the history estimators, and "current", the just-in-time scale from the tensor's
# own amax (Transformer Engine's current scaling; scaling.current), the bound no estimator can beat.
ALGOS = (*ESTIMATORS, "current")
HISTORY_UNITS = ("call", "step")
AMAX_REDUCES = ("none", "max")
GRAD_ROUNDINGS = ("ta", "stochastic")
ROLES = ("A", "W", "G")


# --------------------------------------------------------------------------------------------------
# configuration
# --------------------------------------------------------------------------------------------------
def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _positive(v: Any) -> bool:
    return isinstance(v, (int, float, np.integer, np.floating)) and not isinstance(v, bool) and math.isfinite(v) \
        and v > 0


class SettingError(ValueError):
    """A config field set to a value it does not take: ``field``, ``value`` and ``allowed`` stay readable, so a
    caller that names the setting its own way (the pipeline's ``quant.<field>``) words the message itself."""

    def __init__(self, owner: str, field: str, value: Any, allowed: str) -> None:
        self.owner, self.field, self.value, self.allowed = owner, field, value, allowed
        super().__init__(f"{owner}.{field}={value!r} is invalid; allowed: {allowed}")


def _fail(name: str, value: Any, allowed: str) -> None:
    raise SettingError("ScalingConfig", name, value, allowed)


def _normalize_schedule(name: str, value: Any) -> Any:
    """Mapping -> {int: value} sorted by key (string keys from YAML/JSON are accepted)."""
    if not isinstance(value, Mapping):
        return value
    out = {}
    for k, v in value.items():
        if isinstance(k, str) and k.strip().lstrip("-").isdigit():
            k = int(k.strip())
        if not _is_int(k):
            _fail(name, value, "a value or a step schedule {step: value} with integer steps >= 0 and key 0")
        out[int(k)] = v
    return dict(sorted(out.items()))


@dataclass(frozen=True)
class ScalingConfig:
    """Delayed-scaling settings shared by every quantizer of a model (docs/design.md, section 2).

    Frozen and checked once, when it is made (``validate`` from ``__post_init__``): a config that exists is valid,
    so nothing downstream checks it again. ``dataclasses.replace`` makes a changed (and checked) copy.
    """

    algo: str | dict[int, str] = "max"
    history_len: int = 64
    interval: int | dict[int, int] = 1
    target_fwd: float = 15.0
    target_bwd: float = 15.0
    # HiF8 scale target per role, the clearer spelling: one number for A, W and G, or a mapping such as
    # {"A": 15, "W": 15, "G": 224} (MindSpeed's HiF8 recipe); roles it leaves out keep target_fwd / target_bwd.
    # None: target_fwd for A and W, target_bwd for G (configs written before it existed).
    target: float | dict[str, float] | None = None
    history_unit: str = "call"
    amax_reduce: str = "none"
    saturate: bool = False
    grad_rounding: str = "ta"
    telemetry_dump_every: int = 0
    # Extension of the CONTRACT: exceed-fraction / overflow statistics every N calls (0 = only on dump
    # steps). They cost two extra reductions over the tensor, so they are not computed on every call.
    telemetry_stats_every: int = 0
    # Element format (formats.FORMAT_SETTINGS): hif8, e4m3, e5m2, or hybrid (E4M3 for A/W, E5M2 for G).
    format: str = "hif8"
    # FP8 only: amax maps to format max / 2^margin (Transformer Engine DelayedScaling, default 0).
    margin: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.target, Mapping):  # YAML/JSON give a plain or OmegaConf mapping: store a dict
            object.__setattr__(self, "target", dict(self.target))
        try:
            object.__setattr__(self, "algo", _normalize_schedule("algo", self.algo))
            object.__setattr__(self, "interval", _normalize_schedule("interval", self.interval))
            self.validate()
        except SettingError as err:  # name the class the user built (a subclass adds fields, not new checks)
            own = type(self).__name__
            if own != err.owner:
                raise SettingError(own, err.field, err.value, err.allowed) from None
            raise

    # -- validation ------------------------------------------------------------------------------
    def validate(self) -> ScalingConfig:
        """Raise ValueError naming the first invalid field and its allowed values (run once, by ``__post_init__``).

        Returns:
            This config.
        """
        self._validate_schedule("algo", self.algo, lambda v: isinstance(v, str) and v in ALGOS,
                                f"one of {ALGOS}")
        self._validate_schedule("interval", self.interval, lambda v: _is_int(v) and v >= 1,
                                "an integer >= 1")
        if not _is_int(self.history_len) or self.history_len < 1:
            _fail("history_len", self.history_len, "an integer >= 1")
        for name in ("target_fwd", "target_bwd"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0:
                _fail(name, v, "a finite number > 0")
            if v > HIF8_MAX:
                _fail(name, v, f"a number in (0, {HIF8_MAX:g}], HiF8's largest value (a larger target overflows)")
        self._validate_target()
        for name, choices in (("history_unit", HISTORY_UNITS), ("amax_reduce", AMAX_REDUCES),
                              ("grad_rounding", GRAD_ROUNDINGS)):
            if getattr(self, name) not in choices:
                _fail(name, getattr(self, name), f"one of {choices}")
        if not isinstance(self.saturate, bool):
            _fail("saturate", self.saturate, "true or false")
        for name in ("telemetry_dump_every", "telemetry_stats_every"):
            v = getattr(self, name)
            if not _is_int(v) or v < 0:
                _fail(name, v, "an integer >= 0")
        self._validate_format()
        return self

    def _validate_target(self) -> None:
        """``target``: None, a number > 0, or roles A, W, G mapped to numbers > 0; never next to a changed
        target_fwd / target_bwd for the same role (two settings for one target: which one holds is a guess)."""
        t = self.target
        if t is None:
            return
        allowed = ("null, a finite number > 0, or a mapping of roles A, W, G to such numbers "
                   "(e.g. {A: 15, W: 15, G: 224})")
        ok = _positive(t) or (isinstance(t, Mapping) and bool(t) and set(t) <= set(ROLES)
                              and all(_positive(v) for v in t.values()))
        if not ok:
            _fail("target", t, allowed)
        values = t.values() if isinstance(t, Mapping) else [t]
        if any(v > HIF8_MAX for v in values):
            _fail("target", t, f"numbers in (0, {HIF8_MAX:g}], HiF8's largest value (a larger target overflows "
                  "every tensor)")
        covered = set(ROLES) if not isinstance(t, Mapping) else set(t)
        for name, roles in (("target_fwd", {"A", "W"}), ("target_bwd", {"G"})):
            default = next(f.default for f in dataclasses.fields(ScalingConfig) if f.name == name)
            if covered & roles and getattr(self, name) != default:
                _fail("target", t, f"null when {name} is set ({name}={getattr(self, name)!r}): give each role's "
                      "target once, in target (preferred) or in target_fwd / target_bwd")

    def targets(self) -> dict[str, float]:
        """The scale target each role uses (HiF8: ``target`` where it names the role, else target_fwd for A and
        W, target_bwd for G; FP8: the format max / 2^margin).

        Returns:
            Role -> target.
        """
        return {r: target_for(self, r) for r in ROLES}

    def _validate_format(self) -> None:
        """format / margin, and the settings that mean something for one kind of format only."""
        if self.format not in FORMAT_SETTINGS:
            _fail("format", self.format, f"one of {FORMAT_SETTINGS}")
        if not _is_int(self.margin) or self.margin < 0:
            _fail("margin", self.margin, "an integer >= 0")
        if self.format == "hif8":
            if self.margin:
                _fail("margin", self.margin, "0 with format=hif8 (HiF8's target is set by target); "
                      "an integer >= 0 with e4m3, e5m2 or hybrid")
            return
        if self.target is not None:
            _fail("target", self.target, f"null with format={self.format} (FP8 targets are the format max / "
                  "2^margin, set margin instead)")
        # FP8 targets come from the format (max / 2^margin); a changed HiF8 target would be silently unused.
        for name in ("target_fwd", "target_bwd"):
            default = next(f.default for f in dataclasses.fields(ScalingConfig) if f.name == name)
            if getattr(self, name) != default:
                _fail(name, getattr(self, name), f"{default} (unused) with format={self.format}: FP8 targets are "
                      "the format max / 2^margin, set margin instead")
        if self.grad_rounding != "ta":
            _fail("grad_rounding", self.grad_rounding, f"ta with format={self.format} (FP8 casts round to "
                  "nearest even; stochastic rounding is HiF8-only)")

    @staticmethod
    def _validate_schedule(name: str, value: Any, ok: Callable[[Any], bool], allowed: str) -> None:
        if isinstance(value, Mapping):
            sched_allowed = f"{allowed}, or a step schedule {{0: ..., step: ...}} with integer steps >= 0"
            if not value:
                _fail(name, value, sched_allowed + " (empty schedule)")
            for k, v in value.items():
                if not _is_int(k) or k < 0:
                    _fail(name, value, sched_allowed + f" (bad step key {k!r})")
                if not ok(v):
                    _fail(name, value, sched_allowed + f" (bad value {v!r} at step {k})")
            if 0 not in value:
                _fail(name, value, sched_allowed + " (key 0 is required)")
        elif not ok(value):
            _fail(name, value, f"{allowed}, or a step schedule {{0: ..., step: ...}}")

    # -- schedules -------------------------------------------------------------------------------
    def algo_schedule(self) -> list[tuple[int, str]]:
        """The ``algo`` setting as a sorted schedule.

        Returns:
            ``[(first step, algorithm)]``.
        """
        return sorted(self.algo.items()) if isinstance(self.algo, Mapping) else [(0, self.algo)]

    def interval_schedule(self) -> list[tuple[int, int]]:
        """The ``interval`` setting as a sorted schedule.

        Returns:
            ``[(first step, interval)]``.
        """
        if isinstance(self.interval, Mapping):
            return [(k, int(v)) for k, v in sorted(self.interval.items())]
        return [(0, int(self.interval))]

    def uses(self, algo: str) -> bool:
        """Whether the schedule uses an algorithm at any step.

        Args:
            algo: the algorithm's name.

        Returns:
            True when it does.
        """
        return any(a == algo for _, a in self.algo_schedule())

    # -- (de)serialisation -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """The delayed-scaling fields only (a subclass adds its own by overriding this).

        Returns:
            Field name -> value.
        """
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(ScalingConfig)}
        d = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items()}
        if isinstance(d["target"], Mapping):  # in the roles' order, whatever order the config gave
            d["target"] = {r: d["target"][r] for r in ROLES if r in d["target"]}
        for k in ("algo", "interval"):
            if isinstance(d[k], Mapping):
                d[k] = {int(s): v for s, v in d[k].items()}
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> ScalingConfig:
        """The config of a dict of fields (as :meth:`to_dict` gives).

        Args:
            d: field name -> value.

        Returns:
            The validated config.

        Raises:
            ValueError: an unknown field, or an invalid value.
        """
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"ScalingConfig: unknown field(s) {unknown}; allowed: {sorted(known)}")
        kw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in d.items()}
        return cls(**kw)


def lookup(schedule: Sequence[tuple[int, Any]], step: int) -> Any:
    """The value of a sorted ``[(step, value)]`` schedule at ``step``: that of the largest key <= step.

    Args:
        schedule: ``[(step, value)]`` sorted by step.
        step: the step.

    Returns:
        The value.
    """
    if len(schedule) == 1:
        return schedule[0][1]
    i = bisect.bisect_right(schedule, (int(step), math.inf), key=lambda kv: (kv[0], math.inf)) - 1
    return schedule[max(i, 0)][1]


# Layout of the ``meta`` vector of a saved quantizer state (its Python bookkeeping, in this order).
META_FIELDS = ("initialized", "block_j", "block_len", "block_algo", "step", "pending_step", "frozen", "calls",
               "seen_total")
# One quantizer's saved state (a row of the bank; the format the per-layer scalers wrote before the bank, so
# older checkpoints and exports load unchanged).
STATE_KEYS = ("history", "total", "pending", "pending_valid", "scale_block", "est_block", "meta")
OPTIONAL_STATE_KEYS = ("es_obs", "es_meta", "es_scores")

# Telemetry: the columns of the bank's accumulators since the last reset (``tel_max``: largest values,
# ``tel_cnt``: counts) and of its last-call values (``last_vals`` then ``last_stats``), as they are named in
# telemetry records and metrics.
TELEMETRY_MAX_FIELDS = ("amax_ratio_max", "exceed_frac_max", "amax_max")
TELEMETRY_COUNT_FIELDS = ("amax_ratio_gt1", "clipped_count", "nonfinite_count")
LAST_CALL_FIELDS = ("amax", "estimate", "ratio", "scale", "exceed_frac", "clipped")


def check_state_keys(state: Mapping, strict: bool, who: str) -> None:
    """KeyError naming ``who`` when a saved scaler state lacks a key, or (strict) has an unknown one.

    Args:
        state: the saved state.
        strict: refuse unknown keys too.
        who: the scaler's name (for the error).

    Raises:
        KeyError: a missing or unknown key.
    """
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise KeyError(f"{who}: state is missing {missing}")
    extra = set(state) - set(STATE_KEYS) - set(OPTIONAL_STATE_KEYS)
    if strict and extra:
        raise KeyError(f"{who}: unexpected state keys {sorted(extra)}")


__all__ = [
    "ALGOS", "AMAX_REDUCES", "EPS", "ESTIMATORS", "GRAD_ROUNDINGS", "HISTORY_UNITS", "LAST_CALL_FIELDS", "META_FIELDS",
    "OPTIONAL_STATE_KEYS", "ROLES", "STATE_KEYS", "TELEMETRY_COUNT_FIELDS", "TELEMETRY_MAX_FIELDS", "ScalingConfig",
    "SettingError", "check_state_keys", "lookup",
]
