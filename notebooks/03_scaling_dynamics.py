# ---
# jupyter:
#   jupytext:
#     formats: py:percent,ipynb
#     text_representation:
#       extension: .py
#       format_name: percent
#   kernelspec:
#     display_name: Python 3
#     language: python
#     name: python3
# ---

# %% [markdown]
# # 03 - Scaling dynamics: amax, the delayed estimate, and saturation
#
# Per tensor role (A = activation input, W = weight, G = output gradient), from the step log
# (`metrics.jsonl`, `tel/<role>/<stat>`) and the per-layer dumps (`telemetry/*.jsonl`) of the runs in
# `HIF8QAT_RUNS_ROOT/HIF8QAT_PROFILE` (defaults `results/runs`, `mini`). A ratio amax / estimate > 1 means the
# tensor outgrew its delayed estimate: its scaled values leave the 3-bit-mantissa tier (failure mode (i)).
# Then the four estimators are replayed (`hif8qat.scaling.replay.replay`, the scaler's own code path) on one
# recorded amax trace, or on a synthetic trace when no run has telemetry dumps.

# %%
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402

from hif8qat import report  # noqa: E402

runs_root = Path(os.environ.get("HIF8QAT_RUNS_ROOT", report.REPO / "results" / "runs"))
profile = os.environ.get("HIF8QAT_PROFILE", "mini")
if "HIF8QAT_RUNS_ROOT" not in os.environ and not report.discover_runs(runs_root, profile):
    runs_root = report.REPO / "results" / "reference_runs"  # no runs of your own yet: the committed ones
runs = [r for r in report.discover_runs(runs_root, profile) if r.quant]
print(f"{len(runs)} quantized runs under {runs_root / profile}")
if not runs:
    print("No quantized runs yet (e.g. `make exp8`); the replay below uses a synthetic trace.")

# %% [markdown]
# ## Per-step telemetry from the step log

# %%
for r in runs:
    m = report.read_metrics(r.path / "metrics.jsonl")
    ratio_cols = [c for c in m.columns if c.endswith("/amax_ratio_max")]
    if not ratio_cols:
        continue
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4))
    for c in ratio_cols:
        role = c.split("/")[1]
        s = pd.to_numeric(m[c], errors="coerce")
        axes[0].plot(m.step, s.where(s > 0), lw=0.8, label=role)
        a = pd.to_numeric(m.get(f"tel/{role}/amax_max"), errors="coerce")
        if a is not None:
            axes[1].semilogy(m.step, a.where(a > 0), lw=0.8, label=role)
    axes[0].axhline(1, color="k", ls=":", lw=0.6)
    axes[0].set_title(f"{r.experiment}: max amax/estimate per step")
    axes[1].set_title("max amax per step")
    for ax in axes:
        ax.set_xlabel("step")
        ax.legend(fontsize=7)
    plt.show()
    display(report.telemetry_summary(m))  # noqa: F821 - IPython builtin

# %% [markdown]
# ## Per-layer dumps: amax and estimate over time

# %%
trace = None
for r in runs:
    tel = report.read_telemetry_dumps(r.path)
    if tel.empty or not {"amax", "estimate", "layer", "role"} <= set(tel.columns):
        continue
    first_layer = sorted(tel.layer.unique())[0]
    sub = tel[(tel.layer == first_layer)].sort_values("step")
    fig, ax = plt.subplots(figsize=(8, 3.4))
    for role, g in sub.groupby("role"):
        ax.semilogy(g.step, g.amax, lw=0.9, label=f"{role} amax")
        ax.semilogy(g.step, g.estimate, lw=0.9, ls="--", label=f"{role} estimate")
    ax.set_title(f"{r.experiment}: {first_layer}")
    ax.set_xlabel("step")
    ax.legend(fontsize=7)
    plt.show()
    a = sub[sub.role == "A"].amax.astype(float).to_numpy()
    if trace is None and len(a) >= 8 and np.isfinite(a).all():
        trace, trace_name = a, f"{r.experiment} {first_layer} A (dumped steps)"

# %% [markdown]
# ## The estimators replayed on one amax trace
# `estimate = target / scale`; a saturation event is a call whose amax exceeds the estimate used for it.

# %%
if trace is None:
    rng = np.random.default_rng(0)
    t = np.arange(400)
    trace = np.exp(0.004 * t) * (1 + 0.05 * rng.standard_normal(400))
    trace[[120, 250, 330]] *= 3.0  # spikes
    trace_name = "synthetic (slow growth + 3 spikes)"
try:
    from hif8qat.scaling.replay import replay
    from hif8qat.scaling.settings import ScalingConfig
except ImportError as err:  # hif8qat.scaling not available in this checkout
    print(f"hif8qat.scaling unavailable ({err}); skipping the replay")
else:
    rows = []
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.semilogy(trace, "k", lw=1.0, label="amax")
    for algo in ("max", "most_recent", "mean", "exp_smooth"):
        cfg = ScalingConfig(algo=algo, history_len=16)
        scales = replay(list(map(float, trace)), cfg).numpy()
        est = cfg.target_fwd / scales
        ratio = trace / est
        rows.append({"estimator": algo, "saturation_events": int((ratio[1:] > 1).sum()),
                     "max_ratio": float(ratio[1:].max()), "mean_headroom": float(np.mean(est[1:] / trace[1:]))})
        ax.semilogy(est, lw=0.8, label=f"{algo} estimate")
    ax.set_title(trace_name)
    ax.set_xlabel("call")
    ax.legend(fontsize=7)
    plt.show()
    display(pd.DataFrame(rows))  # noqa: F821 - IPython builtin
