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
if not tables:
    print(f"Nothing to show yet: no run folders under {runs_root / profile}. "
          "Run an experiment first, e.g. `make exp8` (mini profile), then re-run this notebook.")

# %% [markdown]
# ## Runs

# %%
tables.get(f"runs_{profile}", pd.DataFrame())

# %% [markdown]
# ## Accuracy drops against the baseline (paired bootstrap 95 % CI; significant = CI excludes 0)

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
# ## Seeds: the spread, the BF16-vs-BF16 seed null, and which claims survive it
# A claim (quantized experiment vs its baseline) survives seed noise when its drop exceeds the largest drop
# between two seeds of the baseline itself and is significant after Holm in every seed.

# %%
tables.get(f"seed_null_{profile}", pd.DataFrame())

# %%
tables.get(f"claims_{profile}", pd.DataFrame())

# %% [markdown]
# ## Minimum detectable paired difference per task at the evaluated item counts

# %%
tables.get(f"mde_{profile}", pd.DataFrame())

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
