"""runs.host_allocator: freed memory kept in the heap, checked by glibc's own accounting (mallinfo2), in fresh
processes (malloc is set once per process); and a user's allocator choice left alone."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

import pytest

from hif8qat.errors import RunError
from hif8qat.runs import host_allocator

GLIBC = platform.system() == "Linux" and platform.libc_ver()[0] == "glibc"

# How a 4 MiB block is served, by glibc's count of mmapped blocks (mallinfo2's hblks, glibc >= 2.33), after
# keep_freed_memory() in a fresh process; and how much the heap grew by 64 MiB of 4 MiB blocks, once they are freed.
_PROBE = r"""
import ctypes, json, sys
from hif8qat.runs.host_allocator import keep_freed_memory
record = keep_freed_memory()
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                               "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
before = libc.mallinfo2()  # the interpreter's own blocks and heap
blocks = [libc.malloc(4 << 20) for _ in range(16)]
mapped = libc.mallinfo2().hblks - before.hblks
for b in blocks:
    libc.free(b)
print(json.dumps({"record": record, "mapped_blocks": mapped, "heap_kept": libc.mallinfo2().arena - before.arena}))
"""


def _probe(**env) -> dict:
    environ = {k: v for k, v in os.environ.items()
               if k not in host_allocator.USER_VARIABLES and k not in ("GLIBC_TUNABLES", "LD_PRELOAD",
                                                                      host_allocator.SWITCH)}
    out = subprocess.run([sys.executable, "-c", _PROBE], env={**environ, **env}, capture_output=True, text=True,
                         check=True, timeout=60)
    return json.loads(out.stdout)


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_blocks_a_step_frees_stay_in_the_heap_instead_of_being_mapped_afresh():
    kept, default = _probe(), _probe(**{host_allocator.SWITCH: "default"})
    assert default["mapped_blocks"] == 16 and default["record"]["left_as_is"].endswith("=default")
    assert kept["mapped_blocks"] == 0  # served from the heap
    assert kept["heap_kept"] >= 64 << 20 > default["heap_kept"]  # and still there once freed
    assert kept["record"] == {"allocator": "glibc", "mmap_threshold": 32 << 20, "trim_threshold": 1 << 30,
                              "top_pad": 256 << 20}


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
def test_a_users_malloc_variable_wins_and_is_named():
    probed = _probe(MALLOC_MMAP_THRESHOLD_="131072")
    assert probed["mapped_blocks"] == 16 and "MALLOC_MMAP_THRESHOLD_" in probed["record"]["left_as_is"]


@pytest.mark.skipif(not GLIBC, reason="glibc's malloc only")
@pytest.mark.parametrize("environ, named", [
    ({"LD_PRELOAD": "/usr/lib/x86_64-linux-gnu/libjemalloc.so.2"}, "LD_PRELOAD jemalloc"),
    ({"GLIBC_TUNABLES": "glibc.malloc.mmap_threshold=65536"}, "GLIBC_TUNABLES"),
    ({"MALLOC_TRIM_THRESHOLD_": "0", "LD_PRELOAD": "libtcmalloc.so"}, "MALLOC_TRIM_THRESHOLD_, LD_PRELOAD tcmalloc"),
    ({host_allocator.SWITCH: "Default"}, f"{host_allocator.SWITCH}=default"),
])
def test_another_allocator_or_glibc_settings_chosen_in_the_environment_are_left_alone(environ, named):
    record = host_allocator.keep_freed_memory(environ)
    assert named in record["left_as_is"] and set(record) == {"allocator", "left_as_is"}
    assert host_allocator.current() == record  # what run_info.json records


def test_a_misspelt_switch_is_an_error_naming_it_and_its_values_before_anything_is_set():
    before = host_allocator.current()
    with pytest.raises(RunError, match=r"HIF8QAT_HOST_ALLOCATOR='off'.*kept, default"):
        host_allocator.keep_freed_memory({host_allocator.SWITCH: "off"})
    assert host_allocator.current() == before
