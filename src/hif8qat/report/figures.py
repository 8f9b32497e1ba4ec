"""Figures: each run's loss curve against its baseline with the running APE, amax and amax/estimate per step,
saturation events per estimator."""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from hif8qat.files import save_figure
from hif8qat.report.sources import read_telemetry_dumps
from hif8qat.stats.paired import running_ape


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def legend(ax, **kwargs) -> None:
    """A legend when the panel has labelled artists: matplotlib warns on the console for an empty one (a run
    whose metrics hold ratios but no amax columns, or the reverse).

    Args:
        ax: the panel.
        **kwargs: matplotlib's legend arguments."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def plot_loss_pair(steps_q, loss_q, steps_b, loss_b, *, label_q: str, label_b: str, path: Path, title: str = ""):
    """A run's loss curve over its baseline's, with the running APE beside them, saved as a PNG.

    Args:
        steps_q: the run's logged steps.
        loss_q: its losses.
        steps_b: the baseline's logged steps.
        loss_b: its losses.
        label_q: the run's legend label.
        label_b: the baseline's.
        path: the file to write.
        title: the figure's title.

    Returns:
        ``path``."""
    plt = _plt()
    ra = running_ape(steps_q, loss_q, steps_b, loss_b)
    fig, ax = plt.subplots(figsize=(7, 4))
    ax.plot(steps_b, loss_b, lw=0.8, label=label_b)
    ax.plot(steps_q, loss_q, lw=0.8, label=label_q)
    ax.set_xlabel("step")
    ax.set_ylabel("training loss")
    ax2 = ax.twinx()
    ax2.plot(ra["step"], ra["running_ape"], color="k", lw=0.8, ls="--", label="running APE")
    ax2.set_ylabel("running APE (%)")
    h1, l1 = ax.get_legend_handles_labels()
    h2, l2 = ax2.get_legend_handles_labels()
    ax.legend(h1 + h2, l1 + l2, fontsize=8)
    ax.set_title(title or f"{label_q} vs {label_b}")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    save_figure(fig, path, dpi=110)
    plt.close(fig)
    return path


def make_figures(curves, runs, metrics_cache, tel_df, out: Path, profile: str) -> list[str]:
    """The report's figures: each paired loss curve, each run's amax and amax / estimate per step, and the
    share of quantizer calls that outgrew their estimate per estimator.

    Args:
        curves: (run, baseline, run metrics, baseline metrics) per paired loss curve.
        runs: the runs read.
        metrics_cache: run folder -> its metrics table.
        tel_df: the telemetry table.
        out: the figures folder.
        profile: the profile's name (in the file names).

    Returns:
        The paths written."""
    plt = _plt()
    files = []
    out.mkdir(parents=True, exist_ok=True)
    for r, b, mq, mb in curves:
        p = out / f"loss_{profile}_{r.experiment}_vs_{b.experiment}_seed{r.seed}.png"
        plot_loss_pair(mq["step"], mq["loss"], mb["step"], mb["loss"], label_q=r.experiment, label_b=b.experiment,
                       path=p)
        files.append(str(p))
    for r in runs:
        m = metrics_cache[str(r.path)]
        tel = read_telemetry_dumps(r.path)
        cols = [c for c in m.columns if c.endswith("/amax_max") or c.endswith("/amax_ratio_max")] if len(m) else []
        if not cols and tel.empty:
            continue
        fig, axes = plt.subplots(1, 2, figsize=(10, 3.6))
        if not tel.empty and {"step", "role", "amax", "estimate"} <= set(tel.columns):
            g = tel.groupby(["step", "role"])[["amax", "estimate"]].max().reset_index()
            for role, sub in g.groupby("role"):
                axes[0].semilogy(sub["step"], sub["amax"], lw=0.9, label=f"{role} amax")
                axes[0].semilogy(sub["step"], sub["estimate"], lw=0.9, ls="--", label=f"{role} estimate")
            axes[0].set_title("max over layers (telemetry dumps)")
        else:
            for c in [c for c in cols if c.endswith("/amax_max")]:
                s = pd.to_numeric(m[c], errors="coerce")
                axes[0].semilogy(m["step"], s.where(s > 0), lw=0.9, label=c.split("/")[1] + " amax")
            axes[0].set_title("amax per step (metrics.jsonl)")
        axes[0].set_xlabel("step")
        legend(axes[0], fontsize=7)
        for c in [c for c in cols if c.endswith("/amax_ratio_max")]:
            s = pd.to_numeric(m[c], errors="coerce")
            axes[1].plot(m["step"], s.where(s > 0), lw=0.9, label=c.split("/")[1])
        axes[1].axhline(1.0, color="k", lw=0.6, ls=":")
        axes[1].set_title("max amax / estimate (>1: outgrew the estimate)")
        axes[1].set_xlabel("step")
        legend(axes[1], fontsize=7)
        fig.suptitle(f"{r.experiment} seed {r.seed} ({r.estimator})", fontsize=9)
        fig.tight_layout()
        p = out / f"scales_{profile}_{r.experiment}_seed{r.seed}.png"
        save_figure(fig, p, dpi=110)
        plt.close(fig)
        files.append(str(p))
    if len(tel_df):
        # Share of quantizer calls, not of steps: with hundreds of linears nearly every step has one
        # exceeded call, whichever the estimator, so the per-step share hides the difference.
        piv = tel_df.groupby(["estimator", "role"])["frac_calls_ratio_gt1"].mean().unstack("role")
        fig, ax = plt.subplots(figsize=(7, 3.6))
        piv.plot.bar(ax=ax)
        ax.set_ylabel("share of calls with amax > estimate")
        ax.set_title("saturation events per estimator")
        ax.tick_params(axis="x", labelrotation=20, labelsize=7)
        fig.tight_layout()
        p = out / f"saturation_{profile}.png"
        save_figure(fig, p, dpi=110)
        plt.close(fig)
        files.append(str(p))
    return files
