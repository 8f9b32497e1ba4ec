"""The claims in experiments/README.md are the report's, computed from the committed run files."""

import pandas as pd
import pytest

from hif8qat import report

README = report.REPO / "experiments" / "README.md"
RUNS = report.REPO / "results" / "reference_runs"


@pytest.mark.slow  # the whole claims block, its scaling replays included, rebuilt: about two minutes
def test_readme_claims_are_the_reports():
    if not (RUNS / "mini").exists():
        pytest.skip("no committed reference runs")
    included = report.between_markers(README.read_text())
    assert included is not None, f"{README} lost its {report.CLAIMS_BEGIN} / {report.CLAIMS_END} markers"
    assert included == report.build_claims(RUNS, "mini").strip(), (
        "experiments/README.md's claims differ from the report's; rewrite them with "
        "`python -m hif8qat.report --runs-root results/reference_runs --readme experiments/README.md`")


def test_readme_block_replacement_keeps_the_rest():
    text = f"intro\n{report.CLAIMS_BEGIN}\nold claim\n{report.CLAIMS_END}\noutro\n"
    new = report.replace_between_markers(text, "new claim")
    assert new == f"intro\n{report.CLAIMS_BEGIN}\nnew claim\n{report.CLAIMS_END}\noutro\n"
    assert report.between_markers(new) == "new claim"
    with pytest.raises(ValueError, match="claims:begin"):
        report.replace_between_markers("no markers", "x")


def _claim_rows(title: str) -> tuple[str, list[dict[str, str]]]:
    """The section and the table rows of one claim in the README's block, as written there."""
    block = report.between_markers(README.read_text())
    head, _, rest = block.partition(f"#### {title}")
    assert rest, f"no claim {title!r} in {README}"
    section = rest.split("\n#### ")[0]
    lines = [ln for ln in section.splitlines() if ln.startswith("| ")]
    names = [c.strip() for c in lines[0].strip("|").split("|")]
    return section, [dict(zip(names, (c.strip() for c in ln.strip("|").split("|")))) for ln in lines[1:]]


def _flips(run_csv, base_csv, metric: str) -> tuple[int, int, set]:
    """Items the run does worse / better on than its counterpart, paired by document, and those documents."""
    run, base = pd.read_csv(run_csv, index_col="doc_id"), pd.read_csv(base_csv, index_col="doc_id")
    assert sorted(run.index) == sorted(base.index)
    col = "correct" if metric == "accuracy" else metric
    worse = base[col] - run.loc[base.index, col]  # accuracy: 1 = lost; log-likelihoods: lower in the run
    return int((worse > 0).sum()), int((worse < 0).sum()), set(worse.index[worse != 0])


def test_readme_final_recipe_claim_matches_counts_made_here_from_the_sample_files():
    """Truth, not only freshness: the near-lossless claim's seeds and flip counts recounted from the committed
    per-item files (exp8 in each mode against exp7's bf16 evaluation, paired by seed and document)."""
    if not (RUNS / "mini").exists():
        pytest.skip("no committed reference runs")
    section, rows = _claim_rows("Near-lossless final recipe: exp8 vs exp7")
    root = RUNS / "mini"
    seeds = sorted(int(d.name[4:]) for d in (root / "exp8").glob("seed*")
                   if (d / "DONE").exists() and (root / "exp7" / d.name / "DONE").exists())
    assert section.splitlines()[0].endswith(f"(seeds {', '.join(map(str, seeds))})") and len(seeds) >= 2
    checked = lost_acc = gained_acc = items_acc = 0
    for r in rows:
        if r["metric"] not in ("accuracy", "gold_ll", "gold_margin"):
            continue
        lost = gained = 0
        items: set = set()
        for k in seeds:
            name = f"samples_{r['task']}.csv"
            a, b, docs = _flips(root / "exp8" / f"seed{k}" / "eval" / r["mode"] / name,
                                root / "exp7" / f"seed{k}" / "eval" / "bf16" / name, r["metric"])
            lost, gained, items = lost + a, gained + b, items | docs
        # accuracy rows also name the distinct items behind the flips (the unit the item test counts)
        want = f"{lost} / {gained}" + (f" ({len(items)} items)" if r["metric"] == "accuracy" else "")
        assert r["lost / gained"] == want, r
        assert r["seeds"] == str(len(seeds)), r
        if r["metric"] == "accuracy":
            lost_acc, gained_acc, items_acc = lost_acc + lost, gained_acc + gained, items_acc + len(items)
        checked += 1
    assert checked == 18  # 2 modes x 3 tasks x 3 per-item metrics
    summary = (f"{lost_acc + gained_acc} flips in all ({lost_acc} lost, {gained_acc} gained) from {items_acc} "
               "distinct items")
    assert summary in section
