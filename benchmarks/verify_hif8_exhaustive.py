"""Check HiF8 "ta" qdq and encode against en_dtypes.hifloat8 for every float32 bit pattern.

The test suite samples 2^24 random patterns per run; this script walks all 2^32 in chunks, which takes
minutes on 2 cores. For every pattern it compares

* ``hif8_qdq`` (public API: the compiled path when available) and the eager table path, bit for bit
  (NaN-ness only for NaN results: en_dtypes returns one canonical NaN, we keep the input's payload);
* ``hif8_encode`` with en_dtypes' byte codes (exactly).

Usage:
    python benchmarks/verify_hif8_exhaustive.py                      # all 2^32 patterns
    python benchmarks/verify_hif8_exhaustive.py --start 0x3f800000 --count 0x1000000
    python benchmarks/verify_hif8_exhaustive.py --chunk-log2 22 --no-eager --no-encode

Exit status: 0 when nothing mismatched, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time

import en_dtypes
import numpy as np
import torch

from hif8qat.formats import kernels as qdq_kernels
from hif8qat.formats import qdq as formats


def _int(s: str) -> int:
    return int(s, 0)


def reference(bits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """en_dtypes' qdq (as float32 bits) and codes for int32 float32 patterns."""
    with np.errstate(invalid="ignore", over="ignore"):
        h = bits.numpy().view(np.float32).astype(en_dtypes.hifloat8)
    vals = torch.from_numpy(h.astype(np.float32))
    codes = torch.from_numpy(h.view(np.uint8).copy())
    return vals, codes


def count_value_mismatches(y: torch.Tensor, ref: torch.Tensor) -> int:
    """Patterns whose result differs in bits, or in NaN-ness where the reference is NaN."""
    ref_nan = torch.isnan(ref)
    bad = torch.isnan(y) != ref_nan
    bad |= ~ref_nan & (y.view(torch.int32) != ref.view(torch.int32))
    return int(bad.sum())


def first_mismatch(y: torch.Tensor, ref: torch.Tensor, bits: torch.Tensor) -> str:
    ref_nan = torch.isnan(ref)
    bad = (torch.isnan(y) != ref_nan) | (~ref_nan & (y.view(torch.int32) != ref.view(torch.int32)))
    i = int(bad.nonzero()[0])
    return (f"pattern 0x{int(bits[i]) & 0xFFFFFFFF:08x} ({float(bits.view(torch.float32)[i])!r}): "
            f"got {float(y[i])!r} want {float(ref[i])!r}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", type=_int, default=0, help="first pattern (unsigned, e.g. 0x3f800000)")
    p.add_argument("--count", type=_int, default=1 << 32, help="number of patterns (default all 2^32)")
    p.add_argument("--chunk-log2", type=int, default=24, help="patterns per chunk = 2^this (default 24)")
    p.add_argument("--no-eager", action="store_true", help="skip the eager table path")
    p.add_argument("--no-encode", action="store_true", help="skip hif8_encode vs en_dtypes codes")
    args = p.parse_args(argv)

    start, count = args.start, args.count
    if not (0 <= start < 1 << 32) or count <= 0 or start + count > 1 << 32:
        p.error("need 0 <= start < 2^32, count > 0 and start + count <= 2^32")
    chunk = 1 << args.chunk_log2

    mism = {"qdq": 0, "eager": 0, "encode": 0}
    examples: dict[str, str] = {}
    t0 = time.perf_counter()
    done = 0
    pos = start
    end = start + count
    while pos < end:
        n = min(chunk, end - pos)
        bits = torch.arange(pos, pos + n, dtype=torch.int64).to(torch.int32)  # wraps to int32 patterns
        x = bits.view(torch.float32)
        ref, ref_codes = reference(bits)
        y = formats.hif8_qdq(x)
        m = count_value_mismatches(y, ref)
        if m and "qdq" not in examples:
            examples["qdq"] = first_mismatch(y, ref, bits)
        mism["qdq"] += m
        if not args.no_eager:
            ye = qdq_kernels._eager_ta_into(x, None)
            m = count_value_mismatches(ye, ref)
            if m and "eager" not in examples:
                examples["eager"] = first_mismatch(ye, ref, bits)
            mism["eager"] += m
        if not args.no_encode:
            codes = formats.hif8_encode(x)
            m = int((codes != ref_codes).sum())
            if m and "encode" not in examples:
                i = int((codes != ref_codes).nonzero()[0])
                examples["encode"] = (
                    f"pattern 0x{pos + i:08x}: got 0x{int(codes[i]):02x} want 0x{int(ref_codes[i]):02x}"
                )
            mism["encode"] += m
        pos += n
        done += n
        if (done // chunk) % 16 == 0 or pos >= end:
            el = time.perf_counter() - t0
            print(
                f"  {done:>10d}/{count} patterns  up to 0x{pos - 1:08x}  mismatches {mism}  {el:7.1f} s",
                flush=True,
            )
    elapsed = time.perf_counter() - t0
    checked = [
        k for k in mism if not (k == "eager" and args.no_eager) and not (k == "encode" and args.no_encode)
    ]
    total = sum(mism[k] for k in checked)
    print(f"compile status: {formats.compile_status()}")
    print(
        f"checked {count} float32 patterns [0x{start:08x}, 0x{end - 1:08x}] against en_dtypes "
        f"({', '.join(checked)}): {total} mismatches "
        + " ".join(f"{k}={mism[k]}" for k in checked)
        + f"; elapsed {elapsed:.1f} s"
    )
    for k, v in examples.items():
        print(f"first {k} mismatch: {v}")
    return 0 if total == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
