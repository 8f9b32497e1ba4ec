"""The report's view of the FP8 and just-in-time runs: clipped counts per format (old logs' overflow counts
read as HiF8's), the one-factor scaling pairs side by side, and quantized-mode ablations."""

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import yaml
from test_report import make_fake_runs

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
