"""Which transformer blocks stay in high precision (``quant.high_precision_blocks``).

One parser for both places that read the setting: the config check, before any model is loaded (the depth
then comes from the model's config and may be unknown), and the conversion (the depth of the loaded model).
Torch-free, so the config can import it.

Bounds: indices are 0-based and never negative (``last<m>`` names blocks from the end); every index is
below the model's depth; and at least one block stays quantized, since a quantization-aware run whose
every block is high precision trains nothing quantized (``quant.enabled=false`` is the way to say that).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SETTING = "quant.high_precision_blocks"
FORMS = "none, a list of block indices, '0,1,2', 'first<k>', 'last<m>' or 'first<k>_last<m>'"
_FIRST_LAST = re.compile(r"(?:first(\d+))?_?(?:last(\d+))?")
_INDEX_LIST = re.compile(r"\d+(\s*,\s*\d+)*")


def _invalid(spec: Any, allowed: str) -> ValueError:
    return ValueError(f"invalid setting {SETTING}={spec!r}: allowed {allowed}")


def _check_some_block_quantized(spec: Any, blocks: set[int], num_blocks: int) -> None:
    if len(blocks) >= num_blocks:
        raise _invalid(spec, f"at least one of the model's {num_blocks} blocks left quantized (this spec keeps "
                             "all of them in high precision; quant.enabled=false trains without quantization)")


def parse_high_precision_blocks(spec: Any, num_blocks: int | None) -> list[int]:
    """Sorted indices of the high-precision blocks of a model with ``num_blocks`` blocks (module doc).

    Args:
        spec: the ``quant.high_precision_blocks`` setting.
        num_blocks: the model's depth; None when unknown: a list is then checked for non-negative integers
            only, and ``first``/``last`` (which need the depth) are refused.

    Returns:
        The indices.

    Raises:
        ValueError: naming the setting.
    """
    if spec is None or (isinstance(spec, str) and spec.strip().lower() in ("", "none")):
        return []
    if isinstance(spec, str):
        text = spec.strip().lower()
        match = _FIRST_LAST.fullmatch(text)
        if match and (match[1] or match[2]):
            if num_blocks is None:
                raise _invalid(spec, "an explicit list of block indices: first<k>/last<m> needs the model's "
                                     "depth, which is unknown here")
            first, last = int(match[1] or 0), int(match[2] or 0)
            if first + last >= num_blocks:
                raise _invalid(spec, f"first k + last m below the model's {num_blocks} blocks, so that at least "
                                     "one block stays quantized")
            return sorted(set(range(first)) | set(range(num_blocks - last, num_blocks)))
        if not _INDEX_LIST.fullmatch(text):
            raise _invalid(spec, FORMS)
        spec = [int(v) for v in text.split(",")]
    if not isinstance(spec, Iterable):
        raise _invalid(spec, FORMS)
    blocks: set[int] = set()
    for value in spec:
        if isinstance(value, bool) or not isinstance(value, (int, str)) or (
                isinstance(value, str) and not value.strip().isdigit()):
            raise _invalid(spec, f"block indices (integers >= 0); {value!r} is not one")
        index = int(value)
        if index < 0 or (num_blocks is not None and index >= num_blocks):
            upper = f"0..{num_blocks - 1}" if num_blocks is not None else "0 or more"
            raise _invalid(spec, f"block indices in {upper}; block index {index} out of range {upper}"
                                 + (f" (the model has {num_blocks} blocks)" if num_blocks is not None else ""))
        blocks.add(index)
    if num_blocks is not None:
        _check_some_block_quantized(spec, blocks, num_blocks)
    return sorted(blocks)
