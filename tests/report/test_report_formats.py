"""The report's view of the FP8 and just-in-time runs: clipped counts per format (old logs' overflow counts
read as HiF8's), the one-factor scaling pairs side by side, and quantized-mode ablations."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import yaml
from test_report import make_fake_runs, record_eval_files

from hif8qat import report


def test_clipped_counts_per_stats_call_new_and_old_logs():
    m = pd.DataFrame({
        "step": [1, 2, 3],
        "tel/A/calls": [4, 4, 4], "tel/A/stats_calls": [2, 2, 2], "tel/A/amax_ratio_gt1": [1, 0, 2],
        "tel/A/amax_ratio_max": [1.2, 0.9, 3.0],
        "tel/A/clipped_count": [10, 0, 50],
        "tel/G/calls": [4, 4, 4], "tel/G/stats_calls": [2, 2, 2], "tel/G/amax_ratio_gt1": [0, 0, 0],
        "tel/G/amax_ratio_max": [0.5, 0.5, 0.5],
        "tel/G/overflow_count": [0, 3, 0],  # a role logged under the old name still counts
    })
    ts = report.telemetry_summary(m).set_index("role")
    assert ts.loc["A", "clipped_total"] == 60 and ts.loc["A", "clipped_per_stats_call"] == pytest.approx(10.0)
    assert ts.loc["G", "clipped_total"] == 3 and ts.loc["G", "stats_calls"] == 6
    out = report.scaling_outcome(m)
    assert out["calls_exceeded"] == pytest.approx(3 / 24)
    assert out["clipped_per_stats_call"] == pytest.approx(63 / 12)


def _derive(runs, src: str, name: str, changes: list[str], quant: dict, clipped: float, gt1: float,
            hif8_lost: int) -> None:
    """A copy of run ``src`` as experiment ``name`` (derived from ``src``): other quant settings, telemetry,
    and ``hif8_lost`` fewer correct answers than ``src`` in the quantized evaluation."""
    d = runs / "smoke" / name / "seed0"
    shutil.copytree(runs / "smoke" / src / "seed0", d)
    cfg = yaml.safe_load((d / "config_resolved.yaml").read_text())
    cfg["experiment"].update(name=name, derived_from=src, changes=changes, paper_run=None)
    cfg["quant"].update(quant)
    (d / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    lines = [json.loads(s) for s in (d / "metrics.jsonl").read_text().splitlines()]
    with (d / "metrics.jsonl").open("w") as fh:
        for rec in lines:
            for role in "AWG":
                if f"tel/{role}/calls" in rec:
                    rec.pop(f"tel/{role}/overflow_count")
                    rec.update({f"tel/{role}/clipped_count": clipped, f"tel/{role}/stats_calls": 2.0,
                                f"tel/{role}/amax_ratio_gt1": gt1})
            fh.write(json.dumps(rec) + "\n")
    e = d / "eval" / "hif8"
    s = pd.read_csv(e / "samples_mini_arc.csv")
    lost = np.flatnonzero(s["correct"].to_numpy() == 1)[:hif8_lost]
    s.loc[lost, "correct"] = 0
    s.to_csv(e / "samples_mini_arc.csv", index=False)
    res = json.loads((e / "results.json").read_text())
    res["mini_arc"]["value"] = float(s["correct"].mean())
    (e / "results.json").write_text(json.dumps(res))
    record_eval_files(d)


def test_scaling_pairs_and_quantized_mode_ablations(tmp_path):
    runs = make_fake_runs(tmp_path / "runs")
    # exp11: exp8 in FP8 (clips 40 values per statistics call, exceeded in every call); exp12: the oracle
    _derive(runs, "exp8", "exp11", ["quant.format"], {"format": "hybrid"}, clipped=80.0, gt1=4.0, hif8_lost=10)
    _derive(runs, "exp8", "exp12", ["quant.algo"], {"algo": "current"}, clipped=0.0, gt1=0.0, hif8_lost=0)
    rep = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=500, figures=False)
    pairs = rep["tables"]["scaling_pairs_smoke"].set_index("experiment")
    assert set(pairs.index) == {"exp11", "exp12"}  # exp8 vs exp7 changes more than the format or algorithm
    p11 = pairs.loc["exp11"]
    assert (p11["counterpart"], p11["changes"], p11["format"], p11["cp_format"]) == ("exp8", "quant.format",
                                                                                     "hybrid", "hif8")
    assert p11["clipped_per_stats_call"] == pytest.approx(40.0)
    assert np.isnan(p11["cp_clipped_per_stats_call"])  # the fake exp8 logged no statistics calls
    assert p11["calls_exceeded"] == pytest.approx(1.0)
    # exp8's share of exceeded calls from its log: exceeded calls over all calls, every role and step
    log = (runs / "smoke" / "exp8" / "seed0" / "metrics.jsonl").read_text()
    recs = [json.loads(line) for line in log.splitlines() if line.strip()]
    exceeded = sum(v for r in recs for k, v in r.items() if k.endswith("/amax_ratio_gt1"))
    calls = sum(v for r in recs for k, v in r.items() if k.startswith("tel/") and k.endswith("/calls"))
    assert exceeded > 0 and p11["cp_calls_exceeded"] == pytest.approx(exceeded / calls)
    assert pairs.loc["exp12", "algo"] == "current" and pairs.loc["exp12", "cp_algo"] == "max"
    assert pairs.loc["exp12", "ape_qat_pct"] == pytest.approx(pairs.loc["exp12", "cp_ape_qat_pct"])
    abl = rep["tables"]["ablations_smoke"].set_index(["experiment", "mode"])
    # quantized-mode rows only where both runs are quantized; exp11 lost 10 answers in FP8 inference
    assert ("exp8", "hif8") not in abl.index and ("exp8", "bf16") in abl.index
    assert abl.loc[("exp11", "hif8"), "drop_pct"] > 0 and abl.loc[("exp11", "bf16"), "drop_pct"] == 0
    assert abl.loc[("exp12", "hif8"), "drop_pct"] == 0
    tel = rep["tables"]["telemetry_smoke"]
    assert set(tel[tel.experiment == "exp11"]["format"]) == {"hybrid"}
    assert set(tel[tel.experiment == "exp8"]["format"]) == {"hif8"}  # no quant.format in its config: HiF8


def _set_role(run_dir, role: str, **values: float) -> None:
    """Overwrite one role's telemetry in every logged step of a run's metrics.jsonl."""
    lines = [json.loads(s) for s in (run_dir / "metrics.jsonl").read_text().splitlines()]
    with (run_dir / "metrics.jsonl").open("w") as fh:
        for rec in lines:
            if f"tel/{role}/calls" in rec:
                rec.update({f"tel/{role}/{k}": v for k, v in values.items()})
            fh.write(json.dumps(rec) + "\n")


def test_gradient_target_pairs_report_the_gradients_counts_and_the_loss(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0,))
    # exp14: exp8 with G at 224; G exceeds its estimate in 1 of 4 calls and overflows 3 values per statistics
    # call (2 statistics calls a step), A and W as exp8's
    _derive(runs, "exp8", "exp14", ["quant.target"], {"target": {"A": 15.0, "W": 15.0, "G": 224.0}}, clipped=0.0,
            gt1=0.0, hif8_lost=0)
    _set_role(runs / "smoke" / "exp14" / "seed0", "G", amax_ratio_gt1=1.0, clipped_count=6.0)
    rep = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=100, figures=False)
    p = rep["tables"]["scaling_pairs_smoke"].set_index("experiment").loc["exp14"]
    assert (p["counterpart"], p["changes"], p["targets"], p["cp_targets"]) == ("exp8", "quant.target", "15/15/224",
                                                                               "15/15/15")
    assert p["G_calls_exceeded"] == pytest.approx(0.25) and p["G_clipped_per_stats_call"] == pytest.approx(3.0)
    # exp8's G, from its own log: never exceeded (ratio 0.9), no statistics calls logged
    assert p["cp_G_calls_exceeded"] == 0 and np.isnan(p["cp_G_clipped_per_stats_call"])
    assert p["calls_exceeded"] == pytest.approx(1 / 12)  # all roles pooled: only G's quarter
    section = rep["claims_section"]
    head = "#### Gradients at target 224 (MindSpeed's HiF8 recipe), max(64): exp14 vs exp8 (seeds 0)"
    assert head in section
    claim = section.split(head)[1].split("\n#### ")[0]
    assert "| train | loss | train_loss | 1 |" in claim and "- Training loss: " in claim
    assert "exp15" not in section  # not run here: no heading, no empty claim
    assert "| exp14 (hif8, max, targets A/W/G 15/15/224) | exp8 (hif8, max) |" in section
    assert "| exp14 (15/15/224) | exp8 (15/15/15) | 0 | 25.0 % vs 0.0 % | 3.00 vs - |" in section
    assert ("exceeded in 25.0 % of G's calls against 0.0 % (higher), G overflowed 3.00 values per statistics call "
            "against -, and the QAT-phase loss differed") in section
