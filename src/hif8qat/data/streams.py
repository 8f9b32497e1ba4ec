"""Token streams that serve training batches: packed windows of a token array, or windows tokenized on the
fly from a streamed source; both shard across ranks and resume exactly (see :mod:`hif8qat.data.loader`)."""

from __future__ import annotations

import hashlib
import itertools
import json
from collections.abc import Callable, Iterable, Iterator

import numpy as np
import torch

from hif8qat.data.corpus import stream_is_heldout
from hif8qat.data.tokens import DataSourceError, _check_positive, _eos_id, pack_tokens, tokenize_documents
from hif8qat.errors import concerning

_STREAM_DOC_GROUP = 64


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
            raise DataSourceError(
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

    def state_dict(self) -> dict:
        """The stream's position and the settings it must be resumed with.

        Returns:
            ``{"kind", "epoch", "position", "base", "seed", ...}``; the same on every rank.
        """
        return {"kind": self.kind, "epoch": self.epoch, "position": self.position * self.micro_batch_size,
                "base": self.base, "seed": self.seed, "seq_len": self.seq_len,
                "micro_batch_size": self.micro_batch_size, "world_size": self.world_size, "rank": self.rank,
                "num_windows": self.num_windows, "source": self.source}

    def load_state_dict(self, state: dict) -> None:
        """Resume where :meth:`state_dict` was taken.

        Args:
            state: a saved state of a stream with the same settings.

        Raises:
            ValueError: the state's settings differ from this stream's.
        """
        _check_state(self, state, ("kind", "seed", "seq_len", "micro_batch_size", "world_size", "num_windows"))
        pos = int(state["position"])
        if pos % self.micro_batch_size:
            raise ValueError(f"data state position {pos} is not a multiple of micro_batch_size")
        self.epoch = int(state["epoch"])
        self.position = pos // self.micro_batch_size
        self.base = int(state.get("base", 0))
        self._order_epoch = -1

    def resize(self, states: list[dict]) -> str:
        """Continue the saved ranks' epoch on this world size: the saved ranks read a prefix of the epoch's
        permutation, so this world's ranks share out the rest of it, then epochs run as usual.

        Args:
            states: every saved rank's ``state_dict()``.

        Returns:
            A note for the log.
        """
        saved = states[0]
        _check_state(self, saved, ("kind", "seed", "seq_len", "micro_batch_size", "num_windows"))
        saved_world = int(saved["world_size"])
        # windows the saved ranks read together (a prefix of the epoch's order; "position" counts windows per rank)
        self.epoch, self.position, self._order_epoch = int(saved["epoch"]), 0, -1
        self.base = int(saved.get("base", 0)) + int(saved["position"]) * saved_world
        return (f"data epoch {self.epoch}: {self.base} of {self.num_windows} windows already read by "
                f"{saved_world} rank(s); {self.world_size} rank(s) share out the rest of the epoch's order")


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

    Ranks: when the number of files (shards) divides by world_size, each rank reads whole files
    (``datasets.distributed.split_dataset_by_node``). Otherwise the source is resharded into its parquet row
    groups (``IterableDataset.reshard``) and rank ``r`` reads the ``r``-th of world_size contiguous blocks of
    them (``IterableDataset.shard``): disjoint parts that differ by at most one row group, each read by one
    rank only. A source with fewer shards than ranks that cannot be resharded (a single ``.jsonl``) falls back
    to every world_size-th document, each rank reading the whole source; a warning says so. A rank that
    reaches the end of its part starts it again in the same order (a new epoch; the trainer logs it) while the
    others go on. Without the saved iterator state, a resume falls back to skipping ``position`` windows.
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
            texts, prints = [], []
            for _ in range(_STREAM_DOC_GROUP):
                try:
                    rec = next(self._it)
                except StopIteration:
                    self._exhausted = True
                    break
                self.docs_read += 1
                text = _text(rec)
                if text and not stream_is_heldout(text):
                    fp = _fingerprint(text)
                    if not (self._skip and fp in self._skip):
                        texts.append(text)
                        prints.append(fp)
            if hasattr(self._ds, "state_dict"):
                self._ds_state = self._ds.state_dict()
            parts = tokenize_documents(texts, self.tokenizer)
            offset = len(self._buf)
            for fp, part in zip(prints, parts):
                self._unstarted.append((offset, fp))
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
        with concerning(f"data.source={self.source}"):  # a streamed corpus's bad line is read here, mid-run
            return self._next_batch()

    def _next_batch(self) -> torch.Tensor:
        width = self.seq_len + 1
        need = self.micro_batch_size * width
        if self._it is None:
            self._open()
        if not self._fill(need):
            if self.position == 0 and self.skip_from is None:  # a resized epoch may have less than a batch left
                raise DataSourceError(
                    f"data source {self.source!r} gives rank {self.rank} fewer than one batch "
                    f"({self.micro_batch_size} x {width} tokens) per epoch; use a larger source or smaller "
                    f"data.seq_len / micro_batch_size"
                )
            self.epoch += 1
            self.position = 0
            self.skip_from = self._skip = None  # the resize's epoch is over: the whole part again
            self._open()
            if not self._fill(need):
                raise DataSourceError(f"data source {self.source!r} gives rank {self.rank} no full batch")
        batch = self._take(need).reshape(self.micro_batch_size, width)
        self.position += self.micro_batch_size
        return torch.from_numpy(batch.copy())

    def state_dict(self) -> dict:
        """This rank's position, the ``datasets`` iterator state and the partly used token buffer.

        Returns:
            ``{"kind", "epoch", "position", ..., "ds_state", "buffer"}`` (per rank).
        """
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
        """Resume where :meth:`state_dict` was taken (reopening the source at the saved iterator state).

        Args:
            state: a saved state of this rank's stream.

        Raises:
            ValueError: the state's settings differ from this stream's.
        """
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
        """Continue the saved ranks' epoch on this world size (docs/design.md).

        This rank starts its part of the oldest epoch the saved ranks were in again and skips every document
        they had trained on in it (the first ``docs_read`` of each saved rank's part, less those still whole
        in its token buffer; the whole part of a rank already in the next epoch), recognised by a 64-bit
        fingerprint of its text. Costs one read of those documents at each resume until the epoch ends.

        Args:
            states: every saved rank's ``state_dict()``.

        Returns:
            A note for the log.
        """
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

        seen: set[bytes] = set()
        for r, n in enumerate(skip_from["docs_read"]):
            part = self._make_part(r, int(skip_from["world_size"]), int(skip_from["epoch"]))
            for rec in itertools.islice(part, n):  # n None: the whole part
                text = _text(rec)
                if text:
                    seen.add(_fingerprint(text))
        return seen - {bytes.fromhex(f) for f in skip_from.get("unstarted", [])}


def _text(rec) -> str | None:
    return rec.get("text") if isinstance(rec, dict) else rec


def _fingerprint(text: str) -> bytes:
    return hashlib.blake2b(text.encode("utf-8", errors="replace"), digest_size=8).digest()
