"""End to end at the smoke profile: exp8 (whose missing baseline is explained), `make exp8` (which runs the
baseline exp7 first), exp1, then the report."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

ROOT = Path(__file__).resolve().parents[2]


def run(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HIF8QAT_COMPILE": "0"}
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), *args], capture_output=True, text=True,
                         timeout=900, cwd=ROOT, env=env)
    assert out.returncode == 0, f"{args} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


def make_experiment(name: str, args: list[str], tmp_path: Path) -> subprocess.CompletedProcess:
    """`make <name>` with this interpreter; a fresh stamp file stands for the venv, so make never builds one."""
    stamp = tmp_path / "venv-stamp"
    stamp.touch()
    env = {**os.environ, "HIF8QAT_COMPILE": "0"}
    joined = " ".join(args)
    out = subprocess.run(["make", "--no-print-directory", name, f"PY={sys.executable}", f"STAMP={stamp}",
                          "PROFILE=smoke", f"ARGS={joined}", f"BASELINE_ARGS={joined}"],
                         capture_output=True, text=True, timeout=900, cwd=ROOT, env=env)
    assert out.returncode == 0, f"make {name} failed:\n{out.stdout[-3000:]}\n{out.stderr[-5000:]}"
    return out


@pytest.mark.slow
def test_smoke_experiments_and_report_are_consistent_with_the_run_files(tmp_path):
    runs = tmp_path / "runs"
    common = ["profile=smoke", f"results_root={runs}", "logger.progress_bar=false", "train.num_threads=1"]
    out8 = run("experiment=exp8", "stage=all", *common)
    # run.py does not start the baseline itself: it says how, and the drops wait for it.
    assert "note: baseline exp7: exp7 has no run under" in out8.stdout
    assert "python run.py experiment=exp7 profile=smoke seed=0 stage=all" in out8.stdout
    assert not (runs / "smoke" / "exp7").exists()
    make = make_experiment("exp8", common, tmp_path)  # the baseline, then exp8 (finished: skipped)
    assert "== exp8: baseline exp7 first" in make.stdout
    # the run ends with its verdicts against the baseline and where the tables are, not the tables themselves
    assert "exp8 against exp7 (1 seed(s)" in make.stdout and "tables: " in make.stdout
    assert "drops_smoke (exp8)" not in make.stdout and "| experiment |" not in make.stdout
    assert "is finished: skipping training" in make.stdout
    run("experiment=exp1", "stage=all", *common)
    run("stage=report", *common)

    folders = {e: runs / "smoke" / e / "seed0" for e in ("exp1", "exp7", "exp8")}
    for folder in folders.values():
        assert (folder / "DONE").exists() and (folder / "eval" / "bf16" / "results.json").exists()
    assert (folders["exp8"] / "eval" / "hif8" / "results.json").exists()
    assert not (folders["exp7"] / "eval" / "hif8").exists()  # nothing to simulate in an unquantized run

    tables = runs / "tables" / "smoke"
    drops = pd.read_csv(tables / "drops_smoke.csv")
    ape = pd.read_csv(tables / "ape_smoke.csv")
    assert set(drops["experiment"]) == {"exp8"} and set(drops["baseline"]) == {"exp7"}
    assert set(drops["quant_mode"]) == {"bf16", "hif8"}
    assert set(drops["task"]) == {"mini_mmlu", "mini_hellaswag", "mini_arc"}
    assert drops[["base_pct", "quant_pct", "drop_pct"]].map(math.isfinite).all().all()
    # The table's numbers are the ones in the run files.
    base = json.loads((folders["exp7"] / "eval" / "bf16" / "results.json").read_text())
    quant = json.loads((folders["exp8"] / "eval" / "hif8" / "results.json").read_text())
    for _, row in drops[drops["quant_mode"] == "hif8"].iterrows():
        assert row["base_pct"] == pytest.approx(base[row["task"]]["value"] * 100)
        assert row["quant_pct"] == pytest.approx(quant[row["task"]]["value"] * 100)
        if row["base_pct"] > 0:
            assert row["drop_pct"] == pytest.approx((row["base_pct"] - row["quant_pct"]) / row["base_pct"] * 100)

    row = ape[ape["experiment"] == "exp8"].iloc[0]
    # APE from the two logs: mean over the steps both logged of |Lq - Lb| / |Lb| * 100 (last record per step)
    logs = {e: [json.loads(x) for x in (folders[e] / "metrics.jsonl").read_text().splitlines() if x.strip()]
            for e in ("exp8", "exp7")}
    lq, lb = ({r["step"]: r["loss"] for r in logs[e] if "loss" in r} for e in ("exp8", "exp7"))
    expected = sum(abs(lq[s] - lb[s]) / abs(lb[s]) * 100 for s in lq.keys() & lb.keys()) / len(lq.keys() & lb.keys())
    assert math.isfinite(row["ape_all_pct"]) and row["ape_all_pct"] == pytest.approx(expected)
    assert row["n_common"] == 8
    summary = json.loads((folders["exp8"] / "summary.json").read_text())
    assert summary["provenance"]["git"]["commit"] and summary["converted_linears"] > 0
    assert (runs / "figures" / "smoke").exists() and any((runs / "figures" / "smoke").iterdir())
