"""Open what a run will read, cheaply, before its run folder exists: the local corpus, the model folder's
tokenizer and weights, remote code, and the wandb mode.

`preflight` checks that these things exist; this module reads just enough of each to know it is usable, so
that a bad line in a corpus, a model folder without a tokenizer, a truncated weight file or a refused
``auto_map`` is one ``error:`` line before any folder is made, not a library's traceback after. Nothing here
loads a model or a dataset: a corpus is read by its first bytes, a weight file by its header and its size.
"""

from __future__ import annotations

import json
import struct
import typing
from pathlib import Path

from huggingface_hub import try_to_load_from_cache

from hif8qat.config.data_source import local_files
from hif8qat.config.run_config import ConfigError, RunConfig
from hif8qat.models.hub import looks_like_path
from hif8qat.models.loading import (
    OPENPANGU_EMBEDDED_1B,
    PANGU_MODEL_TYPES,
    decide_remote_code,
    hub_offline,
    model_config_facts,
)

# Each corpus file is checked over its first bytes, not whole: a corpus may be many gigabytes.
CORPUS_HEAD_BYTES = 8 << 20
CORPUS_FILES_OPENED = 64
# Files from which transformers' AutoTokenizer builds a tokenizer (fast, or converted from a slow one's files).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json", "vocab.txt", "spiece.model",
                   "sentencepiece.bpe.model")
TOKENIZER_SUFFIXES = (".tiktoken",)
_SAFETENSORS_MAX_HEADER = 100 << 20  # the safetensors format's own limit on the JSON header


def _corpus_error(cfg: RunConfig, why: str) -> ConfigError:
    return ConfigError(f"invalid setting data.source={cfg.data.source!r}: {why}; allowed a local directory, file "
                       "or glob of .parquet/.jsonl/.json/.txt files holding documents with text (.jsonl: one JSON "
                       "object with a \"text\" string per line; .parquet: a \"text\" column)")


def _head(path: str) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(CORPUS_HEAD_BYTES)


def _json_lines_problem(path: str, data: bytes, complete: bool) -> tuple[str | None, bool]:
    """(what is wrong with these JSON lines, whether any holds text). The last line of a head cut short is
    not judged."""
    lines = data.split(b"\n")
    if not complete:
        lines = lines[:-1]
    has_text = False
    for number, raw in enumerate(lines, 1):
        if not raw.strip():
            continue
        try:
            record = json.loads(raw)
        except (UnicodeDecodeError, ValueError) as err:
            return f"{path} line {number} is not JSON ({err})", has_text
        if not isinstance(record, dict):
            return f"{path} line {number} is a JSON {type(record).__name__}, not an object", has_text
        text = record.get("text")
        if text is not None and not isinstance(text, str):
            return f"{path} line {number} has a \"text\" that is a {type(text).__name__}, not a string", has_text
        has_text = has_text or bool(text)
    return None, has_text


def _json_file_problem(path: str, data: bytes, complete: bool) -> tuple[str | None, bool]:
    """A .json file is JSON lines or, when small enough to be read whole, one JSON list of records."""
    if complete and data.lstrip().startswith(b"["):
        try:
            records = json.loads(data)
        except (UnicodeDecodeError, ValueError) as err:
            return f"{path} is not JSON ({err})", False
        if not all(isinstance(r, dict) for r in records):
            return f"{path} holds a list whose items are not all JSON objects", False
        return None, any(isinstance(r.get("text"), str) and r["text"] for r in records)
    return _json_lines_problem(path, data, complete)


def _parquet_problem(path: str) -> tuple[str | None, bool]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:  # the footer only
        schema = pq.read_schema(path)
    except (OSError, pa.ArrowException) as err:
        return f"{path} is not a readable parquet file ({err})", False
    if "text" not in schema.names:
        return f"{path} has no \"text\" column (columns: {', '.join(schema.names[:10])})", False
    if not (pa.types.is_string(schema.field("text").type) or pa.types.is_large_string(schema.field("text").type)):
        return f"{path} has a \"text\" column of type {schema.field('text').type}, not strings", False
    return None, True


def check_corpus(cfg: RunConfig) -> None:
    """A local data.source: every file opens as its kind, the first lines of JSON files parse as records, and
    the corpus holds some text (an empty .txt or JSON lines without a "text" field train on nothing).

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    source = cfg.data.source.strip()
    if source in ("mini", "fineweb"):
        return
    found = local_files(source)
    if found is None:
        return  # RunConfig.validate refuses a source that names nothing
    builder, files = found
    has_text = False
    for path in files[:CORPUS_FILES_OPENED]:
        if builder == "parquet":
            problem, text = _parquet_problem(path)
        else:
            try:
                data = _head(path)
            except OSError as err:
                raise _corpus_error(cfg, f"{path} cannot be read ({err.strerror or err})") from None
            complete = len(data) < CORPUS_HEAD_BYTES
            if builder == "text":
                problem, text = None, bool(data.strip())
            elif path.endswith(".jsonl"):
                problem, text = _json_lines_problem(path, data, complete)
            else:
                problem, text = _json_file_problem(path, data, complete)
        if problem:
            raise _corpus_error(cfg, problem)
        has_text = has_text or text
    if not has_text and len(files) <= CORPUS_FILES_OPENED:
        shown = files[0] if len(files) == 1 else f"its {len(files)} files"
        raise _corpus_error(cfg, f"{shown} hold no text (empty, or no record with a non-empty \"text\")")


def _model_folder(cfg: RunConfig) -> Path | None:
    """The folder transformers will read model.name from, when that can be known without the network: a local
    folder, or a hub snapshot in the cache while the hub is switched off (online, a missing file is fetched)."""
    name = cfg.model.name.strip()
    if name == "tiny" or name.startswith(("tiny:", "smollm2_135m")):
        return None  # built in code, or converted by the project itself
    local = Path(name).expanduser()
    if local.is_dir():
        return local
    if local.exists() or looks_like_path(name) or not hub_offline():
        return None
    hub_id = OPENPANGU_EMBEDDED_1B["hub_id"] if name == "openpangu_embedded_1b" else name
    try:
        hit = try_to_load_from_cache(hub_id, "config.json", revision=cfg.model.revision)
    except Exception:  # noqa: BLE001 - not cached: preflight.check_model says so
        return None
    return Path(hit).parent if isinstance(hit, str) else None


def safetensors_problem(path: Path) -> str | None:
    """Why a .safetensors file cannot load (None when its header parses and the file is as long as the header
    says), read from its first bytes and its size: the format is an 8-byte little-endian header length, a JSON
    header giving each tensor's [begin, end) in the data that follows, then the data.

    Args:
        path: the file.

    Returns:
        The reason, or None when the header parses and the file is as long as the header says."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as fh:
            prefix = fh.read(8)
            if len(prefix) < 8:
                return f"{path} is {size} bytes, too short for a safetensors header"
            (length,) = struct.unpack("<Q", prefix)
            if length > min(_SAFETENSORS_MAX_HEADER, size - 8):
                return f"{path}: its header claims {length} bytes, the file has {size}"
            header = json.loads(fh.read(length))
    except OSError as err:
        return f"{path} cannot be read ({err.strerror or err})"
    except (UnicodeDecodeError, ValueError) as err:
        return f"{path}: its header is not JSON ({err})"
    if not isinstance(header, dict):
        return f"{path}: its header is not a JSON object"
    end = 0
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        offsets = entry.get("data_offsets") if isinstance(entry, dict) else None
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(isinstance(o, int) for o in offsets)):
            return f"{path}: tensor {name!r} has no valid data_offsets in its header"
        end = max(end, offsets[1])
    if 8 + length + end != size:
        return (f"{path} is {size} bytes but its header describes {8 + length + end} (truncated or padded: "
                "download or copy it again)")
    return None


def check_model_files(cfg: RunConfig) -> None:
    """A model folder holds files a tokenizer is built from and weight files whose headers and sizes agree.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    folder = _model_folder(cfg)
    if folder is None:
        return
    name = cfg.model.name

    def refuse(why: str) -> None:
        raise ConfigError(f"invalid setting model.name={name!r}: {why}; allowed a save_pretrained folder holding "
                          "config.json, a tokenizer and complete weights")

    names = {p.name for p in folder.iterdir()}
    if not any(n in names for n in TOKENIZER_FILES) and not any(n.endswith(TOKENIZER_SUFFIXES) for n in names):
        refuse(f"{folder} has no tokenizer files (one of {', '.join(TOKENIZER_FILES)})")
    index = folder / "model.safetensors.index.json"
    if index.is_file() and not (folder / "model.safetensors").is_file():  # transformers prefers the single file
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (OSError, UnicodeDecodeError, ValueError, KeyError, TypeError, AttributeError) as err:
            refuse(f"{index} cannot be read ({type(err).__name__}: {err})")
        missing = [s for s in shards if not (folder / s).is_file()]
        if missing:
            refuse(f"{index} names weight files that are missing: {', '.join(missing[:5])}")
    weights = sorted(folder.glob("*.safetensors"))
    if not weights and not any(folder.glob("*.bin")) and not any(folder.glob("*.pt")):
        refuse(f"{folder} has no weight files (*.safetensors or *.bin)")
    for path in weights:
        problem = safetensors_problem(path)
        if problem:
            refuse(problem)


def check_remote_code(cfg: RunConfig) -> None:
    """A config.json that declares its own code (auto_map) loads only with model.trust_remote_code=true: refused
    here, as models.loading would refuse it, before any folder exists.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: the model declares its own code and model.trust_remote_code is not true."""
    config = model_config_facts(cfg.model.name.strip(), revision=cfg.model.revision)
    if isinstance(config, dict) and config.get("model_type") not in PANGU_MODEL_TYPES:  # openPangu: never its code
        decide_remote_code(cfg.model.name, config, cfg.model.trust_remote_code)


def wandb_modes() -> tuple[str, ...] | None:
    """The modes wandb.init accepts, read from wandb's own settings schema (None when it cannot tell).

    Returns:
        The modes, or None when it cannot tell."""
    try:
        from wandb.sdk.wandb_settings import Settings

        return typing.get_args(Settings.model_fields["mode"].annotation) or None
    except Exception:  # noqa: BLE001 - another wandb layout: wandb.init checks the mode itself
        return None


def check_wandb(cfg: RunConfig) -> None:
    """logger.wandb_mode among wandb's modes, when wandb is used (logger.wandb=true).

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: wandb is not installed, or the mode is not one of its own."""
    if not cfg.logger.wandb:
        return
    try:
        import wandb  # noqa: F401
    except ImportError:
        raise ConfigError("invalid setting logger.wandb=true: the wandb package is not installed; allowed false "
                          "(metrics.jsonl is written either way), or install wandb") from None
    modes = wandb_modes()
    if modes and cfg.logger.wandb_mode not in modes:
        raise ConfigError(f"invalid setting logger.wandb_mode={cfg.logger.wandb_mode!r}: allowed one of "
                          + ", ".join(modes))


def check_inputs(cfg: RunConfig) -> None:
    """Every check of this module that applies to a training stage.

    Args:
        cfg: the run's config.

    Raises:
        ConfigError: naming the setting and the allowed forms."""
    check_corpus(cfg)
    check_remote_code(cfg)
    check_model_files(cfg)
    check_wandb(cfg)
