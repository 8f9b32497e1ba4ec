"""hif8qat.report: drop/APE/bootstrap maths on hand-made inputs, the paper's numbers, report structure."""

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from scipy import stats as st

from hif8qat import report

PAPER = report.PAPER_DIR


# ------------------------------------------------------------------------------------------ maths
def test_relative_drop():
    assert report.relative_drop(50.0, 49.0) == pytest.approx(2.0)
    assert report.relative_drop(40.0, 41.0) == pytest.approx(-2.5)
    assert math.isnan(report.relative_drop(0.0, 1.0))


def test_loss_ape_hand_made():
    # baseline 2.0 everywhere; quant 2.02 on steps 1..8 (1 %), 2.1 on 9..10 (5 %); step 11 only in quant
    steps_b = list(range(1, 11))
    loss_b = [2.0] * 10
    steps_q = list(range(1, 12))
    loss_q = [2.02] * 8 + [2.1, 2.1, 7.0]
    a = report.loss_ape(steps_q, loss_q, steps_b, loss_b, last_frac=0.2)
    assert a["n_common"] == 10
    assert a["ape_all"] == pytest.approx((8 * 1 + 2 * 5) / 10)
    assert a["ape_last"] == pytest.approx(5.0)
    assert a["last_n"] == 2
    a3 = report.loss_ape(steps_q, loss_q, steps_b, loss_b, last_n=3)
    assert a3["ape_last"] == pytest.approx((1 + 5 + 5) / 3)
    # absolute value: quant below baseline counts the same
    assert report.loss_ape([1], [1.98], [1], [2.0])["ape_all"] == pytest.approx(1.0)


def test_running_ape_is_cumulative_mean():
    ra = report.running_ape([1, 2, 3], [1.1, 1.0, 1.3], [1, 2, 3], [1.0, 1.0, 1.0])
    assert ra["ape"].tolist() == pytest.approx([10.0, 0.0, 30.0])
    assert ra["running_ape"].tolist() == pytest.approx([10.0, 5.0, 40.0 / 3])


def test_bootstrap_ci_excludes_zero_for_a_real_drop():
    rng = np.random.default_rng(1)
    base = (rng.random(400) < 0.6).astype(float)
    quant = base.copy()
    flip = np.flatnonzero(base == 1)[:40]  # 40 of ~240 correct answers lost, none gained
    quant[flip] = 0
    ci = report.paired_bootstrap_drop(base, quant, n_boot=2000, seed=0)
    assert ci.drop == pytest.approx((base.mean() - quant.mean()) / base.mean() * 100)
    assert ci.lo > 0 and ci.significant
    assert ci.lo <= ci.drop <= ci.hi


def test_bootstrap_ci_covers_zero_for_swaps():
    base = np.array([1, 0] * 200, float)
    quant = base.copy()
    quant[:20] = 1 - quant[:20]  # 10 lost, 10 gained: same accuracy
    ci = report.paired_bootstrap_drop(base, quant, n_boot=2000, seed=0)
    assert ci.drop == pytest.approx(0.0)
    assert ci.lo < 0 < ci.hi and not ci.significant
    # deterministic for a fixed seed
    assert report.paired_bootstrap_drop(base, quant, n_boot=2000, seed=0) == ci


def test_bootstrap_is_paired():
    """A small consistent drop on correlated documents is significant only because it is paired."""
    rng = np.random.default_rng(3)
    base = (rng.random(300) < 0.5).astype(float)
    quant = base.copy()
    quant[np.flatnonzero(base == 1)[:8]] = 0
    ci = report.paired_bootstrap_drop(base, quant, n_boot=3000, seed=0)
    assert ci.significant  # unpaired binomial SEs (~2.9 pp each) would swamp this 8-item difference


def test_align_samples_joins_on_doc_id():
    b = pd.DataFrame({"doc_id": ["0", "1", "2", "3"], "correct": [1, 1, 0, 0]})
    q = pd.DataFrame({"doc_id": ["3", "2", "1"], "correct": [1, 0, 0]})
    xb, xq = report.align_samples(b, q)
    assert xb.tolist() == [1, 0, 0] and xq.tolist() == [0, 0, 1]


def test_telemetry_summary():
    m = pd.DataFrame({
        "step": [1, 2, 3, 4],
        "tel/A/amax_ratio_max": [0.9, 1.5, 0.8, 2.0],
        "tel/A/amax_ratio_gt1": [0, 2, 0, 3],
        "tel/A/calls": [10, 10, 10, 10],
        "tel/A/overflow_count": [0, 0, 1, 4],
        "tel/G/amax_ratio_max": [0.5, 0.5, 0.5, 0.5],
        "tel/G/calls": [10, 10, 10, 10],
    })
    ts = report.telemetry_summary(m).set_index("role")
    assert ts.loc["A", "frac_steps_ratio_gt1"] == pytest.approx(0.5)
    assert ts.loc["A", "max_ratio"] == pytest.approx(2.0)
    assert ts.loc["A", "frac_calls_ratio_gt1"] == pytest.approx(5 / 40)
    assert ts.loc["A", "clipped_total"] == 5  # a log written before FP8: its overflow_count
    assert ts.loc["G", "frac_steps_ratio_gt1"] == 0.0


# ------------------------------------------------------------------------------------- paper data
def test_paper_ape_values():
    ape = report.paper_ape_table(PAPER).set_index("quantized")
    e8 = ape.loc["E8"]
    assert e8["baseline"] == "E7" and e8["n_common"] == 10000
    assert e8["ape_all_pct"] == pytest.approx(0.1148, abs=5e-5)
    assert e8["ape_last1000_pct"] == pytest.approx(0.1205, abs=5e-5)
    assert round(e8["ape_all_pct"], 2) == 0.11 and round(e8["ape_last1000_pct"], 2) == 0.12
    assert e8["ape_last10pct_pct"] == pytest.approx(e8["ape_last1000_pct"])
    assert set(ape.index) >= {"E2", "E3", "E4", "E5"}
    assert (ape.loc[["E2", "E3", "E4", "E5"], "baseline"] == "E1").all()


def test_paper_drops_headline():
    drops = report.paper_drop_table(PAPER)
    head = report.paper_headline(drops).set_index("task")
    assert head.loc["mmlu", "drop_pct_printed"] == pytest.approx(0.4271, abs=5e-5)
    assert round(head.loc["mmlu", "drop_pct_printed"], 2) == 0.43
    assert round(head.loc["hellaswag", "drop_pct_printed"], 2) == 0.58
    assert round(head.loc["hellaswag", "drop_pct_from_scores"], 2) == 0.58
    assert round(head.loc["arc_challenge", "drop_pct_from_scores"], 2) == 0.22
    assert head.loc["arc_challenge", "drop_pct_printed"] == pytest.approx(0.2320, abs=5e-5)
    assert head.loc["mmlu", "base_pct"] == 43.36 and head.loc["mmlu", "quant_pct"] == 43.17
    # computed drops agree with the printed ones within the effect of rounding each score to 0.005 pp
    ok = drops.dropna(subset=["drop_pct_printed", "drop_pct_from_scores"])
    b, q = ok["base_pct"], ok["quant_pct"]
    tol = 100 * 0.005 * (1 / b + (q + 0.005) / (b * (b - 0.005))) + 1e-4
    assert (abs(ok["drop_pct_printed"] - ok["drop_pct_from_scores"]) <= tol).all()


def test_paper_drops_cover_all_published_runs():
    drops = report.paper_drop_table(PAPER)
    pairs = set(zip(drops.baseline, drops.quantized))
    assert {("bf16", "cts"), ("bf16", "dts_exp"), ("bf16", "max_quant"), ("bf16_lr1e5", "max_quant_lr1e5")} <= pairs
    e6 = drops[(drops.summary_file == "summary_20260505_162925.txt") & (drops.quantized == "max_quant")]
    assert e6.set_index("task").loc["arc_challenge", "drop_pct_printed"] == pytest.approx(3.2995)


def test_paper_cli_prints_and_writes(tmp_path, capsys):
    assert report.main(["--paper", "--tables", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    assert "0.1148" in out and "0.1205" in out and "0.4271" in out
    for name in ("paper_ape", "paper_drops", "paper_headline"):
        assert (tmp_path / f"{name}.csv").exists() and (tmp_path / f"{name}.md").exists()
        src = json.loads((tmp_path / f"{name}.sources.json").read_text())
        assert any("E8_max_quant" in f["path"] for f in src["files"])


# ------------------------------------------------------------------------------ run-folder report
def make_fake_runs(root: Path, profile: str = "smoke", n_docs: int = 120, steps: int = 40, seeds=(0,),
                   exps=("exp7", "exp8"), tags=None) -> Path:
    """exp7 (bf16 baseline) and exp8 (quantized, baseline exp7) run folders with the CONTRACT's files.

    Seed k > 0 flips the answers of k documents (seed noise); exp8 loses 6 correct answers in bf16 mode and
    20 in hif8 mode against exp7 of the same seed. ``tags``: run_tag per experiment."""
    for sd in seeds:
        _fake_seed(root, profile, n_docs, steps, sd, exps, tags or {})
    record_eval_files(root)
    return root


def record_eval_files(root: Path) -> Path:
    """Every results.json under ``root`` records the sha256 of each file beside it, as the evaluation writes it
    (hashlib here, not the writer's helper); rerun after a test edits a samples file on purpose."""
    for results in sorted(Path(root).rglob("eval/*/results.json")):
        doc = json.loads(results.read_text())
        doc["_files"] = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(results.parent.iterdir())
                         if p.is_file() and p.name != "results.json"}
        results.write_text(json.dumps(doc))
    return root


def _fake_seed(root, profile, n_docs, steps, sd, exps, tags):
    rng = np.random.default_rng(0)
    base_correct = (rng.random(n_docs) < 0.6).astype(int)
    if sd:
        base_correct[-2 * sd:] = 1 - base_correct[-2 * sd:]
    for exp, baseline, quant in (("exp7", None, False), ("exp8", "exp7", True)):
        if exp not in exps:
            continue
        d = root / profile / exp / (f"seed{sd}" + (f"-{tags[exp]}" if tags.get(exp) else ""))
        d.mkdir(parents=True)
        cfg = {"experiment": {"name": exp, "baseline": baseline, "paper_run": exp.upper(), "derived_from": baseline,
                              "changes": ["quant"] if quant else []},
               "profile": {"name": profile}, "seed": sd, "run_tag": tags.get(exp, ""),
               "quant": {"enabled": quant, "algo": "max" if quant else None, "history_len": 64}}
        (d / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
        (d / "run_info.json").write_text(json.dumps({"git": {"commit": f"abc{exp}", "dirty": False}}))
        with (d / "metrics.jsonl").open("w") as fh:
            for s in range(1, steps + 1):
                loss = 5.0 - 0.02 * s + (0.01 * (s % 3) if quant else 0.0)
                rec = {"step": s, "loss": loss, "lr": 1e-4, "quant": quant and s > 5}
                if quant and s > 5:
                    for role in ("A", "W", "G"):
                        ratio = 1.3 if (role == "A" and s % 7 == 0) else 0.9
                        rec.update({f"tel/{role}/amax_ratio_max": ratio, f"tel/{role}/amax_ratio_gt1": float(ratio > 1),
                                    f"tel/{role}/calls": 4.0, f"tel/{role}/amax_max": 2.0 + 0.01 * s,
                                    f"tel/{role}/overflow_count": 0.0, f"tel/{role}/exceed_frac_max": 0.01})
                fh.write(json.dumps(rec) + "\n")
        if quant:
            (d / "telemetry").mkdir()
            with (d / "telemetry" / "dump.jsonl").open("w") as fh:
                for s in range(6, steps + 1, 2):
                    for role in ("A", "W", "G"):
                        amax = 2.0 + 0.05 * s + (1.0 if s % 10 == 0 else 0)
                        fh.write(json.dumps({"step": s, "layer": "model.layers.0.mlp.up_proj", "role": role,
                                             "amax": amax, "estimate": 2.0 + 0.05 * (s - 2),
                                             "scale": 15 / amax}) + "\n")
        for mode in (("bf16", "hif8") if quant else ("bf16",)):
            e = d / "eval" / mode
            e.mkdir(parents=True)
            correct = base_correct.copy()
            if quant:
                lost = np.flatnonzero(correct == 1)[: (6 if mode == "bf16" else 20)]
                correct[lost] = 0
            pd.DataFrame({"doc_id": range(n_docs), "correct": correct}).to_csv(e / "samples_mini_arc.csv", index=False)
            res = {"mini_arc": {"metric": "acc_norm", "value": float(correct.mean()), "stderr": 0.04, "n": n_docs,
                                "num_fewshot": 3}, "_meta": {"mode": mode}}
            (e / "results.json").write_text(json.dumps(res))
        (d / "summary.json").write_text(json.dumps({"wall_time_s": 12.5}))
        (d / "DONE").write_text("")


def test_build_report_structure(tmp_path):
    runs = make_fake_runs(tmp_path / "runs")
    # The untrained base model's evaluation, on file: here identical to exp7's.
    shutil.copytree(runs / "smoke" / "exp7" / "seed0" / "eval" / "bf16", tmp_path / "base_model" / "smoke")
    rep = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=1000)
    t = rep["tables"]
    assert set(t) == {"runs_smoke", "drops_smoke", "ape_smoke", "telemetry_smoke", "replay_smoke",
                      "ablations_smoke", "scaling_pairs_smoke", "vs_base_smoke", "seeds_smoke", "seed_null_smoke",
                      "claims_smoke", "mde_smoke", "reach_smoke", "anchor", "pairing_smoke", "paired_smoke",
                      "sweeps_smoke", "heldout_smoke"}
    assert t["replay_smoke"].empty  # no exported scaler state in these fake runs
    # exp8 derives from exp7: the ablation is the bf16-mode drop, and against the base model exp7 is unchanged.
    abl = t["ablations_smoke"].iloc[0]
    assert abl["experiment"] == "exp8" and abl["derived_from"] == "exp7" and abl["changes"] == "quant"
    bf16_drop = t["drops_smoke"].set_index("quant_mode").loc["bf16", "drop_pct"]
    assert abl["drop_pct"] == pytest.approx(bf16_drop) and abl["n_paired"] == 120
    vs_base = t["vs_base_smoke"].set_index("experiment")
    assert vs_base.loc["exp7", "drop_pct"] == 0 and not vs_base.loc["exp7", "significant"]
    assert vs_base.loc["exp8", "drop_pct"] == pytest.approx(bf16_drop)
    drops = t["drops_smoke"].set_index("quant_mode")
    assert list(t["drops_smoke"].experiment.unique()) == ["exp8"]
    assert (t["drops_smoke"].baseline == "exp7").all()
    # hif8 mode lost 20 of ~72 correct answers: large, significant; bf16 mode lost 6
    h = drops.loc["hif8"]
    assert h["drop_pct"] == pytest.approx(h["drop_paired_pct"]) and h["drop_pct"] > 20
    assert h["significant"] and h["ci_lo"] > 0 and h["n_paired"] == 120
    assert drops.loc["bf16", "drop_pct"] < h["drop_pct"]
    ape = t["ape_smoke"].iloc[0]
    assert ape["n_common"] == 40 and ape["last_n"] == 4 and ape["ape_all_pct"] > 0
    # QAT phase: from step 6, the first the quantized run logged as quantized (steps 1-5: its BF16 warmup)
    qat_err = [(0.01 * (s % 3)) / (5.0 - 0.02 * s) * 100 for s in range(6, 41)]
    assert ape["qat_from_step"] == 6 and ape["n_qat"] == 35
    assert ape["ape_qat_pct"] == pytest.approx(np.mean(qat_err))
    tel = t["telemetry_smoke"].set_index("role")
    assert tel.loc["A", "frac_steps_ratio_gt1"] == pytest.approx(5 / 35)
    assert tel.loc["W", "max_ratio"] == pytest.approx(0.9)
    for name in t:
        assert (tmp_path / "tables" / f"{name}.csv").exists() and (tmp_path / "tables" / f"{name}.md").exists()
    section = (tmp_path / "tables" / "claims_section_smoke.md").read_text()
    assert section.strip() == rep["claims_section"].strip() and "exp8 vs exp7" in section
    src = json.loads((tmp_path / "tables" / "drops_smoke.sources.json").read_text())
    commits = {c for f in src["files"] for c in f["git_commits"]}
    assert commits == {"abcexp7", "abcexp8"}
    # every file the report reads, with its hash: the pairing, done-ness and commit come from these three
    listed = {f["path"]: f["sha256"] for f in src["files"]}
    for exp in ("exp7", "exp8"):
        for name in ("config_resolved.yaml", "run_info.json", "DONE", "summary.json", "metrics.jsonl",
                     "eval/bf16/samples_mini_arc.csv", "eval/bf16/results.json"):
            path = runs / "smoke" / exp / "seed0" / name
            assert listed[str(path)] == hashlib.sha256(path.read_bytes()).hexdigest(), path
    pngs = sorted(p.name for p in (tmp_path / "figures").glob("*.png"))
    assert any(p.startswith("loss_smoke_exp8_vs_exp7") for p in pngs)
    assert any(p.startswith("scales_smoke_exp8") for p in pngs) and "saturation_smoke.png" in pngs


def test_seed_null_claims_and_spread(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1, 2))
    rep = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=500, figures=False)
    t = rep["tables"]
    null = t["seed_null_smoke"]
    # exp7 against itself: seeds (0,1), (0,2), (1,2); seed k flips 2k answers, so the pairs differ on 2, 4, 2 items
    assert sorted(zip(null.seed_a, null.seed_b, strict=True)) == [(0, 1), (0, 2), (1, 2)]
    assert (null.experiment == "exp7").all()
    assert sorted(np.round(null.discordant * 120).astype(int)) == [2, 2, 4]
    spread = t["seeds_smoke"]
    s7 = spread[(spread.experiment == "exp7") & (spread.what == "score")].iloc[0]
    scores = t["runs_smoke"].set_index(["experiment", "seed"])["bf16:mini_arc"].loc["exp7"]
    assert s7["n_seeds"] == 3 and s7["mean_pct"] == pytest.approx(scores.mean())
    assert s7["sd_pct"] == pytest.approx(scores.std(ddof=1))
    drops = t["drops_smoke"]
    assert len(drops) == 6 and "p_holm" not in drops  # per-seed rows are not one family of 6 tests
    # 6 and 20 flips one way per seed: the exact test and interval (fewer than 25 discordant items)
    assert set(drops["ci_method"]) == {"exact"} and (drops["n_lost"] == drops["quant_mode"].map(
        {"bf16": 6, "hif8": 20})).all() and (drops["n_gained"] == 0).all()
    assert drops.set_index(["quant_mode", "seed"]).loc[("bf16", 0), "p_mcnemar"] == pytest.approx(2 * 0.5 ** 6)


def _claim(claims, exp="exp8", against="baseline", mode="hif8", metric="accuracy", task="mini_arc"):
    c = claims[(claims.experiment == exp) & (claims.against == against) & (claims["mode"] == mode)
               & (claims.metric == metric)]
    return c[c.task == task].iloc[0] if metric != "train_loss" else c.iloc[0]


def test_claims_pool_seeds_into_one_exact_test_over_items(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1, 2))
    rep = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=100, figures=False)
    claims = rep["tables"]["claims_smoke"]
    # baseline scores from the files; each seed's hif8 evaluation loses 20 of 120 answers
    base = np.mean([pd.read_csv(runs / "smoke" / "exp7" / f"seed{k}" / "eval" / "bf16" / "samples_mini_arc.csv")
                    ["correct"].mean() * 100 for k in range(3)])
    c = _claim(claims)
    assert (c["n_seeds"], c["lost"], c["gained"], c["n_items"]) == (3, 60, 0, 360)
    # the same 20 items are lost in every seed: 20 items net lost, one exact test over items (not 60 flips)
    assert (c["flip_items"], c["items_lost"], c["items_gained"]) == (20, 20, 0)
    assert c["p_item"] == pytest.approx(2 * 0.5 ** 20)
    # a difference needs the crossed t test to reject too: the row's p is the larger of the two
    assert c["p"] == pytest.approx(max(c["p_item"], c["p_t"])) and c["p_t"] < 0.05
    assert c["cost"] == pytest.approx(20 / 120 * 100 / base * 100)
    assert c["ci_lo"] > 1.0 and c["equivalence"] == "not equivalent" and c["difference"] == "worse"
    # every interval is ordered and holds its estimate (accuracy's is mapped through the relative drop, which
    # turns the points interval around)
    rows = claims.dropna(subset=["cost", "ci_lo", "ci_hi", "ci90_lo", "ci90_hi"])
    assert len(rows) > 0
    assert ((rows.ci_lo <= rows.ci90_lo) & (rows.ci90_lo <= rows.cost) & (rows.cost <= rows.ci90_hi)
            & (rows.ci90_hi <= rows.ci_hi)).all(), rows[["metric", "ci_lo", "ci90_lo", "cost", "ci90_hi", "ci_hi"]]
    # the signed training-loss difference over the QAT phase (steps 6-40), % of the baseline's loss
    loss = _claim(claims, mode="train", metric="train_loss")
    signed = np.mean([0.01 * (s % 3) / (5.0 - 0.02 * s) * 100 for s in range(6, 41)])
    assert loss["cost"] == pytest.approx(signed) and loss["n_seeds"] == 3
    # quantized inference against the run's own bf16 evaluation: the 20 lost in hif8 minus the 6 lost in bf16
    own = _claim(claims, against="bf16_mode")
    assert (own["lost"], own["gained"], own["n_seeds"]) == (42, 0, 3) and own["counterpart"] == "exp8"
    assert not ((claims.against == "bf16_mode") & (claims.metric == "train_loss")).any()
    # per-item log-likelihoods are not in these files: said so, not guessed
    assert _claim(claims, metric="gold_ll")["equivalence"] == "not recorded in this run"
    # the minimum detectable cost depends on the claim's own runs only: an unrelated run changes nothing
    mde = rep["tables"]["mde_smoke"].set_index(["experiment", "against", "mode", "task", "metric"])
    make_fake_runs(runs, seeds=(0,), exps=("exp8",), tags={"exp8": "quant.history_len=16"})
    rep2 = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=100, figures=False)
    mde2 = rep2["tables"]["mde_smoke"]
    mde2 = mde2[mde2.run_tag == ""].set_index(["experiment", "against", "mode", "task", "metric"])
    pd.testing.assert_series_equal(mde["mde"], mde2.loc[mde.index, "mde"])


def test_claims_read_per_item_log_likelihoods_when_recorded(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0,))
    rng = np.random.default_rng(1)
    gold = {}
    for exp in ("exp7", "exp8"):
        f = runs / "smoke" / exp / "seed0" / "eval" / "bf16" / "samples_mini_arc.csv"
        s = pd.read_csv(f)
        s["gold_ll"] = -rng.random(len(s)) - (0.3 if exp == "exp8" else 0.0)
        s["gold_margin"] = rng.normal(size=len(s))
        s.to_csv(f, index=False)
        gold[exp] = s
    record_eval_files(runs)
    rep = report.build_report(runs, "smoke", tmp_path / "tables", tmp_path / "figures", n_boot=100, figures=False)
    c = _claim(rep["tables"]["claims_smoke"], mode="bf16", metric="gold_ll")
    cost = gold["exp7"]["gold_ll"] - gold["exp8"]["gold_ll"]
    assert c["cost"] == pytest.approx(cost.mean())
    half = st.t.ppf(0.975, len(cost) - 1) * cost.std(ddof=1) / math.sqrt(len(cost))  # one seed: t over its items
    assert c["ci_hi"] - c["cost"] == pytest.approx(half, rel=1e-5)
    assert (c["lost"], c["gained"]) == ((cost > 0).sum(), (cost < 0).sum())
    m = _claim(rep["tables"]["claims_smoke"], mode="bf16", metric="gold_margin")
    assert m["cost"] == pytest.approx((gold["exp7"]["gold_margin"] - gold["exp8"]["gold_margin"]).mean())


def test_holm_adjustment():
    # sorted 0.01, 0.03, 0.04: 3 * 0.01, 2 * 0.03, max(0.06, 1 * 0.04); NaN is no comparison
    assert report.holm([0.01, 0.04, 0.03, float("nan")])[:3] == pytest.approx([0.03, 0.06, 0.06])
    assert math.isnan(report.holm([0.01, float("nan")])[1])


def _holm_by_hand(ps):
    """Holm step-down: the i-th smallest of m p-values times (m - i), running maximum, capped at 1."""
    order = sorted(range(len(ps)), key=lambda i: ps[i])
    out, running = [0.0] * len(ps), 0.0
    for rank, i in enumerate(order):
        running = max(running, min(1.0, (len(ps) - rank) * ps[i]))
        out[i] = running
    return out


def _bh_by_hand(ps):
    """Benjamini-Hochberg step-up: the i-th smallest of m p-values times m / i, running minimum from the largest,
    capped at 1."""
    m = len(ps)
    order = sorted(range(m), key=lambda i: ps[i])
    out, running = [0.0] * m, 1.0
    for rank in range(m - 1, -1, -1):
        running = min(running, ps[order[rank]] * m / (rank + 1))
        out[order[rank]] = running
    return out


def test_claims_table_controls_errors_by_declared_family():
    from scipy import stats as st

    from hif8qat.report.claims import CLAIM_KEYS, claims_table

    def row(exp, against, counterpart, task, p):
        # three seeds' loss differences m + (-1, 0, 1): t = m sqrt(3) on 2 df has two-sided p-value p
        m = float(st.t.isf(p / 2, 2)) / math.sqrt(3)
        return [{"experiment": exp, "run_tag": "", "against": against, "counterpart": counterpart, "seed": seed,
                 "dirty": False, "mode": "train", "task": task, "metric": "train_loss", "n": 40, "recorded": True,
                 "diff": m + d, "var": 1e-4, "within_df": 7, "base": float("nan"), "lost": 0, "gained": 0}
                for seed, d in enumerate((-1.0, 0.0, 1.0))]

    rows = (row("exp8", "baseline", "exp7", "loss", 0.012) + row("exp8", "baseline", "exp7", "loss_b", 0.06)
            + row("exp3", "baseline", "exp1", "loss", 0.03) + row("exp4", "baseline", "exp1", "loss", 0.02)
            + row("exp4", "baseline", "exp1", "loss_b", 0.2) + row("exp4", "baseline", "exp1", "loss_c", 0.03))
    headline = {("exp8", "baseline", "exp7"), ("exp3", "baseline", "exp1")}
    df = claims_table(pd.DataFrame(rows), headline=headline)
    assert df["p"].round(6).tolist() == [0.012, 0.06, 0.03, 0.02, 0.2, 0.03]
    head = df["experiment"].isin(["exp8", "exp3"]).to_numpy()
    # the headline claims are one family (Holm over all their rows); the whole table, Benjamini-Hochberg
    assert df.loc[head, "p_holm_headline"].tolist() == pytest.approx(_holm_by_hand([0.012, 0.06, 0.03]), rel=1e-6)
    assert df.loc[~head, "p_holm_headline"].isna().all()
    assert df["p_bh"].tolist() == pytest.approx(_bh_by_hand(df["p"].tolist()), rel=1e-9)
    assert (df.loc[head, "p_adj"] == df.loc[head, "p_holm_headline"]).all()
    assert (df.loc[~head, "p_adj"] == df.loc[~head, "p_bh"]).all()
    assert df.loc[head, "family"].str.startswith("headline claims: Holm over 3").all()
    assert df.loc[~head, "family"].str.startswith("whole table: Benjamini-Hochberg over 6").all()
    # within the claim, for reference
    for _, g in df.groupby(CLAIM_KEYS, sort=False):
        assert g["p_holm"].tolist() == pytest.approx(_holm_by_hand(g["p"].tolist()), rel=1e-6)
    # the verdict reads its family's adjusted p: exp3's raw 0.03 passes BH over the table (0.045) but not Holm
    # over the headline claims (0.06)
    assert (df["difference"] == np.where(df["p_adj"] < 0.05, "worse", "not detected")).all()
    assert df.loc[head, "difference"].tolist() == ["worse", "not detected", "not detected"]
    assert df.loc[head, "p_bh"].iloc[2] < 0.05
    assert df.loc[~head, "difference"].tolist() == ["worse", "not detected", "worse"]


def test_anchor_table_puts_ours_next_to_published(tmp_path):
    d = tmp_path / "anchor" / "smollm2_135m" / "0shot"
    d.mkdir(parents=True)
    res = {t: {"metric": "acc_norm", "value": v, "stderr": 0.01, "n": n, "num_fewshot": 0}
           for t, v, n in (("arc_easy", 0.5, 2376), ("arc_challenge", 0.3, 1172), ("hellaswag", 0.4, 10042))}
    (d / "results.json").write_text(json.dumps({**res, "_meta": {}}))
    t = report.anchor_table(tmp_path / "anchor").set_index("task")
    pub = pd.read_csv(report.ANCHOR_PUBLISHED)
    assert set(pub["task"]) == {"hellaswag", "arc_average", "mmlu_continuation"} and pub["source"].str.contains(
        "huggingface.co/HuggingFaceTB").all()
    assert t.loc["arc_average", "ours smollm2_135m/0shot"] == pytest.approx(40.0)  # mean of ARC-Easy and -Challenge
    assert t.loc["arc_average", "n smollm2_135m/0shot"] == 2376 + 1172
    assert t.loc["hellaswag", "published SmolLM2-135M-Instruct"] == 40.9
    assert pd.isna(t.loc["mmlu_continuation", "ours smollm2_135m/0shot"])  # not evaluated: published alone


def _set_config(run_dir: Path, **dotted) -> None:
    cfg = yaml.safe_load((run_dir / "config_resolved.yaml").read_text())
    for key, value in dotted.items():
        sect, name = key.split("__")
        cfg.setdefault(sect, {})[name] = value
    (run_dir / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))


def test_a_baseline_of_another_seed_or_settings_is_no_pair_and_the_report_says_why(tmp_path):
    runs = make_fake_runs(tmp_path / "a", seeds=(0,), exps=("exp7",))
    make_fake_runs(tmp_path / "a", seeds=(1,), exps=("exp8",))
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    assert rep["tables"]["drops_smoke"].empty  # never exp8 seed 1 against exp7 seed 0
    pairing = rep["tables"]["pairing_smoke"].set_index("experiment").loc["exp8"]
    assert pairing["baseline_run"] == "" and "no run with seed 1" in pairing["baseline_unpaired"]
    assert "exp8/seed1 vs exp7 has no run with seed 1" in rep["message"]
    # a tagged baseline trained at another learning rate is no pair either
    runs = make_fake_runs(tmp_path / "b", tags={"exp7": "train.lr=1e-3", "exp8": "quant.history_len=16"})
    _set_config(runs / "smoke" / "exp7" / "seed0-train.lr=1e-3", train__lr=1e-3)
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    assert rep["tables"]["drops_smoke"].empty and "differs in train.lr" in rep["message"]
    # a tagged sweep point against the untagged baseline of its seed is the normal case
    runs = make_fake_runs(tmp_path / "c", tags={"exp8": "quant.history_len=16"})
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    drops = rep["tables"]["drops_smoke"]
    assert (drops.baseline == "exp7").all() and (drops.run_tag == "quant.history_len=16").all()


def test_seed_spread_groups_by_experiment_and_run_tag(tmp_path):
    # seed 0 untagged and seed 0 of a sweep point are two experiments, not two seeds of one
    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1))
    make_fake_runs(tmp_path / "runs", seeds=(0,), exps=("exp8",), tags={"exp8": "quant.history_len=16"})
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    spread = rep["tables"]["seeds_smoke"]
    s8 = spread[(spread.experiment == "exp8") & (spread.what == "score") & (spread["mode"] == "bf16")]
    assert dict(zip(s8.run_tag, s8.n_seeds, strict=True)) == {"": 2, "quant.history_len=16": 1}


def test_build_report_without_runs(tmp_path):
    rep = report.build_report(tmp_path / "nothing", "mini", tmp_path / "t", tmp_path / "f")
    assert rep["tables"] == {} and "no runs" in rep["message"]
    assert not (tmp_path / "t").exists()


def test_sweep_table_reads_the_knob_from_the_configs(tmp_path):
    runs = make_fake_runs(tmp_path / "runs", seeds=(0, 1))
    make_fake_runs(runs, seeds=(0, 1), exps=("exp8",), tags={"exp8": "quant.history_len=16"})
    for sd in (0, 1):  # the sweep point: history 16, and 10 more answers lost in hif8 mode
        d = runs / "smoke" / "exp8" / f"seed{sd}-quant.history_len=16"
        _set_config(d, quant__history_len=16)
        f = d / "eval" / "hif8" / "samples_mini_arc.csv"
        s = pd.read_csv(f)
        s.loc[np.flatnonzero(s["correct"] == 1)[:10], "correct"] = 0
        s.to_csv(f, index=False)
    record_eval_files(runs)
    rep = report.build_report(runs, "smoke", tmp_path / "t", tmp_path / "f", n_boot=100, figures=False)
    sw = rep["tables"]["sweeps_smoke"]
    assert set(sw["knob"]) == {"quant.history_len"} and set(sw["value_num"]) == {16.0, 64.0}
    acc = sw[(sw.metric == "accuracy") & (sw["mode"] == "hif8")].set_index("value_num")
    # cost from the files: mean over seeds of the lost points, in % of the baseline's mean score
    base = [pd.read_csv(runs / "smoke" / "exp7" / f"seed{k}" / "eval" / "bf16" / "samples_mini_arc.csv")
            ["correct"].mean() * 100 for k in (0, 1)]
    assert acc.loc[64.0, "cost"] == pytest.approx(20 / 120 * 100 / np.mean(base) * 100)
    assert acc.loc[16.0, "cost"] == pytest.approx(30 / 120 * 100 / np.mean(base) * 100)
    assert acc.loc[16.0, "baseline_seed_sd_pct"] == pytest.approx(np.std(base, ddof=1) / np.mean(base) * 100)
    assert report.plot_sweeps(sw, tmp_path / "f", "smoke") == [str(tmp_path / "f" / "sweep_smoke_exp8.png")]


def test_claims_pool_finished_runs_only(tmp_path):
    from hif8qat.report.claims import all_contrasts
    from hif8qat.report.pairing import pair_runs
    from hif8qat.report.sources import discover_runs, read_metrics

    runs_root = make_fake_runs(tmp_path / "runs", seeds=(0, 1))
    (runs_root / "smoke" / "exp8" / "seed1" / "DONE").unlink()  # exp8 seed 1 still training
    (runs_root / "smoke" / "exp7" / "seed0" / "DONE").unlink()  # exp7 seed 0 (exp8 seed 0's baseline) too
    runs = discover_runs(runs_root, "smoke")
    metrics = {str(r.path): read_metrics(r.path / "metrics.jsonl") for r in runs}
    baseline_of, parent_of, _, _ = pair_runs(runs, runs_root, "smoke")
    c = all_contrasts(runs, baseline_of, parent_of, metrics)
    # exp8 seed 0 keeps only its own hif8-vs-bf16 contrast; seed 1 has none
    assert set(zip(c["seed"], c["against"])) == {(0, "bf16_mode")}


def test_one_seed_rows_borrow_the_seed_variance_of_their_kind_or_give_direction_only():
    from scipy import stats as st

    from hif8qat.report.claims import ONE_SEED, claims_table

    def rows(exp, against, counterpart, diffs, var=1e-4):
        return [{"experiment": exp, "run_tag": "", "against": against, "counterpart": counterpart, "seed": seed,
                 "dirty": False, "mode": "train", "task": "loss", "metric": "train_loss", "n": 40,
                 "recorded": True, "diff": d, "var": var, "within_df": 7, "base": float("nan"), "lost": 0,
                 "gained": 0} for seed, d in enumerate(diffs)]

    three, five = [0.1, 0.3, 0.5], [0.0, 0.2, 0.1, 0.4, 0.3]
    table = claims_table(pd.DataFrame(rows("exp3", "baseline", "exp1", three) + rows("exp6", "baseline", "exp1", five)
                                      + rows("exp4", "baseline", "exp1", [0.4])
                                      + rows("exp9", "derived_from", "exp8", [0.4])))
    one = table[table.experiment == "exp4"].iloc[0]
    # the seed variance of the two multi-seed claims against the baseline, weighted by their df (2 and 4), on
    # the larger df (4): the seed's own step blocks (variance 1e-4, p ~ 0) no longer decide it
    pooled = (2 * np.var(three, ddof=1) + 4 * np.var(five, ddof=1)) / 6
    half = st.t.ppf(0.975, 4) * math.sqrt(pooled)
    assert (one["ci_lo"], one["ci_hi"], one["df"]) == pytest.approx((0.4 - half, 0.4 + half, 4))
    assert one["p"] == pytest.approx(2 * st.t.sf(0.4 / math.sqrt(pooled), 4))
    assert one["seed_var_source"].startswith("pooled from 2 multi-seed claim(s)")
    assert one["difference"] == ("worse" if one["p_adj"] < 0.05 else "not detected")
    # nothing of its kind (against the experiment it derives from) to borrow from: no verdict, no test
    bare = table[table.experiment == "exp9"].iloc[0]
    assert bare["equivalence"] == bare["difference"] == ONE_SEED and np.isnan(bare["p"]) and np.isnan(bare["mde"])
    assert bare["seed_var_source"].startswith("none")
    assert (table.loc[table.n_seeds > 1, "seed_var_source"] == "own seeds").all()
