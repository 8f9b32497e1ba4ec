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
import re
import shutil
import tempfile
from pathlib import Path

import torch
from huggingface_hub import hf_hub_download
from sentencepiece import sentencepiece_model_pb2
from tokenizers import Regex, Tokenizer, decoders, normalizers, pre_tokenizers
from tokenizers.models import BPE, Unigram

from hif8qat.runs.downloads import cache_root

log = logging.getLogger(__name__)

# PanguEmbeddedConfig's defaults where they differ from LlamaConfig's: a config.json that omits a key means these.
# They are the 7B's (rope_theta 16e6, untied head); the 1B's own config.json sets its values (below).
_PANGU_DEFAULTS = {"bias": True, "rope_theta": 16000000.0, "rms_norm_eps": 1e-5, "hidden_act": "silu",
                   "max_position_embeddings": 32768, "tie_word_embeddings": False, "attention_dropout": 0.0,
                   "vocab_size": 153376, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 45892}

#: openPangu-Embedded-1B as published (the paper's model): the config.json keys that fix its shape and numerics.
#: 26 blocks, hidden 1536, SwiGLU MLP 6144, GQA with 12 query and 6 KV heads of 128, biased q/k/v/o, vocabulary
#: 153,376, rope_theta 4e6 and a tied head (its checkpoint has no lm_head/output matrix: its GGUF holds 26 x 13
#: block tensors + embedding + final norm = 340). Sources: the hub repo's config.json, and the same sizes in
#: MindSpeed's 1B fine-tuning script (num-layers 26, hidden 1536, ffn 6144, 12 heads, 6 query groups, kv-channels
#: 128, rotary-base 4000000, padded vocab 153376, no untie flag). The one definition of the 1B's shape: the tests,
#: the GPU check and the estimates build their stand-ins from it (shrunk only where they say so).
OPENPANGU_EMBEDDED_1B_CONFIG = {
    "vocab_size": 153376, "hidden_size": 1536, "intermediate_size": 6144, "num_hidden_layers": 26,
    "num_attention_heads": 12, "num_key_value_heads": 6, "bias": True, "rope_theta": 4000000.0,
    "tie_word_embeddings": True, "rms_norm_eps": 1e-5, "hidden_act": "silu", "max_position_embeddings": 32768,
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 45892,
}
#: Its tokenizer's special tokens (tokenizer_config.json): BOS ``<s>`` (id 1) prepended (``add_bos_token``), no EOS
#: appended, pad ``<unk>`` (id 0), EOS ``[unused10]`` (id 45892), the token the data pipeline ends documents with.
OPENPANGU_SPECIAL_TOKENS = {"bos_token": "<s>", "eos_token": "[unused10]", "pad_token": "<unk>",
                            "unk_token": "<unk>", "add_bos_token": True, "add_eos_token": False}


def pangu_parameter_count(config: dict) -> int:
    """Parameters of an openPangu config (a tied head counted once), from its sizes alone.

    Args:
        config: the config.json as a dict.

    Returns:
        The count.
    """
    c = {**_PANGU_DEFAULTS, **config}
    h, inter, heads, kv = (c["hidden_size"], c["intermediate_size"], c["num_attention_heads"],
                           c["num_key_value_heads"])
    d = c.get("head_dim") or h // heads
    attn = 2 * h * heads * d + 2 * h * kv * d + (heads * d + 2 * kv * d + h if c["bias"] else 0)
    block = attn + 3 * h * inter + 2 * h
    head = 0 if c["tie_word_embeddings"] else c["vocab_size"] * h
    return c["num_hidden_layers"] * block + c["vocab_size"] * h + head + h


_PANGU_REQUIRED = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                   "num_key_value_heads")
_PANGU_DROPPED = ("auto_map", "architectures", "model_type", "transformers_version", "_name_or_path")


def pangu_llama_config(pangu: dict):
    """The ``LlamaConfig`` of an openPangu config.json: ``bias`` becomes ``attention_bias`` (all four attention
    projections), the MLP has no bias, every other key is kept; the remote-code keys are dropped.

    Args:
        pangu: the config.json as a dict.

    Returns:
        The ``LlamaConfig``.
    """
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
    parameter must come from the checkpoint.

    Args:
        source: the checkpoint's folder or hub id.
        config: its config.json as a dict.
        dtype: the parameters' dtype.
        revision: the hub revision.

    Returns:
        The model.
    """
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


#: Bumped when :func:`sentencepiece_pipeline` changes the ids it gives: part of the converted tokenizer's cache key.
_PIPELINE_VERSION = b"spm-pipeline-1"


def sentencepiece_pipeline(model_file: Path):
    """A ``tokenizers.Tokenizer`` that encodes like ``SentencePieceProcessor.encode`` on ``model_file`` (no BOS).

    It follows the model's own normalizer spec, in SentencePiece's order: the precompiled character map, then
    (``remove_extra_whitespaces``) spaces stripped at both ends and runs of them collapsed, spaces escaped as
    U+2581, and (``add_dummy_prefix``) one U+2581 prepended to non-empty text. BPE merges are ranked by the merged
    piece's score, as SentencePiece picks the best-scored pair first; user-defined pieces are emitted whole. The
    rules are those of transformers 5.24's ``build_tokenizer_from_spm_proto``, written here so that every supported
    transformers version gives the same ids.

    Args:
        model_file: the ``tokenizer.model``.

    Returns:
        The tokenizer.
    """
    proto = sentencepiece_model_pb2.ModelProto()
    proto.ParseFromString(Path(model_file).read_bytes())
    spec, trainer = proto.normalizer_spec, proto.trainer_spec
    normal_type, user_defined_type = 1, 4  # sentencepiece_model.proto's ModelProto.SentencePiece.Type
    user_defined = [p.piece for p in proto.pieces if p.type == user_defined_type]
    if trainer.model_type == trainer.BPE:
        scored = {p.piece: (-p.score, i) for i, p in enumerate(proto.pieces) if p.type == normal_type}
        ranked = sorted((rank, piece[:k], piece[k:]) for piece, rank in scored.items() for k in range(1, len(piece))
                        if piece[:k] in scored and piece[k:] in scored)
        model = BPE(vocab={p.piece: i for i, p in enumerate(proto.pieces)},
                    merges=[(left, right) for _, left, right in ranked], unk_token=trainer.unk_piece,
                    fuse_unk=True, byte_fallback=trainer.byte_fallback, ignore_merges=bool(user_defined))
    elif trainer.model_type == trainer.UNIGRAM:
        model = Unigram([(p.piece, p.score) for p in proto.pieces], unk_id=trainer.unk_id,
                        byte_fallback=trainer.byte_fallback)
    else:
        raise ValueError(f"{model_file}: SentencePiece model type {trainer.model_type} (only BPE and unigram)")
    tk = Tokenizer(model)

    steps = [normalizers.Precompiled(spec.precompiled_charsmap)] if spec.precompiled_charsmap else []
    if spec.remove_extra_whitespaces:  # only spaces: SentencePiece leaves newlines and tabs alone
        steps += [normalizers.Replace(Regex(r"\A +| +\z"), ""), normalizers.Replace(Regex(" {2,}"), " ")]
    if spec.escape_whitespaces:
        steps.append(normalizers.Replace(" ", "\u2581"))
    if spec.add_dummy_prefix:  # Prepend leaves empty text empty, as SentencePiece does
        steps.append(normalizers.Prepend("\u2581"))
    tk.normalizer = normalizers.Sequence(steps)
    if user_defined:  # SentencePiece never merges across a user-defined piece
        pattern = "|".join(re.escape(p) for p in sorted(user_defined, key=len, reverse=True))
        tk.pre_tokenizer = pre_tokenizers.Split(Regex(pattern), behavior="isolated")
    steps = [decoders.Replace("\u2581", " ")] + ([decoders.ByteFallback()] if trainer.byte_fallback else [])
    steps.append(decoders.Fuse())
    if spec.add_dummy_prefix:
        steps.append(decoders.Strip(content=" ", left=1, right=0))
    tk.decoder = decoders.Sequence(steps)
    return tk


def pangu_tokenizer(source: str, *, revision: str | None = None):
    """openPangu's tokenizer as a fast (Rust ``tokenizers``) tokenizer, converted once from the repo's SentencePiece
    ``tokenizer.model`` and cached under ``$HIF8QAT_CACHE/tokenizers``, keyed by the files' hash.

    The repo's own ``PanguTokenizer`` is remote code over ``sentencepiece`` (a slow, per-string Python loop). The
    special tokens and ``add_bos_token`` come from transformers' loader; the encoding pipeline is built here from
    the SentencePiece model (:func:`sentencepiece_pipeline`), so ids are SentencePiece's (BOS first) whatever
    transformers version converts it: transformers 5.17's own conversion ignores the model's normalizer spec (no
    dummy prefix, no whitespace removal) and gives other ids. Tested on a SentencePiece model built in the tests.

    Args:
        source: the checkpoint's folder or hub id.
        revision: the hub revision.

    Returns:
        The fast tokenizer.
    """
    from transformers.tokenization_utils_tokenizers import TokenizersBackend

    model_file = _repo_file(source, "tokenizer.model", revision)
    if model_file is None:
        raise FileNotFoundError(f"model.name={source!r}: an openPangu checkpoint needs its tokenizer.model")
    config_file = _repo_file(source, "tokenizer_config.json", revision)
    config_bytes = config_file.read_bytes() if config_file else b"{}"
    # The builder's version is in the key: a cache converted by an older one (with other ids) is not reused.
    digest = hashlib.sha256(_PIPELINE_VERSION + b"\0" + model_file.read_bytes() + b"\0" + config_bytes).hexdigest()[:16]
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
            tok = TokenizersBackend.from_pretrained(spm_dir)
            backend = tok.backend_tokenizer  # its added (special) tokens and BOS post-processor are kept
            pipeline = sentencepiece_pipeline(model_file)
            backend.model, backend.normalizer = pipeline.model, pipeline.normalizer
            backend.pre_tokenizer, backend.decoder = pipeline.pre_tokenizer, pipeline.decoder
            tok.save_pretrained(fast_dir)
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
