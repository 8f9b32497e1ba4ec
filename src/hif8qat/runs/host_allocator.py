"""This process's C allocator kept from handing a step's memory back to the system (glibc only).

glibc's malloc maps each block above its mmap threshold afresh and returns freed heap above its trim threshold
(both 128 KiB at start), so a CPU training step, which frees and reallocates the same activations, gradients
and casts every step, pays the kernel's page faults for them each time. :func:`keep_freed_memory` raises the
mmap threshold to 32 MiB (glibc's maximum), the trim threshold to 1 GiB and the heap's growth to 256 MiB, so
freed memory is reused (``benchmarks/bench_allocator.py``: the mini BF16 step 0.86x, its QAT step 0.98x). Only
where memory comes from changes: results are bit-identical.

The environment's own choice wins: glibc's ``MALLOC_*_`` variables or malloc ``GLIBC_TUNABLES``, another
allocator in ``LD_PRELOAD``, or ``HIF8QAT_HOST_ALLOCATOR=default`` (``kept``, or unset: as above). Torch-free.
"""

from __future__ import annotations

import ctypes
import os
import platform
from collections.abc import Mapping
from typing import Any

from hif8qat.errors import RunError

# mallopt's parameters (malloc.h) and the values set
M_TRIM_THRESHOLD, M_TOP_PAD, M_MMAP_THRESHOLD = -1, -2, -3
SETTINGS = {"mmap_threshold": (M_MMAP_THRESHOLD, 32 << 20), "trim_threshold": (M_TRIM_THRESHOLD, 1 << 30),
            "top_pad": (M_TOP_PAD, 256 << 20)}
USER_VARIABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX")
OTHER_ALLOCATORS = ("jemalloc", "tcmalloc", "mimalloc")
SWITCH = "HIF8QAT_HOST_ALLOCATOR"
SWITCH_VALUES = ("kept", "default")  # kept (or unset): keep_freed_memory's settings; default: glibc's own

_record: dict[str, Any] = {"allocator": "not set by this process"}


def _users_choice(environ: Mapping[str, str]) -> str | None:
    """What in the environment already chooses the allocator's behaviour, or None."""
    switch = environ.get(SWITCH, "").strip().lower() or "kept"
    if switch not in SWITCH_VALUES:
        raise RunError(f"invalid setting {SWITCH}={environ[SWITCH]!r}: allowed values are "
                       f"{', '.join(SWITCH_VALUES)} (or unset: kept)")
    if switch == "default":
        return f"{SWITCH}=default"
    chosen = [name for name in USER_VARIABLES if environ.get(name)]
    if "glibc.malloc" in environ.get("GLIBC_TUNABLES", ""):
        chosen.append("GLIBC_TUNABLES")
    preloaded = [name for name in OTHER_ALLOCATORS if name in environ.get("LD_PRELOAD", "")]
    if chosen or preloaded:
        return ", ".join(chosen + [f"LD_PRELOAD {name}" for name in preloaded])
    return None


def keep_freed_memory(environ: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Keep freed memory in this process's heap (module doc), unless the environment already chose otherwise.

    Args:
        environ: the environment to read (default: this process's).

    Returns:
        What was done, for run_info.json: ``{"allocator": "glibc", <setting>: bytes, ...}``; or
        ``{"allocator": ..., "left_as_is": why}`` when nothing was set (not glibc, a user's choice).

    Raises:
        RunError: ``HIF8QAT_HOST_ALLOCATOR`` is set to a value other than ``kept`` or ``default``."""
    global _record
    environ = os.environ if environ is None else environ
    library, _ = platform.libc_ver()
    choice = _users_choice(environ)
    if platform.system() != "Linux" or library != "glibc":
        _record = {"allocator": library or platform.system(), "left_as_is": "not glibc"}
    elif choice is not None:
        _record = {"allocator": "glibc", "left_as_is": f"the environment chooses: {choice}"}
    else:
        libc = ctypes.CDLL(None)  # the C library this process already runs on
        _record = {"allocator": "glibc"}
        for name, (parameter, value) in SETTINGS.items():
            if libc.mallopt(parameter, value) == 1:
                _record[name] = value
    return dict(_record)


def current() -> dict[str, Any]:
    """What :func:`keep_freed_memory` did in this process (run_info.json records it).

    Returns:
        Its last result, or ``{"allocator": "not set by this process"}``."""
    return dict(_record)
