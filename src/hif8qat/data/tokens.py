"""Tokens for training: tokenization with an EOS after each document, packing into windows, and the cache
folder and tokenizer fingerprint that key the cached token arrays (see :mod:`hif8qat.data.loader`)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np

from hif8qat.errors import RunError

_FORMAT_VERSION = 1


def data_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` or ``$HIF8QAT_CACHE/data`` (default ``~/.cache/hif8qat/data``).

    Args:
        cache_dir: an explicit folder, or None.

    Returns:
        The folder.
    """
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HIF8QAT_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "hif8qat"
    return root / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable hash of the tokenizer's vocabulary/rules and EOS id (keys the token caches).

    Args:
        tokenizer: a tokenizer.

    Returns:
        A hex digest.
    """
    h = hashlib.sha1()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)).encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(f"eos={tokenizer.eos_token_id};v={_FORMAT_VERSION}".encode())
    return h.hexdigest()[:16]


class DataSourceError(RunError, ValueError):
    """A data source that cannot serve training (too little text, a tokenizer without an end of document):
    the user's data.source or its settings, reported as an error line (a ValueError too, for callers that
    check values)."""


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise DataSourceError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no eos token; packing "
                         f"needs one to separate documents")
    return int(eos)


def tokenize_documents(texts: list[str], tokenizer) -> list[np.ndarray]:
    """Token ids of each text (no special tokens) followed by EOS, as int64 arrays.

    Args:
        texts: the documents.
        tokenizer: a tokenizer.

    Returns:
        One array per text.
    """
    if not texts:
        return []
    eos = _eos_id(tokenizer)
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        ids = [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
    else:
        ids = tokenizer(texts, add_special_tokens=False)["input_ids"]
    return [np.asarray(list(x) + [eos], dtype=np.int64) for x in ids]


def pack_tokens(tokens: np.ndarray, seq_len: int) -> np.ndarray:
    """View of ``tokens`` as ``[n, seq_len + 1]`` non-overlapping windows (tail dropped).

    Args:
        tokens: a 1-d token array.
        seq_len: tokens per input.

    Returns:
        ``[n, seq_len + 1]`` windows.
    """
    width = seq_len + 1
    n = len(tokens) // width
    return tokens[: n * width].reshape(n, width)


def _check_positive(name: str, value: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)
