"""Supported versions: pyproject.toml declares them once; run.py refuses a library outside its range with one
``error:`` line and exit status 2 before any work; make test-compat's requirements come from the same ranges."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement

from hif8qat.launch import versions

tomllib = pytest.importorskip("tomllib")  # Python 3.11+; on 3.10 the ranges come from the installed metadata

ROOT = Path(__file__).resolve().parents[2]


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _fake_dist(folder: Path, name: str, version: str) -> None:
    """An installed-package record claiming ``version``: importlib.metadata finds it first on the path, while the
    real library is still the one imported."""
    info = folder / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")


def test_the_core_and_the_pipeline_declare_their_ranges_and_the_check_reads_them():
    project = _pyproject()
    core = {Requirement(r).name: Requirement(r).specifier for r in project["dependencies"]}
    pipeline = {Requirement(r).name: Requirement(r).specifier for r in project["optional-dependencies"]["pipeline"]}
    assert core["torch"].contains("2.11.0") and not core["torch"].contains("2.10.2")
    assert pipeline["transformers"].contains("5.17.0") and not pipeline["transformers"].contains("5.16.0")
    for name in ("hydra-core", "omegaconf", "lm_eval", "datasets", "pandas", "scipy"):
        assert name in pipeline
    assert "transformers" not in core and "hydra-core" not in core  # the library core stays pipeline-free
    wanted = versions.declared()
    assert set(wanted) == {versions.canonicalize_name(n) for n in [*core, *pipeline]}  # optional extras unchecked
    assert versions.problems(wanted) == []  # the pinned environment the suite runs in is supported


def test_the_pins_lie_inside_the_declared_ranges():
    wanted = versions.declared(extras=("pipeline", "wandb", "test"))
    for line in (ROOT / "requirements.txt").read_text().splitlines():
        body = line.split("#", 1)[0].strip()
        if not body:
            continue
        pin = Requirement(body)
        declared = wanted.get(versions.canonicalize_name(pin.name))
        if declared is not None:
            assert declared.specifier.contains(next(iter(pin.specifier)).version), (pin, declared)


def test_a_missing_or_unsupported_package_is_one_message_each():
    wanted = {"torch": Requirement("torch>=99"), "no-such-package-here": Requirement("no-such-package-here>=1")}
    found = versions.problems(wanted)
    assert len(found) == 2
    assert found[0].startswith("no-such-package-here is not installed (supported: >=1)")
    assert found[1] == f"torch {versions.md.version('torch')} is not supported (supported: >=99)"


def test_a_cuda_build_of_a_supported_torch_is_supported(tmp_path, monkeypatch):
    monkeypatch.setattr(versions, "_installed", lambda name: "2.11.0+cu130")
    assert versions.problems({"torch": Requirement("torch<3,>=2.11")}) == []
    monkeypatch.setattr(versions, "_installed", lambda name: "2.10.1+cu128")
    assert versions.problems({"torch": Requirement("torch<3,>=2.11")}) == [
        "torch 2.10.1+cu128 is not supported (supported: >=2.11,<3)"]


def test_the_compat_requirements_pin_the_lowest_versions_and_keep_torch_first():
    text = "# a comment\ntorch==2.13.0\nnumpy==2.4.6\ntransformers==5.24.0  # why\nlm_eval[hf]==0.4.13\n"
    out = versions.lowest_requirements(text, ["torch", "transformers"]).splitlines()
    lowest_torch = versions.lowest("torch")
    assert out == ["# a comment", f"torch=={lowest_torch}", "numpy==2.4.6",
                   f"transformers=={versions.lowest('transformers')}", "lm_eval[hf]==0.4.13"]
    assert Requirement(_pyproject()["dependencies"][0]).specifier.contains(lowest_torch)


@pytest.mark.parametrize("name,version", [("torch", "2.10.0"), ("transformers", "5.16.0")])
def test_run_py_refuses_an_unsupported_version_before_any_work(tmp_path, name, version):
    _fake_dist(tmp_path / "site", name, version)
    results = tmp_path / "results"
    env = {**os.environ, "PYTHONPATH": f"{tmp_path / 'site'}{os.pathsep}{ROOT / 'src'}"}
    proc = subprocess.run([sys.executable, str(ROOT / "run.py"), "experiment=exp8", "profile=smoke", "stage=all",
                           f"results_root={results}"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)
    supported = versions.supported(versions.declared()[name])
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [f"error: {name} {version} is not supported (supported: {supported})"]
    assert proc.stdout == "" and not results.exists()


@pytest.mark.slow
def test_pip_install_into_an_environment_with_torch_needs_no_index_and_declares_the_core(tmp_path):
    """``pip install .`` beside an existing torch: nothing to download (the core needs torch, numpy and
    safetensors only), and the installed metadata carries the ranges the check reads."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True)
    py = env / "bin" / "python"
    purelib = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                             capture_output=True, text=True, check=True).stdout.strip()
    # this interpreter's packages (torch among them) behind the new environment's own
    import site
    Path(purelib, "existing.pth").write_text("\n".join(site.getsitepackages()) + "\n")
    clean = {k: v for k, v in os.environ.items() if not k.startswith("PIP_") and k != "PYTHONPATH"}
    source = tmp_path / "source"  # a copy: setuptools builds in the source folder, never in this checkout
    source.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(ROOT / "src", source / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-build-isolation", "--no-deps",
                           "--target", str(tmp_path / "target"), str(source)], capture_output=True, text=True,
                          env=clean, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = subprocess.run([str(py), "-m", "pip", "install", "--no-index", "--no-build-isolation", "--dry-run",
                           "--quiet", "--report", "-", str(source)], capture_output=True, text=True, env=clean,
                          cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    # the core's dependencies are met by what is installed: the package alone would be installed
    assert [i["metadata"]["name"] for i in json.loads(proc.stdout)["install"]] == ["hif8qat"]
    [info] = [d for d in (tmp_path / "target").glob("hif8qat-*.dist-info")]
    requires = [line.split(":", 1)[1].strip() for line in (info / "METADATA").read_text().splitlines()
                if line.startswith("Requires-Dist:")]
    core = [r for r in requires if "extra ==" not in r]
    assert sorted(Requirement(r).name for r in core) == ["numpy", "safetensors", "torch"]
    probe = "import sys; sys.path.insert(0, sys.argv[1]); import hif8qat.formats, hif8qat.launch.versions as v; " \
            "print(v.problems(v.declared(pyproject=__import__('pathlib').Path('/nonexistent'))))"
    out = subprocess.run([str(py), "-c", probe, str(tmp_path / "target")], capture_output=True, text=True,
                         env=clean, cwd=tmp_path, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr[-3000:]
