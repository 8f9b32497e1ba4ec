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

# %%
from IPython.display import Image, display  # noqa: E402

for f in rep["files"]:
    if f.endswith(".png") and "/loss_" in f:
        display(Image(filename=f))
