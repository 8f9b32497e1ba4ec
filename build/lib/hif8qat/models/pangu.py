"""openPangu-Embedded as transformers' own Llama.

The hub repo's remote code (modeling_openpangu_dense.py) imports ``LossKwargs``, which the pinned transformers no
longer has, and takes ``past_key_value(s)`` where Llama takes ``cache``. The architecture is Llama's (RMSNorm,
rotary, grouped-query attention with a bias on q/k/v/o when ``bias``, SwiGLU without bias) with the same parameter
names, so the checkpoint loads as ``LlamaForCausalLM`` from its config mapped and its safetensors as they are; its
SentencePiece tokenizer (remote code too) is converted once to a fast tokenizer. No remote code runs.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download

from hif8qat.runs.downloads import cache_root

log = logging.getLogger(__name__)

# PanguEmbeddedConfig's defaults where they differ from LlamaConfig's: a config.json that omits a key means these.
_PANGU_DEFAULTS = {"bias": True, "rope_theta": 16000000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                   "max_position_embeddings": 32768, "tie_word_embeddings": False, "attention_dropout": 0.0,
                   "vocab_size": 153376, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 45892}
_PANGU_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads")
_PANGU_DROPPED = ("auto_map", "architectures", "model_type", "transformers_version", "_name_or_path")


def pangu_llama_config(pangu: dict):
    """The ``LlamaConfig`` of an openPangu config.json: ``bias`` becomes ``attention_bias`` (all four attention
    projections), the MLP has no bias, every other key is kept; the remote-code keys are dropped."""
    from transformers import LlamaConfig

    missing = [k for k in _PANGU_REQUIRED if k not in pangu]
    if missing:
        raise ValueError(f"openPangu config.json lacks {', '.join(missing)}: not a complete model config")
    kwargs = {**_PANGU_DEFAULTS, **{k: v for k, v in pangu.items() if k not in _PANGU_DROPPED}}
    kwargs["attention_bias"] = bool(kwargs.pop("bias"))
    kwargs["mlp_bias"] = False
    if "torch_dtype" in kwargs:
        kwargs["dtype"] = kwargs.pop("torch_dtype")
    return LlamaConfig(**kwargs, architectures=["LlamaForCausalLM"])


def load_pangu_as_llama(source: str, config: dict, *, dtype: torch.dtype, revision: str | None = None):
    """``LlamaForCausalLM`` with the checkpoint's own safetensors; every tensor must land on a parameter and every
    parameter must come from the checkpoint."""
    from transformers import LlamaForCausalLM

    model, info = LlamaForCausalLM.from_pretrained(source, config=pangu_llama_config(config), dtype=dtype,
                                                   revision=revision, use_safetensors=True, output_loading_info=True)
    bad = {k: sorted(v)[:8] for k, v in info.items() if k in ("missing_keys", "unexpected_keys", "mismatched_keys")
           and v}
    if bad:
        raise ValueError(f"openPangu checkpoint {source} does not map onto Llama's parameters: {bad}")
    return model


def _repo_file(source: str, filename: str, revision: str | None) -> Path | None:
    """A file of a local model folder or hub repo (downloaded to the hub cache); None when it has none."""
    local = Path(source).expanduser()
    if local.is_dir():
        return local / filename if (local / filename).is_file() else None

    try:
        return Path(hf_hub_download(source, filename, revision=revision))
    except Exception:  # noqa: BLE001 - absent from the repo (or unreachable): the caller decides
        return None


def pangu_tokenizer(source: str, *, revision: str | None = None):
    """openPangu's tokenizer as a fast (Rust ``tokenizers``) tokenizer, converted once from the repo's SentencePiece
    ``tokenizer.model`` and cached under ``$HIF8QAT_CACHE/tokenizers``, keyed by the files' hash.

    The repo's own ``PanguTokenizer`` is remote code over ``sentencepiece`` (a slow, per-string Python loop); the
    conversion follows the SentencePiece model's normalizer and merges, so ids are the same (BOS first, as
    ``add_bos_token``), tested on a SentencePiece model built in the tests.
    """
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    model_file = _repo_file(source, "tokenizer.model", revision)
    if model_file is None:
        raise FileNotFoundError(f"model.name={source!r}: an openPangu checkpoint needs its tokenizer.model")
    config_file = _repo_file(source, "tokenizer_config.json", revision)
    config_bytes = config_file.read_bytes() if config_file else b"{}"
    digest = hashlib.sha256(model_file.read_bytes() + b"\0" + config_bytes).hexdigest()[:16]
    out = cache_root() / "tokenizers" / f"openpangu-{digest}"
    if not (out / "tokenizer.json").is_file():
        out.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=out.parent, prefix=".convert-") as tmp:
            spm_dir, fast_dir = Path(tmp) / "spm", Path(tmp) / "fast"
            spm_dir.mkdir()
            shutil.copyfile(model_file, spm_dir / "tokenizer.model")
            settings = json.loads(config_bytes)
            for key in ("auto_map", "tokenizer_class"):  # the remote class is what is being replaced
                settings.pop(key, None)
            (spm_dir / "tokenizer_config.json").write_text(json.dumps(settings))
            TokenizersBackend.from_pretrained(spm_dir).save_pretrained(fast_dir)
            try:
                os.rename(fast_dir, out)  # atomic; another process may have won the race
            except OSError:
                if not (out / "tokenizer.json").is_file():
                    raise
        log.info("openPangu tokenizer converted to a fast tokenizer in %s", out)
    tok = TokenizersBackend.from_pretrained(out)
    if tok.pad_token is None and tok.eos_token is not None:
        tok.pad_token = tok.eos_token
    return tok
