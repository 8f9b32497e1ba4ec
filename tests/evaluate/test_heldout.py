"""Held-out per-token distances (hif8qat.evaluate.heldout, hif8qat.stats.heldout): the per-token values against a
float64 oracle from plain forwards, the block interval against simulation, the files, pooling and the eval-stage
hook."""

import json
import math
import shutil
import types

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from conftest import mini_corpus_missing, write_quantized_export
from scipy import stats as st

from hif8qat.artefacts import write_folder_manifest
from hif8qat.evaluate import heldout
from hif8qat.models.loading import build_tiny_llama
from hif8qat.report.claims import DEFAULT_MARGINS, ONE_SEED
from hif8qat.stats import heldout as heldout_stats

ONE_THREAD = True


def _oracle(model_a, model_b, windows):
    """Per token, from one plain forward per window and a hand-written float64 log-softmax."""
    nll_a, nll_b, kl, agree = [], [], [], []
    with torch.no_grad():
        for w in windows:
            la = model_a(w[None, :-1]).logits[0].double()
            lb = model_b(w[None, :-1]).logits[0].double()
            lpa = (la - (la - la.max(-1, keepdim=True).values).exp().sum(-1, keepdim=True).log()
                   - la.max(-1, keepdim=True).values)
            lpb = (lb - (lb - lb.max(-1, keepdim=True).values).exp().sum(-1, keepdim=True).log()
                   - lb.max(-1, keepdim=True).values)
            t = w[1:]
            idx = torch.arange(len(t))
            nll_a.append(-lpa[idx, t])
            nll_b.append(-lpb[idx, t])
            kl.append((lpa.exp() * (lpa - lpb)).sum(-1))
            agree.append(la.argmax(-1) == lb.argmax(-1))
    return [torch.cat(x).numpy() for x in (nll_a, nll_b, kl, agree)]


def test_token_stats_match_a_float64_oracle():
    a, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=1)
    b, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=2)
    a.eval(), b.eval()
    windows = torch.randint(3, a.config.vocab_size, (5, 17), generator=torch.Generator().manual_seed(0))
    # a batch size that does not divide the windows: the last batch is short
    cols = heldout.stream_token_stats({"a": a, "b": b}, [("a", "b")], windows, batch_windows=2)
    nll_a, nll_b, kl, agree = _oracle(a, b, windows)
    assert len(cols["nll_a"]) == 5 * 16
    np.testing.assert_allclose(cols["nll_a"], nll_a, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cols["nll_b"], nll_b, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(cols["kl_b_vs_a"], kl, rtol=1e-4, atol=1e-6)
    assert kl.min() > 1e-4  # two random models: a real divergence, not a trivially zero one
    np.testing.assert_array_equal(cols["top1_b_vs_a"], agree.astype(np.int8))
    np.testing.assert_array_equal(cols["window"], np.repeat(np.arange(5), 16))
    np.testing.assert_array_equal(cols["target"], windows[:, 1:].reshape(-1).numpy())


def test_a_model_against_itself_has_zero_kl_and_full_agreement():
    m, _ = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=3)
    m.eval()
    windows = torch.randint(3, m.config.vocab_size, (3, 9), generator=torch.Generator().manual_seed(1))
    cols = heldout.stream_token_stats({"x": m, "y": m}, [("x", "y")], windows)
    assert np.all(cols["kl_y_vs_x"] == 0) and np.all(cols["top1_y_vs_x"] == 1)
    s = heldout_stats.comparison_summary(cols["nll_x"], cols["nll_y"], cols["kl_y_vs_x"], cols["top1_y_vs_x"], 8)
    assert s["nll_diff"]["mean"] == 0 and s["kl"]["p99"] == 0 and s["top1"]["mean"] == 1


def _windows(rng, n_windows, length, window_sd, token_sd=1.0, mean=0.0):
    """Per-token values with a shared effect per window (correlated tokens), window-major."""
    return (mean + rng.normal(0, window_sd, n_windows)[:, None] + rng.normal(0, token_sd, (n_windows, length))).ravel()


def test_block_interval_is_a_t_interval_on_the_window_means_with_windows_minus_one_df():
    # the textbook batch-means interval, written out here: the windows' means are the independent values
    rng = np.random.default_rng(3)
    for nw, length in ((2, 8), (5, 16), (24, 32)):
        x = _windows(rng, nw, length, 0.4, mean=0.1)
        r = heldout_stats.block_mean(x, length)
        w = x.reshape(nw, length).mean(1)
        se = w.std(ddof=1) / math.sqrt(nw)
        assert r["n_windows"] == nw and r["df"] == nw - 1
        assert r["se"] == pytest.approx(se, rel=1e-12)
        for conf, lo, hi in ((0.95, "ci_lo", "ci_hi"), (0.90, "ci90_lo", "ci90_hi")):
            q = st.t.ppf(0.5 + conf / 2, nw - 1)
            assert (r[lo], r[hi]) == pytest.approx((w.mean() - q * se, w.mean() + q * se), rel=1e-12)
        assert r["p"] == pytest.approx(2 * st.t.sf(abs(w.mean()) / se, nw - 1), rel=1e-9)
    # one window has no spread to estimate: no interval
    assert math.isnan(heldout_stats.block_mean(np.ones(8), 8)["df"])


def test_block_interval_matches_the_spread_of_the_mean_and_covers():
    rng = np.random.default_rng(0)
    nw, length, sd_w = 24, 32, 0.5
    true_sd = math.sqrt((sd_w**2 + 1.0 / length) / nw)  # of the token mean under this model
    means, ses, iid, cover = [], [], [], 0
    for _ in range(600):
        r = heldout_stats.block_mean(_windows(rng, nw, length, sd_w, mean=0.3), length)
        means.append(r["mean"])
        ses.append(r["se"])
        iid.append(r["se_iid"])
        cover += r["ci_lo"] < 0.3 < r["ci_hi"]
    assert np.std(means) == pytest.approx(true_sd, rel=0.1)
    assert np.sqrt(np.mean(np.square(ses))) == pytest.approx(true_sd, rel=0.1)
    assert 0.92 < cover / 600 < 0.98
    assert np.mean(iid) < 0.5 * true_sd  # tokens taken as independent: far too narrow


def test_block_interval_shrinks_with_windows_and_widens_with_correlation():
    rng = np.random.default_rng(1)
    length = 64
    few = np.mean([heldout_stats.block_mean(_windows(rng, 16, length, 0.3), length)["se"] for _ in range(50)])
    many = np.mean([heldout_stats.block_mean(_windows(rng, 64, length, 0.3), length)["se"] for _ in range(50)])
    assert many == pytest.approx(few / 2, rel=0.15)
    # same marginal variance per token, correlated within windows or not
    corr = np.mean([heldout_stats.block_mean(_windows(rng, 32, length, 0.6, 0.8), length)["se"] for _ in range(50)])
    ind = np.mean([heldout_stats.block_mean(_windows(rng, 32, length, 0.0, 1.0), length)["se"] for _ in range(50)])
    assert corr > 3 * ind


def test_mde_is_the_shift_the_test_detects_with_80_percent_power():
    rng = np.random.default_rng(2)
    nw, length = 20, 16
    # one sample's MDE varies with its variance estimate (19 df): its mean over samples is the test's MDE
    mde = np.mean([heldout_stats.block_mean(_windows(rng, nw, length, 0.4), length)["mde"] for _ in range(200)])
    hits = sum(heldout_stats.block_mean(_windows(rng, nw, length, 0.4, mean=mde), length)["p"] < 0.05
               for _ in range(400))
    assert 0.7 < hits / 400 < 0.9


def test_tokens_file_round_trips(tmp_path):
    rng = np.random.default_rng(3)
    cols = {"window": np.repeat(np.arange(4), 8), "pos": np.tile(np.arange(8), 4), "target": rng.integers(0, 999, 32),
            "nll_a": rng.gamma(2, 1.5, 32).astype(np.float32), "kl_b_vs_a": (rng.random(32) * 1e-6).astype(np.float32),
            "top1_b_vs_a": rng.integers(0, 2, 32).astype(np.int8)}
    p = tmp_path / "tokens.csv.gz"
    heldout.write_tokens(p, cols)
    back = heldout.read_tokens(p)
    for k, v in cols.items():
        np.testing.assert_array_equal(back[k].to_numpy(), v)
    first = p.read_bytes()
    heldout.write_tokens(p, cols)
    assert p.read_bytes() == first  # same values, same bytes


def _heldout_row(seed, summary, units=None):
    """A paired-contrast row as the report's held-out reader writes it (test input for claims_table); ``units``:
    the per-window costs (:func:`hif8qat.stats.heldout.window_costs`)."""
    pct = summary["nll_diff_pct"]
    return {"experiment": "exp8", "run_tag": "", "against": "baseline", "counterpart": "exp7", "seed": seed,
            "dirty": False, "mode": "hif8", "task": "heldout", "metric": "heldout_nll", "n": summary["n_tokens"],
            "recorded": True, "diff": pct["mean"], "var": pct["var"], "within_df": pct["n_windows"] - 1,
            "base": summary["nll_ref"], "lost": 0, "gained": 0, "units": units}


def test_pooled_over_seeds_crosses_seeds_with_windows():
    from hif8qat.report.claims import claims_table

    rng = np.random.default_rng(4)
    rows, pct = [], []
    for seed, shift in enumerate((0.01, 0.03, 0.02)):
        ref = rng.gamma(3, 1, 32 * 16)
        other = ref + shift + rng.normal(0, 1e-4, ref.size)
        s = heldout_stats.comparison_summary(ref, other, np.zeros(ref.size), np.ones(ref.size), 16)
        tokens = pd.DataFrame({"window": np.repeat(np.arange(32), 16), "nll_baseline": ref, "nll_hif8": other})
        rows.append(_heldout_row(seed, s, heldout_stats.window_costs(tokens, "baseline", "hif8")))
        pct.append((other - ref).mean() / ref.mean() * 100)
    wide = claims_table(pd.DataFrame(rows), {"heldout_nll": 5.0}).iloc[0]
    # the windows barely differ, so the seeds' spread is all there is: about t on the 3 seed means, 2 df
    half = st.t.ppf(0.975, 2) * np.std(pct, ddof=1) / math.sqrt(3)
    assert wide["cost"] == pytest.approx(np.mean(pct))
    assert (wide["ci_lo"], wide["ci_hi"]) == pytest.approx((np.mean(pct) - half, np.mean(pct) + half), rel=0.02)
    assert "32 windows crossed" in wide["ci_method"] and wide["equivalence"].startswith("equivalent")
    tight = claims_table(pd.DataFrame(rows), {"heldout_nll": 0.05}).iloc[0]
    assert tight["equivalence"] == "not equivalent"


# ------------------------------------------------------------------------------ run folders, hook
def _run(root, experiment, baseline, quantized, seed=0):
    d = root / "smoke" / experiment / f"seed{seed}"
    d.mkdir(parents=True)
    cfg = {"seed": seed, "run_tag": "", "profile": {"name": "smoke", "steps": 8},
           "experiment": {"name": experiment, "baseline": baseline},
           "model": {"name": "tiny:2", "trust_remote_code": None}, "data": {"source": "mini", "cache_dir": None},
           "quant": {"enabled": quantized, "scope": "mlp"},
           "train": {"seq_len": 32, "autocast": "none", "device": "cpu", "lr": 1e-4},
           "eval": {"device": "cpu", "dtype": "fp32", "modes": ["bf16", "hif8"] if quantized else ["bf16"]}}
    (d / "config_resolved.yaml").write_text(yaml.safe_dump(cfg))
    if quantized:
        write_quantized_export(d / "export", scope="mlp", seed=11)
    else:
        model, tok = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=11)
        model.save_pretrained(d / "export")
        tok.save_pretrained(d / "export")
        write_folder_manifest(d / "export")
    return d


@pytest.fixture
def runs(tmp_path):
    reason = mini_corpus_missing()  # the held-out windows come from the offline corpus
    if reason:
        pytest.skip(reason)
    return tmp_path, _run(tmp_path, "exp7", None, False), _run(tmp_path, "exp8", "exp7", True)


def test_run_against_its_baseline_and_its_own_modes(runs):
    root, base, run = runs
    doc = heldout.compute_heldout(run)
    assert doc["baseline_run"] == "exp7/seed0" and doc["baseline_skipped"] is None
    assert set(doc["comparisons"]) == {"bf16_vs_baseline", "hif8_vs_baseline", "hif8_vs_bf16"}
    assert doc["windows"]["n_tokens"] == heldout.heldout_window_count(32) * 32 == 4096
    on_disk = json.loads((run / "eval" / "heldout" / "summary.json").read_text())
    assert on_disk["provenance"]["versions"]["torch"] and on_disk["config"]["experiment"]["name"] == "exp8"
    # same weights on both sides: the unquantized export equals its baseline token for token
    same = doc["comparisons"]["bf16_vs_baseline"]["summary"]
    assert same["nll_diff"]["mean"] == 0 and same["kl"]["max"] == 0 and same["top1"]["mean"] == 1
    q = doc["comparisons"]["hif8_vs_bf16"]["summary"]
    assert q["kl"]["mean"] > 0
    # every number is recomputed from the committed token file
    table = heldout.read_tokens(run / "eval" / "heldout" / "tokens.csv.gz")
    again = heldout.summarize_tokens(table, [("bf16", "hif8")], 32)["hif8_vs_bf16"]["summary"]
    assert again == q
    assert table["kl_hif8_vs_bf16"].to_numpy(np.float64).mean() == pytest.approx(q["kl"]["mean"])


def test_eval_hook_skips_a_baseline_without_export_and_covers_modes_evaluated_later(runs, capsys):
    root, base, run = runs
    shutil.rmtree(base / "export")
    cfg = types.SimpleNamespace(quant=types.SimpleNamespace(enabled=True), force=False, results_root=str(root),
                                eval=types.SimpleNamespace(modes=["bf16", "hif8"]))
    doc = heldout.after_eval(cfg, run, device="cpu", dtype="fp32")
    assert "no export" in doc["baseline_skipped"] and list(doc["comparisons"]) == ["hif8_vs_bf16"]
    assert heldout.after_eval(cfg, run, device="cpu", dtype="fp32") is None  # done once, not redone
    assert "already done" in capsys.readouterr().out
    # once the baseline has an export, the eval stage pairs the run with it
    model, tok = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=11)
    model.save_pretrained(base / "export")
    tok.save_pretrained(base / "export")
    write_folder_manifest(base / "export")
    doc = heldout.after_eval(cfg, run, device="cpu", dtype="fp32")
    assert doc["baseline_run"] == "exp7/seed0" and doc["baseline_skipped"] is None
    # exactly the three comparisons: the baseline's two added, the one made before kept, nothing else
    assert sorted(doc["comparisons"]) == ["bf16_vs_baseline", "hif8_vs_baseline", "hif8_vs_bf16"]
    # a comparison made in bf16 mode only, then hif8 evaluated later (stage=eval with eval.modes=[bf16,hif8]):
    # its comparisons are added then; an eval of bf16 alone afterwards neither redoes nor narrows them
    heldout.compute_heldout(run, modes=["bf16"])
    doc = heldout.after_eval(cfg, run, device="cpu", dtype="fp32")
    assert set(doc["comparisons"]) == {"bf16_vs_baseline", "hif8_vs_baseline", "hif8_vs_bf16"}
    assert heldout.after_eval(cfg, run, device="cpu", dtype="fp32") is None
    cfg.eval.modes = ["bf16"]
    assert heldout.after_eval(cfg, run, device="cpu", dtype="fp32") is None
    assert "hif8" in heldout.read_summary(run)["models"]
    # an unquantized run computes nothing in the eval stage
    cfg.quant.enabled = False
    assert heldout.after_eval(cfg, base, device="cpu", dtype="fp32") is None


def test_report_keeps_only_the_baseline_they_were_computed_against(runs):
    from hif8qat.report.claims import claims_table, heldout_contrasts, heldout_table

    root, base, run = runs
    doc = heldout.compute_heldout(run)
    info = types.SimpleNamespace(path=run, experiment="exp8", seed=0, config={"run_tag": ""}, info={})
    other = types.SimpleNamespace(path=root / "smoke" / "exp7" / "seed1", experiment="exp7", config={}, info={})
    paired = heldout_contrasts(info, types.SimpleNamespace(path=base, experiment="exp7", config={}, info={}))
    assert {(r["against"], r["mode"]) for r in paired} == {("baseline", "bf16"), ("baseline", "hif8"),
                                                            ("bf16_mode", "hif8")}
    unpaired = heldout_contrasts(info, other)
    assert [(r["against"], r["mode"]) for r in unpaired] == [("bf16_mode", "hif8")]
    # each row carries the summary's numbers as written (% of the reference NLL, window df)
    q = doc["comparisons"]["hif8_vs_bf16"]["summary"]
    row = unpaired[0]
    assert row["diff"] == pytest.approx(100 * q["nll_diff"]["mean"] / q["nll_ref"])
    assert row["within_df"] == 4096 // 32 - 1 and row["kl_mean"] == q["kl"]["mean"]
    contrasts = pd.DataFrame(paired)
    table = heldout_table(claims_table(contrasts), contrasts)
    assert len(table) == 3 and set(table["against"]) == {"baseline", "bf16_mode"}
    assert table["ci_method"].str.contains("one seed: t over 128 windows").all()
    assert table["top1_agreement"].between(0, 1).all()


# ----------------------------------------------------------------------------- the hif8 mode itself
class _OracleLinear(torch.nn.Module):
    """A linear layer whose input and weight are rounded to HiF8 by en_dtypes at fixed scales: Q(t * s) / s."""

    def __init__(self, linear, scale_a: float, scale_w: float):
        super().__init__()
        self.linear, self.scale_a, self.scale_w = linear, scale_a, scale_w

    @staticmethod
    def _q(t: torch.Tensor, s: float) -> torch.Tensor:
        import en_dtypes

        scaled = (t.float() * s).numpy()
        return torch.from_numpy(scaled.astype(en_dtypes.hifloat8).astype(np.float32)) / s

    def forward(self, x):
        return torch.nn.functional.linear(self._q(x, self.scale_a), self._q(self.linear.weight, self.scale_w),
                                          self.linear.bias)


def test_hif8_mode_logits_equal_a_frozen_scale_forward_rounded_by_en_dtypes(tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hif8qat.evaluate.loading import load_for_eval

    export = write_quantized_export(tmp_path / "export", scope="mlp", seed=5)
    doc = json.loads((export / "hif8qat_quant.json").read_text())
    state = load_file(str(export / "hif8qat_scalers.safetensors"))
    target = doc["config"]["target_fwd"]
    plain = AutoModelForCausalLM.from_pretrained(export, dtype=torch.float32).eval()
    for name in doc["converted"]:
        scales = {}
        for role in ("A", "W"):
            scales[role] = float(state[f"{name}.{role}.scale_block"][0])
            # the frozen scale is the max estimator's: target over the largest recorded amax
            assert scales[role] == pytest.approx(target / float(state[f"{name}.{role}.history"].max()), rel=1e-6)
        parent, _, leaf = name.rpartition(".")
        owner = plain.get_submodule(parent)
        setattr(owner, leaf, _OracleLinear(getattr(owner, leaf), scales["A"], scales["W"]))
    quant, _ = load_for_eval(export, "hif8")
    unquant, _ = load_for_eval(export, "bf16")
    ids = torch.randint(3, plain.config.vocab_size, (2, 24), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want, got, base = plain(ids).logits, quant(ids).logits, unquant(ids).logits
    assert (got - base).abs().max() > 1e-3  # quantization changes the logits: the comparison is not vacuous
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_report_cli_takes_a_heldout_margin_and_applies_it_to_the_heldout_claims(runs, capsys):
    from hif8qat.report.cli import main
    from hif8qat.report.readme import CLAIMS_BEGIN, CLAIMS_END

    root, base, run = runs
    with pytest.raises(SystemExit) as bad:
        main(["--runs-root", str(root), "--margin", "heldout=1"])
    assert bad.value.code == 2 and "heldout_nll" in capsys.readouterr().err
    heldout.compute_heldout(run)
    for d in (base, run):
        (d / "DONE").touch()

    def claims(out, *margin):
        assert main(["--runs-root", str(root), "--profile", "smoke", "--tables", str(out / "t"),
                     "--figures", str(out / "f"), *margin]) == 0
        return pd.read_csv(out / "t" / "heldout_smoke.csv"), pd.read_csv(out / "t" / "claims_smoke.csv")

    held, table = claims(root / "wide", "--margin", "heldout_nll=0.5")
    assert len(held) == 3 and (held["margin"] == 0.5).all()
    # the other metrics keep their default margins
    assert (table.loc[table["metric"] == "train_loss", "margin"] == DEFAULT_MARGINS["train_loss"]).all()
    # one seed and no multi-seed claim to borrow a seed variance from: no verdict at any margin (how the margin
    # decides a verdict: test_pooled_over_seeds_crosses_seeds_with_windows)
    assert (held["equivalence"] == ONE_SEED).all() and (held["difference"] == ONE_SEED).all()
    held, _ = claims(root / "tight", "--margin", "heldout_nll=0.001")
    assert (held["margin"] == 0.001).all() and (held["equivalence"] == ONE_SEED).all()
    # the README's claims section takes the same margin (its held-out rows and the margins it lists)
    readme = root / "README.md"
    readme.write_text(f"intro\n{CLAIMS_BEGIN}\nold\n{CLAIMS_END}\n")
    assert main(["--runs-root", str(root), "--profile", "smoke", "--readme", str(readme),
                 "--margin", "heldout_nll=0.5"]) == 0
    section = readme.read_text()
    assert "heldout_nll 0.5 % of held-out NLL" in section
    rows = [ln for ln in section.splitlines() if ln.startswith("| ") and "| heldout_nll |" in ln]
    assert len(rows) == 3 and all(f"| 0.5 | {ONE_SEED} |" in ln for ln in rows)
