"""End to end at the smoke profile: exp11 (the final recipe in FP8 HYBRID) and exp12 (the same with
just-in-time scaling in HiF8) train, log per-format clipping telemetry, and record what they quantized to."""

from __future__ import annotations

import json

import numpy as np
import pytest
from test_pipeline import run

from hif8qat.report import read_metrics


@pytest.mark.slow
def test_fp8_and_current_experiments_log_clipping_and_own_amax_scales(tmp_path):
    runs = tmp_path / "runs"
    common = ["profile=smoke", f"results_root={runs}", "logger.progress_bar=false", "train.num_threads=1"]
    run("experiment=exp11", "stage=all", *common)
    run("experiment=exp12", "stage=train", *common)
    d11, d12 = runs / "smoke" / "exp11" / "seed0", runs / "smoke" / "exp12" / "seed0"

    # exp11: FP8 clipping counted on statistics calls (dump steps), in every role's step log
    m11 = read_metrics(d11 / "metrics.jsonl")
    q11 = m11[m11["quant"].astype(bool)]
    assert len(q11) > 0
    for role in "AWG":
        assert q11[f"tel/{role}/clipped_count"].notna().all() and "tel/A/overflow_count" not in m11
    stats = q11[q11["tel/A/stats_calls"] > 0]
    assert len(stats) > 0 and (stats["tel/A/stats_calls"] == stats["tel/A/calls"]).all()  # dump steps: every call
    # At margin 0 an FP8 tensor that outgrew its estimate clips its top values: on every statistics step, a role
    # with a call whose amax exceeded the estimate has clipped values (and the run has such calls to check).
    exceeded = [(r, s) for r in "AWG" for s in stats.index if stats.at[s, f"tel/{r}/amax_ratio_gt1"] > 0]
    assert exceeded, "no call outgrew its estimate on a statistics step: nothing to check"
    assert all(stats.at[s, f"tel/{r}/clipped_count"] > 0 for r, s in exceeded), exceeded
    doc = json.loads((d11 / "export" / "hif8qat_quant.json").read_text())
    assert doc["element_formats"] == {"A": "e4m3", "W": "e4m3", "G": "e5m2"}
    meta = json.loads((d11 / "eval" / "hif8" / "results.json").read_text())["_meta"]["quant"]
    assert meta["format"] == "hybrid" and meta["scales"].startswith("frozen")

    # exp12: every call scaled from its own amax: never exceeded, and each dumped scale is 15 / amax
    m12 = read_metrics(d12 / "metrics.jsonl")
    q12 = m12[m12["quant"].astype(bool)]
    assert len(q12) > 0
    for role in "AWG":
        assert (q12[f"tel/{role}/amax_ratio_max"] == 1.0).all() and (q12[f"tel/{role}/amax_ratio_gt1"] == 0).all()
        assert (q12[f"tel/{role}/clipped_count"] == 0).all()
    dumps = [json.loads(line) for f in sorted((d12 / "telemetry").glob("*.jsonl"))
             for line in f.read_text().splitlines()]
    assert dumps and {r["algo"] for r in dumps} == {"current"}
    for r in dumps:
        assert np.float32(r["scale"]) == np.float32(15.0 / (np.float64(r["amax"]) + 1e-12)), r
