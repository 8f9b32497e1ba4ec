"""Scaling telemetry from metrics.jsonl: per role, how often amax outgrew the delayed estimate and how many
values were clipped; all roles pooled for the scaling-pairs table."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pandas as pd


def _clipped_column(metrics: pd.DataFrame, role: str) -> pd.Series:
    """Per-step clipped-value counts of ``role``: ``clipped_count`` (HiF8 overflow or FP8 clipping), or
    ``overflow_count`` in logs written before FP8 (the same HiF8 count)."""
    out = pd.Series(np.nan, index=metrics.index, dtype=float)
    for name in ("overflow_count", "clipped_count"):  # the newer name wins where both exist
        c = f"tel/{role}/{name}"
        if c in metrics:
            out = pd.to_numeric(metrics[c], errors="coerce").combine_first(out)
    return out


def telemetry_summary(metrics: pd.DataFrame) -> pd.DataFrame:
    """Per role, from the ``tel/<role>/<stat>`` columns of metrics.jsonl (steps with telemetry only).

    Args:
        metrics: a run's metrics table.

    Returns:
        One row per role: steps, frac_steps_ratio_gt1 (steps whose max amax/estimate > 1), max_ratio,
        frac_calls_ratio_gt1 (calls with amax > estimate over all calls), clipped_total (values beyond the format's
        range on statistics calls: HiF8 overflow, FP8 clipping), stats_calls, clipped_per_stats_call, max_exceed_frac,
        nonfinite_total, max_amax."""
    roles = sorted({c.split("/")[1] for c in metrics.columns if c.startswith("tel/") and c.count("/") == 2})
    rows = []
    for r in roles:
        def col(stat, _r=r):
            c = f"tel/{_r}/{stat}"
            return pd.to_numeric(metrics[c], errors="coerce") if c in metrics else pd.Series(dtype=float)

        ratio = col("amax_ratio_max")
        valid = ratio.notna() & (ratio > 0)
        calls, gt1 = col("calls"), col("amax_ratio_gt1")
        clipped, stats = _clipped_column(metrics, r), col("stats_calls")
        rows.append({
            "role": r,
            "steps": int(valid.sum()),
            "frac_steps_ratio_gt1": float((ratio[valid] > 1).mean()) if valid.any() else float("nan"),
            "max_ratio": float(ratio[valid].max()) if valid.any() else float("nan"),
            "frac_calls_ratio_gt1": float(gt1.sum() / calls.sum()) if len(calls) and calls.sum() > 0 else float("nan"),
            "clipped_total": float(clipped.sum()) if clipped.notna().any() else float("nan"),
            "stats_calls": float(stats.sum()) if len(stats) else float("nan"),
            "clipped_per_stats_call": float(clipped.sum() / stats.sum())
            if clipped.notna().any() and len(stats) and stats.sum() > 0 else float("nan"),
            "max_exceed_frac": float(col("exceed_frac_max").max()) if len(col("exceed_frac_max")) else float("nan"),
            "nonfinite_total": float(col("nonfinite_count").sum()) if len(col("nonfinite_count")) else float("nan"),
            "max_amax": float(col("amax_max").max()) if len(col("amax_max")) else float("nan"),
        })
    return pd.DataFrame(rows)


def scaling_outcome(metrics: pd.DataFrame, roles: Sequence[str] | None = None) -> dict[str, float]:
    """All roles pooled (or only ``roles``): share of calls whose amax outgrew the estimate, clipped values per
    statistics call.

    Args:
        metrics: a run's metrics table.
        roles: the roles to pool (None: all logged).

    Returns:
        ``{calls_exceeded, clipped_per_stats_call}``, NaN where nothing was logged."""
    logged = sorted({c.split("/")[1] for c in metrics.columns if c.startswith("tel/") and c.count("/") == 2})
    roles = [r for r in logged if roles is None or r in roles]

    def total(stat):
        cols = [f"tel/{r}/{stat}" for r in roles if f"tel/{r}/{stat}" in metrics]
        return float(sum(pd.to_numeric(metrics[c], errors="coerce").sum() for c in cols)) if cols else float("nan")

    calls, gt1, stats = total("calls"), total("amax_ratio_gt1"), total("stats_calls")
    clipped = float(sum(_clipped_column(metrics, r).sum() for r in roles)) if roles else float("nan")
    return {"calls_exceeded": gt1 / calls if calls > 0 else float("nan"),
            "clipped_per_stats_call": clipped / stats if stats > 0 else float("nan")}
