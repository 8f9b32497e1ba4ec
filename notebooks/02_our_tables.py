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
# # 02 - Our tables from `results/runs`
#
# The same tables as `make report` (`hif8qat.report.build_report`), built from the run folders of one
# profile. The notebook only reads: tables and figures go to a temporary folder. Set `HIF8QAT_RUNS_ROOT`
# (default `results/runs`) and `HIF8QAT_PROFILE` (default `mini`).

# %%
import os
import tempfile
from pathlib import Path

import pandas as pd

from hif8qat import report

runs_root = Path(os.environ.get("HIF8QAT_RUNS_ROOT", report.REPO / "results" / "runs"))
profile = os.environ.get("HIF8QAT_PROFILE", "mini")
if "HIF8QAT_RUNS_ROOT" not in os.environ and not report.discover_runs(runs_root, profile):
    runs_root = report.REPO / "results" / "reference_runs"  # no runs of your own yet: the committed ones
out = Path(tempfile.mkdtemp(prefix="hif8qat-nb02-"))
rep = report.build_report(runs_root, profile, out / "tables", out / "figures", n_boot=2000)
print(rep["message"])
tables = rep["tables"]
pd.set_option("display.width", 160)
pd.set_option("display.max_columns", None)  # every column of a table: they are read whole
if not tables:
    print(f"Nothing to show yet: no run folders under {runs_root / profile}. "
          "Run an experiment first, e.g. `make exp8` (mini profile), then re-run this notebook.")

# %% [markdown]
# ## Runs

# %%
tables.get(f"runs_{profile}", pd.DataFrame())

# %% [markdown]
# ## Accuracy drops against the baseline, per seed
# Descriptive: a paired bootstrap 95 % CI per seed and task. With a few flips per task it is anti-conservative;
# the tests behind the claims (seeds pooled, items counted once over their seeds, equivalence) are in the
# Claims section below.

# %%
tables.get(f"drops_{profile}", pd.DataFrame())

# %% [markdown]
# ## Training-loss APE

# %%
tables.get(f"ape_{profile}", pd.DataFrame())

# %% [markdown]
# ## Scaling telemetry

# %%
tables.get(f"telemetry_{profile}", pd.DataFrame())

# %% [markdown]
# ## Claims: same-seed pairs pooled over seeds, equivalence against stated margins
# Each run against its baseline and the experiment it derives from (pairs: same seed, same training settings;
# `pairing` lists every run left without a pair and why). Cost > 0: the run is worse. Per mode, task and metric
# (accuracy, the signed training-loss difference, per-item gold log-likelihood and margin where recorded): the
# mean cost with a 95 % CI from the design's own units (training loss: t on the seed means; items and held-out
# windows: crossed with the seeds, since every seed scores the same ones; `ci_method` and `df` say which), the
# equivalence verdict (two one-sided tests against the margin), one test with the seeds pooled (accuracy: an
# exact permutation test over items; Holm within the claim), and what that test can detect (MDE). The section
# below is what experiments/README.md includes.

# %%
from IPython.display import Markdown  # noqa: E402

Markdown(rep.get("claims_section", ""))

# %%
tables.get(f"claims_{profile}", pd.DataFrame())

# %%
tables.get(f"pairing_{profile}", pd.DataFrame())

# %% [markdown]
# ## The continuous metrics and their verdicts
# Accuracy on a few hundred items moves only when items flip; the continuous metrics resolve far smaller
# effects. Per claim: the signed training-loss difference over the QAT phase, the paired held-out NLL
# difference, and the per-item gold log-likelihood and margin, each with its 95 % CI, what its test detects
# (MDE), the margin and the equivalence verdict.

# %%
claims = tables.get(f"claims_{profile}", pd.DataFrame())
cols = ["experiment", "against", "counterpart", "mode", "task", "metric", "unit", "n_seeds", "cost", "ci_lo",
        "ci_hi", "df", "boot_lo", "boot_hi", "mde", "margin", "equivalence", "difference"]
claims[claims["metric"] != "accuracy"][cols].round(4) if not claims.empty else claims

# %% [markdown]
# ## Held-out text: NLL difference, KL and top-1 agreement against the baseline
# The held-out rows of the claims, with the distances quantization studies report beside them: mean and 99th
# percentile KL of the run's next-token distribution from its reference's, and top-1 agreement.

# %%
tables.get(f"heldout_{profile}", pd.DataFrame())

# %% [markdown]
# ## What this profile can show of the paper's effects
# Each claim measured here beside the paper's effect for the same pair (loss: the authors' per-step logs;
# accuracy: their published drops), and whether this claim's test resolves it, or the seeds or items it needs.

# %%
tables.get(f"reach_{profile}", pd.DataFrame())

# %% [markdown]
# ## What each claim's test can detect, and the seeds' spread
# The minimum detectable cost under the test the claim uses (exact McNemar for accuracy: at least 6 flips one
# way), from the claim's own runs; then the spread over seeds and the descriptive BF16-vs-BF16 seed null.

# %%
tables.get(f"mde_{profile}", pd.DataFrame())

# %%
tables.get(f"seeds_{profile}", pd.DataFrame())

# %%
tables.get(f"seed_null_{profile}", pd.DataFrame())

# %% [markdown]
# ## Sweeps: each metric against the swept knob (empty without tagged runs)

# %%
tables.get(f"sweeps_{profile}", pd.DataFrame())

# %% [markdown]
# ## Beyond the paper: HiF8 vs FP8 HYBRID, delayed vs just-in-time scaling
# One-factor pairs (exp10/exp11 change the element format of exp2/exp8, exp13/exp12 their scale algorithm):
# exceeded calls, clipped values per statistics call, QAT-phase APE. Their accuracy against each other, with
# paired CIs, is in the ablations table below.

# %%
tables.get(f"scaling_pairs_{profile}", pd.DataFrame())

# %%
abl = tables.get(f"ablations_{profile}", pd.DataFrame())
abl[abl["experiment"].isin(["exp10", "exp11", "exp12", "exp13"])] if not abl.empty else abl

# %% [markdown]
# ## External anchor: the base model on the full benchmarks vs its published scores

# %%
tables.get("anchor", pd.DataFrame())

# %%
from IPython.display import Image, display  # noqa: E402

# Seed 0's loss curves only: embedding every seed's made the notebook 2.6 MB; make report writes them all.
for f in rep["files"]:
    if "/loss_" in f and f.endswith("_seed0.png"):
        display(Image(filename=f))
