"""make wheelhouse's kit is complete against the GPU node's real package set (benchmarks/gpu_node_packages.txt),
proven without the node and without an index: the node's packages are metadata-only distributions, the pipeline's
packages are metadata-only wheels made from this environment's installed ones (their real dependencies), and the
kit must then install with ``pip install --dry-run --no-index``."""

from __future__ import annotations

import importlib.metadata
import sys
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "benchmarks"))
import wheelhouse  # noqa: E402


def _metadata_wheels(folder: Path) -> dict[str, Path]:
    """A py3-none-any wheel holding only METADATA (verbatim: its Requires-Dist too) for every distribution
    installed here: an index of real dependency metadata that needs no network."""
    folder.mkdir()
    wheels = {}
    for dist in importlib.metadata.distributions():
        name, version = canonicalize_name(dist.metadata["Name"]), dist.version
        if name in wheels or name == "hif8qat":
            continue
        stem = f"{name.replace('-', '_')}-{version}"
        path = folder / f"{stem}-py3-none-any.whl"
        with zipfile.ZipFile(path, "w") as whl:
            whl.writestr(f"{stem}.dist-info/METADATA", dist.read_text("METADATA"))
            whl.writestr(f"{stem}.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
            whl.writestr(f"{stem}.dist-info/RECORD", "")
        wheels[name] = path
    return wheels


@pytest.fixture(scope="module")
def kit(tmp_path_factory):
    """The kit wheelhouse.py's closure makes for the committed node list, from the metadata-only index."""
    tmp = tmp_path_factory.mktemp("wheelhouse")
    index = _metadata_wheels(tmp / "index")
    node = wheelhouse.node_packages(ROOT / "benchmarks" / "gpu_node_packages.txt")
    wanted = [line for line in wheelhouse.wanted_pins(ROOT / "requirements.txt", ("pipeline", "test"))
              if canonicalize_name(Requirement(line).name) not in node]
    source = ["--no-index", "--find-links", str(tmp / "index")]
    node = wheelhouse.assumed_node(node, wanted, source, tmp)
    missing = wheelhouse.kit_packages(node, wanted, source, tmp)
    out = tmp / "kit"
    out.mkdir()
    for name in missing:
        (out / index[name].name).hardlink_to(index[name])
    (out / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in missing.items()))
    return node, missing, out, tmp


def test_the_kit_installs_over_a_metadata_only_copy_of_the_node_with_no_index(kit):
    node, missing, out, tmp = kit
    # what the node's image was seen to lack, each a dependency of a package the pipeline declares
    assert {"pydantic", "pydantic-core", "hydra-core", "omegaconf", "lm-eval", "datasets", "submitit"} <= set(missing)
    assert not set(missing) & set(node)  # nothing the node already holds is carried again (torch above all)
    proc = wheelhouse.check_kit(out, node, tmp / "ok")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert {canonicalize_name(i["metadata"]["name"]) for i in proc.report["install"]} == set(missing)


def test_a_kit_without_pydantic_fails_the_node_check(kit):
    node, missing, out, tmp = kit
    broken = tmp / "broken"
    broken.mkdir()
    for whl in out.glob("*.whl"):
        if not whl.name.startswith("pydantic-"):
            (broken / whl.name).hardlink_to(whl)
    (broken / "requirements.txt").write_text("".join(f"{n}=={v}\n" for n, v in missing.items() if n != "pydantic"))
    proc = wheelhouse.check_kit(broken, node, tmp / "broken-check")
    assert proc.returncode != 0 and "pydantic" in proc.stderr
