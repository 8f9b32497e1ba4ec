"""The machine a result records: the CPU's model and the features that set its GEMM speed, read from /proc/cpuinfo
as x86 and Arm kernels write it."""

import platform
import shutil
import subprocess

import pytest

from hif8qat.runs.provenance import GEMM_FEATURES, cpu_facts, machine, provenance

SAPPHIRE_RAPIDS = """processor\t: 0
vendor_id\t: GenuineIntel
model\t\t: 143
model name\t: Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz
flags\t\t: fpu vme sse2 avx fma avx2 avx512f avx512dq avx512_bf16 amx_bf16 avx512_fp16 amx_tile amx_int8

processor\t: 1
model name\t: another entry, not read
flags\t\t: fpu
"""

EPYC_AVX2 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 7B13
flags\t\t: fpu sse2 avx fma avx2 sha_ni
"""

GRAVITON3 = """processor\t: 0
BogoMIPS\t: 2100.00
Features\t: fp asimd evtstrm aes atomics asimdhp asimddp sve asimdfhm svei8mm svebf16 i8mm bf16 rng
CPU implementer\t: 0x41
CPU part\t: 0xd40
"""


@pytest.mark.parametrize("text, cpu, features", [
    (SAPPHIRE_RAPIDS, "Intel(R) Xeon(R) Platinum 8481C CPU @ 2.70GHz",
     ["avx2", "avx512f", "avx512_bf16", "amx_tile", "amx_bf16"]),
    (EPYC_AVX2, "AMD EPYC 7B13", ["avx2"]),
    (GRAVITON3, None, ["asimd", "sve", "bf16"]),  # whole flags only: svebf16 and asimdhp are not bf16 and asimd
    ("", None, []),
])
def test_the_cpu_is_its_first_entrys_model_and_the_gemm_features_it_has(text, cpu, features):
    assert cpu_facts(text) == {"cpu": cpu, "cpu_features": features}


@pytest.mark.skipif(platform.machine() != "x86_64" or not shutil.which("lscpu"), reason="lscpu on x86 as the oracle")
def test_this_machines_record_agrees_with_lscpu():
    out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True, env={"LC_ALL": "C"}).stdout
    fields = dict(line.split(":", 1) for line in out.splitlines() if ":" in line)
    flags = set(fields["Flags"].split())
    recorded = provenance()["machine"]
    assert recorded["cpu"] == fields["Model name"].strip()
    assert recorded["cpu_features"] == [f for f in GEMM_FEATURES if f in flags]
    assert 1 <= recorded["usable_cpus"] <= recorded["logical_cpus"] == int(fields["CPU(s)"])
    assert recorded["gpu"] is None  # this process started no CUDA
    assert machine() == recorded
