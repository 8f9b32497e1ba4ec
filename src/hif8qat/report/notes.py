"""The note written above each table of the report (what its columns mean, how its intervals are made)."""

from __future__ import annotations

from collections.abc import Mapping

import pandas as pd

from hif8qat.report.claims import CLAIM_KEYS, DEFAULT_MARGINS, METRIC_UNITS
from hif8qat.report.conditions import EVAL_DIFFERS_NOTE
from hif8qat.report.items import EXACT_BELOW_DISCORDANT


def multiple_comparisons(claims_df: pd.DataFrame, profile: str) -> tuple[str, int]:
    """How many claims and tests the claims table holds and how they are adjusted.

    Args:
        claims_df: the claims table.
        profile: the profile's name.

    Returns:
        ``(the note's text, the number of tests)``."""
    n_tests = int(claims_df["p"].notna().sum()) if "p" in claims_df else 0
    n_claims = int(claims_df.groupby(CLAIM_KEYS).ngroups) if len(claims_df) else 0
    n_head = int(claims_df["p_holm_headline"].notna().sum()) if "p_holm_headline" in claims_df else 0
    multiple = (f"Multiple comparisons ({n_claims} claims, {n_tests} tests in claims_{profile}, seeds pooled into "
                f"one test per task and metric): the rows of the headline claims (those the README states, "
                f"{n_head} tests) form one family, Holm-adjusted (p_holm_headline, family-wise); every row is also "
                "Benjamini-Hochberg-adjusted over the whole table (p_bh, false discovery rate), and the other "
                "rows' difference verdicts use it; `family` and p_adj name the one a verdict uses; p_holm: Holm "
                "within the claim, for reference. Per-seed rows (drops, ablations) are descriptive and "
                "unadjusted.")
    return multiple, n_tests


def table_notes(profile: str, *, n_boot: int, seed: int, last_frac: float, margins: Mapping[str, float] | None,
                multiple: str) -> dict[str, str]:
    """Every table's note.

    Args:
        profile: the profile's name.
        n_boot: bootstrap draws of the drop intervals.
        seed: random seed of the draws.
        last_frac: share of the common steps in the APE's "last" window.
        margins: equivalence margins per metric (None: DEFAULT_MARGINS).
        multiple: the text of :func:`multiple_comparisons`.

    Returns:
        Table name -> note."""
    margins_text = ", ".join(f"{k} {v:g} {METRIC_UNITS[k]}" for k, v in {**DEFAULT_MARGINS, **(margins or {})}.items())
    return {
        f"runs_{profile}": "One row per run; eval columns are <mode>:<task> scores in %. dirty: made from a tree "
                           "with uncommitted changes (run_info.json), so its commit does not hold its exact code. "
                           "skipped_updates: optimizer updates skipped for a non-finite gradient norm; every claim "
                           "that pairs such a run names it in the claims table's skipped_update_runs.",
        f"drops_{profile}": "Relative drop (%) = (base-quant)/base*100 against the baseline experiment's bf16 "
                            "evaluation, one row per seed. 95 % CI: exact (conditional McNemar, Clopper-Pearson) "
                            f"when fewer than {EXACT_BELOW_DISCORDANT} items differ (ci_method exact; significant: "
                            "exact p_mcnemar < 0.05), else a paired percentile bootstrap "
                            f"({n_boot} resamples of the common documents, seed {seed}; significant: CI excludes "
                            "0). n_lost / n_gained: items right in the baseline and wrong in the run, and the "
                            "reverse; discordant: their share. " + EVAL_DIFFERS_NOTE + " " + multiple,
        f"ape_{profile}": f"Training-loss APE (%) over all common steps, the last {last_frac:.0%} of them, and the "
                          "QAT phase (ape_qat_pct: steps from qat_from_step, the first step the quantized run "
                          "logged as quantized, i.e. after its BF16 warmup).",
        f"pairing_{profile}": "Every run's pairs: its BF16 baseline (same seed, same training settings apart "
                              "from quant.*) and the experiment it derives from (same seed, same training "
                              "settings apart from its declared changes). Logging, evaluation and checkpoint "
                              "cadence and run_tag do not count. An empty *_run names no pair; *_unpaired says "
                              "why, and the run is left out of that comparison.",
        f"paired_{profile}": "Per seed, the paired contrasts the claims pool: diff (accuracy: run minus "
                             "counterpart in points; train_loss: signed loss difference, % of the counterpart's "
                             "loss; gold_ll / gold_margin: counterpart minus run, nats per item; heldout_nll: "
                             "run minus counterpart per held-out token, % of the counterpart's held-out NLL), var "
                             "(its within-seed variance: items, blocks of 5 steps, or held-out windows; the claims "
                             "use it only for a training loss measured at one seed), "
                             "within_df (its degrees of freedom; inf for items), lost / gained (items right only "
                             "in the counterpart / only in the run; for the per-item metrics, items worse / "
                             "better), recorded (false: the run files lack the metric). A seed's task evaluated "
                             "differently from its counterpart (eval_differs in the drops and ablations tables) "
                             "has no row here: the report's message lists it.",
        f"sweeps_{profile}": "Sweeps: each experiment run under several run tags (e.g. a Hydra multirun over a "
                             "knob), the knobs that differ between them (from the saved configs), and each claim "
                             "metric's cost against the baseline per knob value, 95 % CI over seeds as in "
                             "claims; baseline_seed_sd_pct: the baseline's own sd over seeds (score, or final "
                             "loss) in % of its mean. Figures: sweep_<profile>_<experiment>.png.",
        f"heldout_{profile}": "Held-out text (hif8qat.evaluate.heldout; <run>/eval/heldout/): the heldout_nll rows of "
                              f"claims_{profile} (per token of a fixed held-out set, the same for every run of "
                              "the profile: the run's NLL of the actual next token against its baseline's, or its "
                              "quantized mode against its own bf16 mode; cost in % of the reference's held-out "
                              "NLL, seeds crossed with the windows, same Holm family, MDE and equivalence verdict as "
                              "the other claim metrics), with beside them, as means over the seeds: "
                              "nll_diff_nats (the cost "
                              "in nats per token), kl_mean / kl_p99 (each seed's mean and 99th percentile over "
                              "tokens of KL(P_reference || P_run), nats) and top1_agreement (share of tokens whose "
                              "most likely next token is the same); kl_ci_lo / kl_ci_hi and top1_ci_lo / top1_ci_hi: "
                              "95 % intervals of the mean KL and top-1 agreement from the same crossed seeds x "
                              "windows model (descriptive, no test).",
        f"seeds_{profile}": "Spread over seeds: mean, sd, min and max of each score and each drop (%).",
        f"seed_null_{profile}": "Seed null: each BF16 experiment against itself at another seed (bf16 evaluations): "
                                "relative drop (%) with a paired bootstrap 95 % CI. Only the seed differs, so "
                                "these drops are the noise floor of any claim. " + EVAL_DIFFERS_NOTE,
        f"claims_{profile}": "Each run against its baseline and against the experiment it derives from, pooled "
                             "over same-seed pairs, and a quantized run's quantized evaluation against its own "
                             "bf16 one (against = bf16_mode): cost (positive = the run is worse; "
                             "accuracy: relative drop, % "
                             "of the baseline score; train_loss: signed per-step loss difference over the QAT "
                             "phase, % of the baseline loss; gold_ll / gold_margin: nats per item; heldout_nll: "
                             "paired per-token NLL difference on the held-out text, % of the counterpart's "
                             "held-out NLL) with a 95 % CI from the design's own units, fixed by the metric: "
                             "train_loss, t on the per-seed means (k - 1 df); accuracy, gold_ll, gold_margin and "
                             "heldout_nll, seeds x items (or held-out windows) as crossed random effects, since "
                             "every seed scores the same items and windows (method of moments, components not "
                             "above 0 within 1e-9 of the mean squares' scale set to 0, Satterthwaite df; ci_method "
                             "names it, df gives it; seed_var / unit_var / resid_var: the components). One seed: "
                             "no seed variance of its own: it borrows the seed variance of the multi-seed claims "
                             "of the same "
                             "comparison (against), mode, task and metric (their components averaged with weights "
                             "k - 1, df the largest claim's, since claims share runs; train_loss: their variance "
                             "over seeds of the per-seed differences, which replaces the seed's own step-block "
                             "variance), on that df; seed_var_source says where from, and where nothing can "
                             "be borrowed both verdicts read \"one seed: direction only\" and p stays empty. "
                             "Accuracy: the hull of the crossed t interval and the interval that inverts the exact "
                             "item test (conditional on the changed items and their sizes, a share theta of them "
                             "changing for the better; at one seed the Clopper-Pearson interval of exact McNemar), "
                             "and a difference only where both the item test and the crossed t test reject (p the "
                             "larger), so that interval and test cannot disagree; where the homogeneity check of "
                             "the row rejects (homog_p < 0.05), the crossed t interval and test alone. "
                             "homog_chi2 / homog_df / homog_p: the item test assumes the items' net flips "
                             "independent; a shift shared by one seed's items would make the seeds' shares of gains "
                             "among their flips differ: chi-square of the seeds x (lost, gained) table, p "
                             "conditional on its margins (9,999 draws); claim_homog_*: the same summed over the "
                             "claim's accuracy rows, p from their joint conditional null (9,999 draws; not summed "
                             "across claims, which share runs). changed_by_size: items by the size of their "
                             "net change over the seeds (size:count). "
                             "boot_lo / boot_hi: hierarchical bootstrap 95 % interval (seeds and units "
                             "resampled, 2000 times, seed 0) where there are at least 5 seeds. equivalence: two "
                             "one-sided tests (90 % CI) against `margin`; difference: one test per row, adjusted "
                             "in its family (`family`, p_adj; see the multiple-comparisons note) "
                             "(accuracy: exact permutation test over items of each item's net flips "
                             "summed over the seeds, so an item flipping in several seeds counts once, with its "
                             "weight; lost / gained: flips summed over seeds; flip_items: distinct items behind "
                             "them; items_lost / items_gained: items whose net change is a loss / a gain; else the "
                             "t test of the interval). mde: the cost that test detects with 80 % power (accuracy: "
                             "under the flip model of mde_" + profile + "). n_items: scored pairs summed over "
                             "seeds; n_units: items or windows common to every seed. Margins: "
                             f"{margins_text}. Runs made from a tree with uncommitted changes count in dirty_runs.",
        "anchor": "The base SmolLM2-135M on the full real benchmarks (make anchor; our weights: the Instruct model "
                  "dequantized from Q4_1, lm-eval's prompts) next to the scores HuggingFace published (lighteval, "
                  "0-shot; results/anchor/published_smollm2_135m.csv names the source). ARC (Average) = mean of "
                  "ARC-Easy and ARC-Challenge.",
        f"reach_{profile}": "What this profile can show of the paper's effects: each claim row here (against the BF16 "
                            "baseline; bf16 mode) that the paper measured for the same pair of runs. paper_effect: "
                            "training loss, the signed per-step difference over the paper's QAT phase in % of the "
                            "baseline's loss (authors' logs); accuracy, the relative drop of the newest summary "
                            "holding the pair (few-shot, MMLU lettered: another form than here). needed: the seeds "
                            "(train_loss: n x (mde / effect)^2) or the items (accuracy: the exact item test under "
                            "the flip model of mde_" + profile + ", the paper's drop as items losing in every seed "
                            "on top of items changing by chance at the rate and sizes seen here; the seeds share "
                            "their items, so more seeds do not add items) that would resolve the paper's effect at "
                            "80 % power, two-sided alpha 0.05.",
        f"mde_{profile}": "Minimum detectable cost per claim (80 % power, two-sided alpha 0.05) under the test "
                          "the claim uses: accuracy, the exact permutation test over items, under a stated flip "
                          "model (an effect of a items makes a further a items lose in every seed, on top of the "
                          "items whose net change here is not zero, which keep their sizes and take either sign), "
                          "in % of the baseline score and in points (a / n_units); the others, the t test of their "
                          "interval. Only the claim's own runs enter. The paper's drops are 0.2-0.6 % of the "
                          "score, its loss APE 0.11 %.",
        f"telemetry_{profile}": "Scaling telemetry from metrics.jsonl, per run and role: share of steps and of "
                                "calls whose amax outgrew the delayed estimate (amax/estimate > 1), the largest "
                                "ratio, and the clipped values on statistics calls (clipped_total, "
                                "clipped_per_stats_call): for HiF8 the overflow |x*s| >= 40960 (at target 15 only "
                                "a tensor 2731x its estimate overflows), for FP8 |x*s| > max (at margin 0 every "
                                "call with amax/estimate > 1 clips its largest values).",
        f"ablations_{profile}": "Each run against the experiment it derives from (same seed): relative drop (%) with "
                                "a paired bootstrap 95 % CI, in bf16 mode and, when both are quantized, in the "
                                "quantized mode (`mode` hif8: each run in its own format); `changes` lists the "
                                "settings that differ. exp7 vs exp1 isolates the learning rate (forgetting), "
                                "exp9 vs exp8 the BF16 warmup, exp10/exp11 the FP8 format (vs exp2/exp8), "
                                "exp12/exp13 just-in-time scaling (vs exp8/exp2): a positive drop there is what the "
                                "oracle loses against the delayed estimator, a negative one how far the delayed "
                                "estimator is from the oracle. " + EVAL_DIFFERS_NOTE,
        f"scaling_pairs_{profile}": "One-factor pairs that change only the element format, the scale algorithm "
                                    "or the scale targets (quant.format / quant.margin / quant.algo / "
                                    "quant.target), side by side: format, algorithm and the targets A/W/G, share "
                                    "of quantizer calls whose amax outgrew the estimate, clipped values per "
                                    "statistics call (HiF8 overflow, FP8 clipping; all roles pooled, and the "
                                    "gradients alone: G_*), QAT-phase loss APE against the common baseline and "
                                    f"the final loss. Accuracy differences with CIs: ablations_{profile}.",
        f"vs_base_{profile}": "Each run's bf16 evaluation against the untrained base model's "
                              f"(results/base_model/{profile}/): relative drop (%) with a paired bootstrap 95 % CI. "
                              "Drops common to quantized and BF16 runs at one learning rate are forgetting, not "
                              "quantization. " + EVAL_DIFFERS_NOTE,
        f"replay_{profile}": "Each estimator replayed (interval 1) on the same per-call amax traces "
                             "recorded in a run's "
                             "final scaler state: share of calls whose amax exceeded the delayed estimate, how far, "
                             "and the share beyond the 2-bit-mantissa tier (ratio > 128/15).",
    }
