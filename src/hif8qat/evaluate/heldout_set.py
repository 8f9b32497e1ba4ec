"""The held-out comparison's shape: how many windows of a profile's sequence length it forwards, in batches of how
many. Kept apart from :mod:`hif8qat.evaluate.heldout` (which needs the statistics libraries) so that the time
estimate can count the comparison's batches without loading them."""

from __future__ import annotations

# A few thousand tokens resolve per-token NLL differences of ~0.1 % (block variance) and keep the file small
# enough to commit; at least 16 windows give the block interval 15 degrees of freedom at long sequences.
TARGET_TOKENS = 4096
MIN_WINDOWS = 16
BATCH_WINDOWS = 4  # 4 x 128 x 49,152 float32 log-probabilities: ~100 MB per model at once


def heldout_window_count(seq_len: int) -> int:
    """Windows of ``seq_len`` predicted tokens in the held-out set: TARGET_TOKENS tokens, MIN_WINDOWS at least.

    Args:
        seq_len: predicted tokens per window.

    Returns:
        The count.

    Raises:
        ValueError: seq_len is not positive."""
    if seq_len <= 0:
        raise ValueError(f"seq_len must be positive, got {seq_len}")
    return max(MIN_WINDOWS, -(-TARGET_TOKENS // int(seq_len)))
