"""``python -m hif8qat.evaluate`` on a remote-code export (config.json ``auto_map`` and its own modeling
file, as an openPangu export has): refused with an error naming ``--trust-remote-code``, evaluated with it."""

from __future__ import annotations

import json
import uuid

import pytest

from hif8qat.artefacts import write_folder_manifest
from hif8qat.evaluate.cli import main
from hif8qat.rehearse.standins import write_remote_code_model


@pytest.fixture
def remote_export(tmp_path):
    # A unique folder name: transformers caches remote code in a module named after the folder.
    folder = write_remote_code_model(tmp_path / f"tiny_pangu_{uuid.uuid4().hex[:8]}", num_layers=2)
    write_folder_manifest(folder)  # as the pipeline's export stage leaves it: an export is read with its record
    return folder


@pytest.mark.parametrize("source", ["--export", "--model"])
def test_remote_code_is_refused_without_the_flag_and_the_error_names_it(remote_export, tmp_path, capsys, source):
    out = tmp_path / "out"
    rc = main([source, str(remote_export), "--modes", "bf16", "--tasks", "mini_arc", "--limit", "2",
               "--device", "cpu", "--out", str(out)])
    err = capsys.readouterr().err
    assert rc == 2
    assert "--trust-remote-code" in err and "auto_map" in err
    assert not (out / "bf16" / "results.json").exists() and not (out / "results.json").exists()


def test_remote_code_export_is_evaluated_with_the_flag(remote_export, tmp_path):
    out = tmp_path / "out"
    rc = main(["--export", str(remote_export), "--modes", "bf16", "--tasks", "mini_arc", "--limit", "2",
               "--batch-size", "4", "--device", "cpu", "--dtype", "fp32", "--out", str(out),
               "--trust-remote-code"])
    assert rc == 0
    results = json.loads((out / "bf16" / "results.json").read_text())
    assert results["mini_arc"]["n"] == 2
    assert results["_meta"]["mode"] == "bf16"
