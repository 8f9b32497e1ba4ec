"""Stand-ins for the paper profile's inputs, at toy size, for the rehearsal and the tests: a tiny randomly
initialised model behind its own modeling file and ``auto_map`` (as openPangu-Embedded-1B ships), and
FineWeb-format parquet shards."""

from __future__ import annotations

import json
import os
import random
import shutil
from pathlib import Path

from hif8qat.data.corpus import stream_is_heldout
from hif8qat.models.loading import build_tiny_llama

REMOTE_MODEL_TYPE = "tiny_pangu"
_CONFIG_PY = '''"""Configuration of a tiny openPangu stand-in: a Llama config under its own model type."""
from transformers import LlamaConfig


class TinyPanguConfig(LlamaConfig):
    model_type = "tiny_pangu"
'''
_MODELING_PY = '''"""Modeling code of a tiny openPangu stand-in: Llama's, shipped beside the weights as remote code."""
from transformers import LlamaForCausalLM

from .configuration_tiny_pangu import TinyPanguConfig


class TinyPanguForCausalLM(LlamaForCausalLM):
    config_class = TinyPanguConfig
'''
# FineWeb's parquet columns (sample-10BT), so the files have the shape a downloaded copy has.
FINEWEB_COLUMNS = ("text", "id", "dump", "url", "date", "file_path", "language", "language_score", "token_count")
_WORDS = ("the model reads tokens from shards while ranks train in step and the loss falls slowly over time "
          "data wraps around when the sample ends so the order must be announced to the user").split()


def write_remote_code_model(folder: str | os.PathLike, *, num_layers: int = 6, seed: int = 0) -> Path:
    """A tiny random Llama saved as a remote-code model: config.json with ``auto_map``, its own
    configuration/modeling files, safetensors weights and the tiny byte tokenizer.

    Args:
        folder: where to write it.
        num_layers: decoder blocks.
        seed: random seed of the weights.

    Returns:
        The folder."""

    folder = Path(folder)
    model, tok = build_tiny_llama(num_layers=num_layers, seed=seed)
    tmp = folder.with_name(folder.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tok.save_pretrained(tmp)
    config = json.loads((tmp / "config.json").read_text())
    config.update(model_type=REMOTE_MODEL_TYPE, architectures=["TinyPanguForCausalLM"],
                  auto_map={"AutoConfig": "configuration_tiny_pangu.TinyPanguConfig",
                            "AutoModelForCausalLM": "modeling_tiny_pangu.TinyPanguForCausalLM"})
    (tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    (tmp / "configuration_tiny_pangu.py").write_text(_CONFIG_PY)
    (tmp / "modeling_tiny_pangu.py").write_text(_MODELING_PY)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    return folder


def write_fineweb_shards(folder: str | os.PathLike, *, shards: int = 3, docs_per_shard: int = 40,
                         row_group_size: int = 8, seed: int = 0, heldout_docs: int = 0) -> list[Path]:
    """FineWeb-format parquet shards (``000_00000.parquet`` ...) of short random documents, each document's
    text tagged with its id (``<doc:shard-row>``) so a reader can tell which documents a rank saw.

    Args:
        folder: where to write them.
        shards: files.
        docs_per_shard: documents per file.
        row_group_size: rows per parquet row group.
        seed: random seed of the texts.
        heldout_docs: that many documents more (the first shards' last rows) that the data module holds out for
            evaluation, so a small source still has held-out windows.

    Returns:
        The shard paths."""

    import pyarrow as pa
    import pyarrow.parquet as pq

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    rng = random.Random(seed)
    paths = []
    for s in range(shards):
        rows = {c: [] for c in FINEWEB_COLUMNS}
        for i in range(docs_per_shard + (s < heldout_docs)):
            doc_id = f"{s}-{i}"
            while True:  # a regular document, or (the extra last row) one the crc32 rule holds out
                text = f"<doc:{doc_id}> " + " ".join(rng.choice(_WORDS) for _ in range(rng.randint(20, 60))) + "."
                if _heldout(text) == (i == docs_per_shard):
                    break
            for col, value in zip(FINEWEB_COLUMNS, (text, doc_id, "CC-MAIN-2024-10", f"https://example.org/{doc_id}",
                                                    "2024-02-20T00:00:00Z", f"s3://shard/{s}", "en", 0.9,
                                                    len(text.split()))):
                rows[col].append(value)
        path = folder / f"{s:03d}_00000.parquet"
        pq.write_table(pa.table(rows), path, row_group_size=row_group_size)
        paths.append(path)
    return paths


def _heldout(text: str) -> bool:

    return stream_is_heldout(text)
