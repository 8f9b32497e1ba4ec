"""Statistics of held-out per-token distances (pure functions; :mod:`hif8qat.evaluate.heldout` computes the tokens).

One comparison pairs a reference model (a run's BF16 baseline, or the run's own unquantized export) with
another (the run, or its quantized mode) on the same held-out tokens: per token, both models' NLL of the actual
next token, KL(P_ref || P_other) and whether their top-1 tokens agree. Tokens of one window share their context,
so the variance of a token mean comes from the window means, with ``n_windows - 1`` degrees of freedom
(:func:`hif8qat.stats.paired.block_variance_of_mean`). The windows are the same in every seed, so the report
crosses seeds with windows (:func:`window_costs`, :func:`hif8qat.stats.crossed.crossed_mean`) for the
``heldout_nll`` claim metric."""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from hif8qat.artefacts import HELDOUT_SUMMARY_SCHEMA, read_json, unverified, verify_sha256
from hif8qat.stats.paired import _quantile, block_variance_of_mean, mde_from_se

# Equivalence margin of the held-out NLL difference, % of the baseline's held-out NLL: the training-loss margin
# of the report (DEFAULT_MARGINS["train_loss"]), since both are the same quantity on seen and unseen text.
HELDOUT_MARGIN_PCT = 0.25
HELDOUT_METRIC = "heldout_nll"  # its claim metric; `python -m hif8qat.report --margin heldout_nll=M` sets the margin
KL_PERCENTILES = (50.0, 99.0, 99.9)
HELDOUT_DIR = "heldout"  # under <run>/eval/
SUMMARY_FILE = "summary.json"


def run_label(run_dir) -> str:
    """How a held-out summary names the baseline it was paired with: ``<experiment>/<seed folder>``.

    Args:
        run_dir: the baseline's run folder (a Path).

    Returns:
        ``<experiment>/<seed folder>``."""
    return f"{run_dir.parent.name}/{run_dir.name}"


def block_mean(x: Sequence[float], tokens_per_window: int, *, alpha: float = 0.05, power: float = 0.8
               ) -> dict[str, float]:
    """Mean of a per-token series laid out window after window, with its block (window) standard error, a
    (1 - alpha) t interval on ``n_windows - 1`` degrees of freedom, the 90 % interval, a two-sided p-value for
    a zero mean, and the minimum detectable mean (two-sided ``alpha``, ``power``) of that test.

    Args:
        x: per-token values, window-major.
        tokens_per_window: tokens in each window (the block size).
        alpha: two-sided level of the interval and the test.
        power: power of the minimum detectable mean.

    Returns:
        A dict with ``mean``, ``se``, ``var``, ``df``, ``n_tokens``, ``n_windows``, ``se_iid`` (as if tokens were
        independent: se / se_iid shows how much the within-window correlation widens the interval), ``ci_lo``/``ci_hi``,
        ``ci90_lo``/``ci90_hi``, ``p`` and ``mde``; NaN where fewer than two windows."""
    from scipy import stats as st
    a = np.asarray(x, float)
    n = int(a.size)
    nb = n // int(tokens_per_window) if tokens_per_window > 0 else 0
    mean = float(a.mean()) if n else float("nan")
    var = block_variance_of_mean(a, int(tokens_per_window)) if nb >= 2 else float("nan")
    se = math.sqrt(var) if np.isfinite(var) else float("nan")
    df = float(nb - 1) if nb >= 2 else float("nan")
    out = {"mean": mean, "se": se, "var": var, "df": df, "n_tokens": n, "n_windows": nb,
           "se_iid": float(a.std(ddof=1) / math.sqrt(n)) if n > 1 else float("nan")}
    if not np.isfinite(se):
        return {**out, "ci_lo": float("nan"), "ci_hi": float("nan"), "ci90_lo": float("nan"),
                "ci90_hi": float("nan"), "p": float("nan"), "mde": float("nan")}
    q, q90 = _quantile(1 - alpha / 2, df), _quantile(0.95, df)
    p = float(2 * st.t.sf(abs(mean) / se, df)) if se > 0 else (1.0 if mean == 0 else 0.0)
    return {**out, "ci_lo": mean - q * se, "ci_hi": mean + q * se, "ci90_lo": mean - q90 * se,
            "ci90_hi": mean + q90 * se, "p": p, "mde": mde_from_se(se, df, alpha=alpha, power=power)}


def kl_summary(kl: Sequence[float]) -> dict[str, float]:
    """llama.cpp's KL statistics of a quantized model against its reference: mean, median, high percentiles,
    maximum (nats per token).

    Args:
        kl: per-token KL(P_reference || P_run), nats.

    Returns:
        ``{mean, max, p<q>...}`` over the percentiles in ``KL_PERCENTILES``; NaN for an empty series."""
    a = np.asarray(kl, float)
    if not a.size:
        return {"mean": float("nan"), "max": float("nan"), **{f"p{p:g}": float("nan") for p in KL_PERCENTILES}}
    return {"mean": float(a.mean()), "max": float(a.max()),
            **{f"p{p:g}": float(np.percentile(a, p)) for p in KL_PERCENTILES}}


def comparison_summary(nll_ref: Sequence[float], nll_other: Sequence[float], kl: Sequence[float],
                       top1_agree: Sequence[float], tokens_per_window: int, *, alpha: float = 0.05,
                       power: float = 0.8) -> dict[str, Any]:
    """Everything one comparison reports from its per-token columns (window-major order).

    Args:
        nll_ref: the reference model's NLL per token.
        nll_other: the other model's NLL per token.
        kl: KL(P_ref || P_other) per token.
        top1_agree: 1 where both models' top-1 tokens agree, else 0.
        tokens_per_window: tokens per window (the block size).
        alpha: two-sided level.
        power: power of the minimum detectable difference.

    Returns:
        A dict: token count, both mean NLLs and perplexities; ``nll_diff`` (other minus reference, nats per token,
        positive: the other predicts worse) with its block interval and minimum detectable difference; ``nll_diff_pct``,
        the same in % of the reference's mean NLL (the unit of the equivalence margin); ``kl``: mean and percentiles;
        ``top1``: the share of tokens whose top-1 token agrees, with its block interval.

    Raises:
        ValueError: the paired columns differ in length."""
    ref = np.asarray(nll_ref, float)
    other = np.asarray(nll_other, float)
    if ref.shape != other.shape:
        raise ValueError(f"paired columns differ in length: {ref.shape} vs {other.shape}")
    diff = block_mean(other - ref, tokens_per_window, alpha=alpha, power=power)
    base = float(ref.mean()) if ref.size else float("nan")
    scale = 100.0 / base if base > 0 else float("nan")
    pct = {k: (v * scale if k in ("mean", "se", "se_iid", "ci_lo", "ci_hi", "ci90_lo", "ci90_hi", "mde")
               else v * scale**2 if k == "var" else v) for k, v in diff.items()}
    return {"n_tokens": int(ref.size), "tokens_per_window": int(tokens_per_window),
            "nll_ref": base, "nll_other": float(other.mean()) if other.size else float("nan"),
            "ppl_ref": math.exp(base) if np.isfinite(base) else float("nan"),
            "ppl_other": math.exp(float(other.mean())) if other.size else float("nan"),
            "nll_diff": diff, "nll_diff_pct": pct, "kl": kl_summary(kl),
            "top1": block_mean(np.asarray(top1_agree, float), tokens_per_window, alpha=alpha, power=power)}


# ------------------------------------------------------------------------------------------- files
def heldout_dir(run_dir) -> Path:
    """The folder a run's held-out files are written to (``<run>/eval/heldout``).

    Args:
        run_dir: the run folder.

    Returns:
        Its held-out folder (which may not exist)."""
    return Path(run_dir) / "eval" / HELDOUT_DIR


HELDOUT_REDO = ("Write it again with `python run.py ... stage=eval` (it redoes a corrupt held-out comparison) or "
                "`python -m hif8qat.evaluate.heldout --run <run folder>`")


def read_summary(run_dir) -> dict | None:
    """A run's ``eval/heldout/summary.json`` (the report reads it without torch), through the verified reader.

    Args:
        run_dir: the run folder.

    Returns:
        The summary as a dict, or None when the run has none.

    Raises:
        artefacts.CorruptArtefact: the summary does not parse, or its token table no longer has the sha256 it recorded
            (the error names the file and what to run)."""

    path = heldout_dir(run_dir) / SUMMARY_FILE
    if not path.exists():
        return None
    doc = read_json(path, HELDOUT_REDO, schema=HELDOUT_SUMMARY_SCHEMA)
    tokens = doc.get("tokens_file")
    if tokens:
        recorded = doc.get("tokens_sha256")
        if recorded is None:
            unverified(heldout_dir(run_dir) / tokens, f"{path} records no tokens_sha256 for it", HELDOUT_REDO)
        verify_sha256(heldout_dir(run_dir) / tokens, recorded, HELDOUT_REDO)
    return doc


def window_costs(tokens: pd.DataFrame, reference: str, other: str) -> pd.Series | None:
    """Per held-out window, the paired NLL cost ``other - reference`` in % of the reference's mean NLL over all
    tokens (windows hold equal token counts, so their mean is the comparison's ``nll_diff_pct`` mean): the units
    the claims cross with seeds, since every seed scores the same windows.

    Args:
        tokens: the per-token table (a ``window`` column and ``nll_<model>`` columns).
        reference: the reference model's column suffix.
        other: the other model's column suffix.

    Returns:
        The costs indexed by window (as str), or None when the columns are absent or the reference NLL is not positive.
    """
    ref, oth = f"nll_{reference}", f"nll_{other}"
    if not {"window", ref, oth} <= set(tokens.columns):
        return None
    base = float(tokens[ref].mean())
    if not base > 0:
        return None
    diff = (tokens[oth].astype(float) - tokens[ref].astype(float)) * (100.0 / base)
    out = diff.groupby(tokens["window"]).mean()
    out.index = out.index.astype(str)
    return out


def window_means(tokens: pd.DataFrame, column: str) -> pd.Series | None:
    """Per held-out window, the mean of a per-token column (KL, top-1 agreement).

    Args:
        tokens: the per-token table (with a ``window`` column).
        column: the column to average.

    Returns:
        The means indexed by window (as str), or None when the column is absent."""
    if not {"window", column} <= set(tokens.columns):
        return None
    out = tokens[column].astype(float).groupby(tokens["window"]).mean()
    out.index = out.index.astype(str)
    return out
