"""The notebooks execute headless (jupytext -> nbclient) on the reference data and a synthetic run folder."""

from pathlib import Path

import pytest

jupytext = pytest.importorskip("jupytext")
nbclient = pytest.importorskip("nbclient")

NB_DIR = Path(__file__).resolve().parents[1] / "notebooks"


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
    assert "exp8" in text and "drop" in text


def test_02_our_tables_without_runs(tmp_path, monkeypatch):
    monkeypatch.setenv("HIF8QAT_RUNS_ROOT", str(tmp_path / "none"))
    text = _execute("02_our_tables", tmp_path)
    assert "Nothing to show yet" in text


def test_03_scaling_dynamics(fake_runs, tmp_path):
    text = _execute("03_scaling_dynamics", tmp_path)
    assert "1 quantized runs" in text
    assert "saturation_events" in text or "skipping the replay" in text
