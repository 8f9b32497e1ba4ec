"""The claims in experiments/README.md are the report's, computed from the committed run files."""

import pytest

from hif8qat import report

README = report.REPO / "experiments" / "README.md"
RUNS = report.REPO / "results" / "reference_runs"


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
