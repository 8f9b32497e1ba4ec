"""The notebooks execute headless (jupytext -> nbclient) on the reference data and a synthetic run folder."""

import re
from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

NB_DIR = Path(__file__).resolve().parents[2] / "notebooks"


def _execute(name: str, tmp_path: Path):
    nb = jupytext.read(NB_DIR / f"{name}.py")
    client = nbclient.NotebookClient(nb, timeout=120, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()
    return "\n".join(
        out.get("text", "") + str(out.get("data", {}).get("text/plain", ""))
        for cell in nb.cells if cell.cell_type == "code" for out in cell.get("outputs", [])
    )


@pytest.fixture
def fake_runs(tmp_path, monkeypatch):
    from test_report import make_fake_runs

    root = make_fake_runs(tmp_path / "runs", profile="smoke")
    monkeypatch.setenv("HIF8QAT_RUNS_ROOT", str(root))
    monkeypatch.setenv("HIF8QAT_PROFILE", "smoke")
    return root


def test_01_paper_tables(tmp_path):
    text = _execute("01_paper_tables", tmp_path)
    assert "0.1148" in text and "0.1205" in text and "0.4271" in text


def test_02_our_tables_with_runs(fake_runs, tmp_path):
    text = _execute("02_our_tables", tmp_path)
    # the fake runs: exp7 and exp8, exp8 evaluated in two modes on one task against exp7, one loss pair
    assert "2 runs, 2 drop rows, 1 APE rows" in text
    assert "drop_paired_pct" in text and "ape_all_pct" in text  # the drops and APE tables were displayed


def test_02_our_tables_without_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HIF8QAT_RUNS_ROOT", str(tmp_path / "none"))
    text = _execute("02_our_tables", tmp_path)
    assert "Nothing to show yet" in text


def test_03_scaling_dynamics(fake_runs, tmp_path):
    text = _execute("03_scaling_dynamics", tmp_path)
    assert "1 quantized runs" in text
    assert "skipping the replay" not in text  # hif8qat.scaling is importable here: the replay must run
    assert "saturation_events" in text
    for algo in ("max", "most_recent", "mean", "exp_smooth"):  # one row per estimator in the replay table
        assert re.search(rf"^\d+\s+{algo}\s+\d+\s", text, re.M), algo
