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
# # 01 - The paper's tables from the authors' published data
#
# Reads only `results/paper/` (tidy copies of the authors' per-step training logs and evaluation summaries,
# source named in `results/paper/README.md`) and recomputes:
#
# * the training-loss APE, mean over common steps of |L_q - L_b| / |L_b| x 100, over all steps and the last
#   1,000 (paper: exp8 vs exp7 0.11 % / 0.12 %);
# * the relative accuracy drops (base - quant) / base x 100 (paper: 0.43 % MMLU, 0.58 % HellaSwag,
#   0.22 % ARC-Challenge).
#
# Set `HIF8QAT_PAPER_DIR` to read another copy of the data.

# %%
import os
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402

from hif8qat import report  # noqa: E402

paper_dir = Path(os.environ.get("HIF8QAT_PAPER_DIR", report.PAPER_DIR))
tables = report.build_paper_tables(paper_dir)  # no out_tables: nothing is written
pd.set_option("display.width", 160)
print(report.format_paper_tables(tables))

# %% [markdown]
# ## Training-loss APE

# %%
tables["paper_ape"]

# %% [markdown]
# ## The headline comparison (exp8 vs exp7)
# `drop_pct_printed` is what the authors' summary prints (from unrounded scores); `drop_pct_from_scores` is
# recomputed from the two-decimal scores. The abstract's MMLU value matches the former, its ARC-Challenge
# value the latter.

# %%
tables["paper_headline"]

# %% [markdown]
# ## All published comparisons

# %%
drops = tables["paper_drops"]
drops[drops.summary_file == report.HEADLINE_SUMMARY]

# %% [markdown]
# ## Loss curves with the running APE

# %%
_, e7 = report.read_authors_run(paper_dir / "authors_runs" / "E7_bf16_lr1e-5.csv.gz")
_, e8 = report.read_authors_run(paper_dir / "authors_runs" / "E8_max_quant_lr1e-5.csv.gz")
ra = report.running_ape(e8.step, e8.loss, e7.step, e7.loss)
fig, ax = plt.subplots(figsize=(8, 4))
ax.plot(e7.step, e7.loss.rolling(50).mean(), label="E7 bf16 lr1e-5 (50-step mean)")
ax.plot(e8.step, e8.loss.rolling(50).mean(), label="E8 max_quant lr1e-5 (50-step mean)")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax2 = ax.twinx()
ax2.plot(ra.step, ra.running_ape, "k--", lw=0.8, label="running APE (%)")
ax2.set_ylabel("running APE (%)")
ax.legend(loc="upper center")
plt.show()
print(f"final running APE {ra.running_ape.iloc[-1]:.4f} %")
