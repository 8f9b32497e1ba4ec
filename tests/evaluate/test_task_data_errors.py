"""A mini task's data file cut mid-record, and a corrupt datasets cache of it, are errors that name the file or
the cache and say how to rebuild, instead of blaming the evaluation settings."""

from __future__ import annotations

import shutil

import datasets
import pytest

from hif8qat.errors import RunError
from hif8qat.evaluate.minitasks.loader import HERE, load_local_json

SOURCE = HERE / "data" / "mini_arc_test.jsonl"


def _copy(tmp_path):
    path = tmp_path / "mini_arc_test.jsonl"
    shutil.copy(SOURCE, path)
    return path


def test_a_data_file_cut_mid_record_is_named_with_its_line(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = _copy(tmp_path)
    text = path.read_text()
    path.write_text(text[: text.index("\n", len(text) // 2) + 40])  # the last record cut in its middle
    n_lines = path.read_text().count("\n") + 1
    with pytest.raises(RunError, match=rf"{path}, line {n_lines}, is not a whole JSON record.*minitasks.generate"):
        load_local_json({"test": str(path)})


def test_a_corrupt_datasets_cache_is_named_with_how_to_rebuild_it(tmp_path, monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "cache"))
    path = _copy(tmp_path)
    assert len(load_local_json({"test": str(path)})["test"]) > 0  # builds the cache
    arrows = list((tmp_path / "cache").rglob("*.arrow"))
    assert arrows
    for arrow in arrows:
        arrow.write_bytes(arrow.read_bytes()[:100])  # cut while written
    with pytest.raises(RunError, match=rf"datasets cache .*Remove {tmp_path / 'cache' / 'json'}"):
        load_local_json({"test": str(path)})
