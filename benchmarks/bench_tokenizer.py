"""Throughput of openPangu's tokenizer path: a SentencePiece BPE model (trained here on the offline corpus, as
openPangu's tokenizer.model is a SentencePiece BPE model) converted to a fast tokenizer by
`pangu.pangu_tokenizer`, run the way the streaming data path runs it (`tokens.tokenize_documents`, 64 documents
per call), against what one paper step consumes (1,048,576 tokens; per rank on 8 GPUs, 131,072).

    PYTHONPATH=src python benchmarks/bench_tokenizer.py [--vocab 16000] [--threads N] [--synthetic]

--synthetic: documents of random words made here (a machine without the offline corpus or a network).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

PAPER_STEP_TOKENS = 1024 * 1024


def _synthetic(docs: int = 2000) -> list[str]:
    import random

    rng = random.Random(0)
    words = ["".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 9))) for _ in range(5000)]
    return [" ".join(rng.choice(words) for _ in range(rng.randint(50, 1500))) + "." for _ in range(docs)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--threads", type=int, default=None, help="RAYON_NUM_THREADS for the Rust tokenizer")
    ap.add_argument("--synthetic", action="store_true", help="random-word documents instead of the offline corpus")
    args = ap.parse_args()
    if args.threads:
        os.environ["RAYON_NUM_THREADS"] = str(args.threads)
    import sentencepiece as spm

    from hif8qat.data.corpus import mini_corpus_documents
    from hif8qat.data.tokens import tokenize_documents
    from hif8qat.models.pangu import pangu_tokenizer

    texts = _synthetic() if args.synthetic else [d["text"] for d in mini_corpus_documents()]
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "pangu"
        folder.mkdir()
        os.environ["HIF8QAT_CACHE"] = str(Path(tmp) / "cache")
        spm.SentencePieceTrainer.train(sentence_iterator=iter(texts), model_prefix=str(folder / "tokenizer"),
                                       vocab_size=args.vocab, model_type="bpe", byte_fallback=True,
                                       character_coverage=0.9995, unk_id=0, bos_id=1, eos_id=2, pad_id=-1,
                                       minloglevel=2, max_sentence_length=1 << 20)
        (folder / "tokenizer_config.json").write_text(json.dumps(
            {"add_bos_token": True, "bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>", "legacy": True,
             "tokenizer_class": "PanguTokenizer",
             "auto_map": {"AutoTokenizer": ["tokenization_openpangu.PanguTokenizer", None]}}))
        t0 = time.perf_counter()
        tok = pangu_tokenizer(str(folder))
        convert_s = time.perf_counter() - t0
        sp = spm.SentencePieceProcessor(model_file=str(folder / "tokenizer.model"))
        n = 0
        t0 = time.perf_counter()
        for i in range(0, len(texts), 64):
            n += sum(len(x) for x in tokenize_documents(texts[i:i + 64], tok))
        fast_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        slow = sum(len(sp.encode(t)) + 1 for t in texts)
        slow_s = time.perf_counter() - t0
    rate = n / fast_s
    print(f"conversion: {convert_s:.1f} s (once; cached afterwards)")
    print(f"fast tokenizer, 64 documents per call: {n:,} tokens in {fast_s:.2f} s = {rate:,.0f} tokens/s")
    print(f"sentencepiece one string at a time (the repo's PanguTokenizer path): {slow:,} tokens in {slow_s:.2f} s "
          f"= {slow / slow_s:,.0f} tokens/s")
    print(f"a paper step (1,048,576 tokens): {PAPER_STEP_TOKENS / rate:.2f} s in one process; per rank on 8 GPUs "
          f"{PAPER_STEP_TOKENS / 8 / rate:.2f} s")


if __name__ == "__main__":
    main()
