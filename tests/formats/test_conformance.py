"""The HiF8 conformance vectors and their checker (``python -m hif8qat.formats.conformance``).

The vectors are read back with the csv module and checked against en_dtypes, the format's ground truth, never
against this package's codec; their coverage (every midpoint and its float32 neighbours, both signs) is derived
from en_dtypes' value set. The checker is pointed at implementations in ``conformance_impls`` built on en_dtypes.
"""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from fnmatch import fnmatch
from importlib import resources
from pathlib import Path

import en_dtypes
import numpy as np
import pytest

from hif8qat.formats import conformance

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent
VECTORS = ROOT / "src" / "hif8qat" / "formats" / "vectors"
FLOAT32_MAX_BITS = 0x7F7FFFFF


def read_rows(path: Path) -> tuple[list[str], list[dict[str, str]]]:
    """(comment lines, data rows) of one vectors file, read as the files say: '#' lines, then a header row."""
    lines = path.read_text().splitlines()
    comments = [ln for ln in lines if ln.startswith("#")]
    assert lines[: len(comments)] == comments, "comments come before the header row"
    return comments, list(csv.DictReader(lines[len(comments):]))


def bits_to_float32(hex_digits: list[str]) -> np.ndarray:
    return np.array([int(h, 16) for h in hex_digits], dtype=np.uint32).view(np.float32)


def en_dtypes_values() -> np.ndarray:
    return np.arange(256, dtype=np.uint8).view(en_dtypes.hifloat8).astype(np.float32)


def run_main(capsys, *argv: str) -> tuple[int, str, str]:
    rc = conformance.main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# ---------------------------------------------------------------------------------------------------
# The vectors


def test_the_decode_table_is_every_code_with_en_dtypes_value():
    comments, rows = read_rows(VECTORS / "hif8_decode.csv")
    assert f"version {conformance.VECTORS_VERSION}" in comments[0]
    assert list(rows[0]) == ["code", "value_hex", "value"]
    assert [int(r["code"]) for r in rows] == list(range(256))
    got = bits_to_float32([r["value_hex"] for r in rows])
    want = en_dtypes_values()
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # bit for bit, the zero's sign too
    decimal = np.array([float(r["value"]) for r in rows], dtype=np.float32)
    assert np.array_equal(decimal[~nan], got[~nan])


def test_every_encode_row_is_the_code_en_dtypes_gives():
    comments, rows = read_rows(VECTORS / "hif8_encode.csv")
    assert f"version {conformance.VECTORS_VERSION}" in comments[0]
    assert list(rows[0])[:3] == ["input_hex", "code", "input"]
    inputs = bits_to_float32([r["input_hex"] for r in rows])
    codes = np.array([int(r["code"]) for r in rows])
    with np.errstate(invalid="ignore"):  # numpy warns on casting NaN to en_dtypes' type; it becomes 0x80
        assert np.array_equal(codes, inputs.astype(en_dtypes.hifloat8).view(np.uint8))
    decimal = np.array([float(r["input"]) for r in rows], dtype=np.float32)
    assert np.array_equal(decimal.view(np.uint32)[~np.isnan(inputs)], inputs.view(np.uint32)[~np.isnan(inputs)])


def test_the_encode_rows_cover_every_midpoint_its_neighbours_and_the_special_inputs_for_both_signs():
    _, rows = read_rows(VECTORS / "hif8_encode.csv")
    present = {int(r["input_hex"], 16) for r in rows}
    values = en_dtypes_values().astype(np.float64)
    magnitudes = np.unique(np.abs(values[np.isfinite(values)]))  # 0 .. 32768
    assert magnitudes[0] == 0 and magnitudes[-1] == 32768
    uppers = np.append(magnitudes[1:], 49152.0)  # above the largest: the magnitude HiF8 gives to inf
    midpoints = ((magnitudes + uppers) / 2).astype(np.float32)
    assert np.array_equal(midpoints.astype(np.float64), (magnitudes + uppers) / 2)  # exact in float32
    wanted = np.concatenate([magnitudes.astype(np.float32), midpoints, np.nextafter(midpoints, np.float32(0)),
                             np.nextafter(midpoints, np.float32(np.inf)), np.float32([np.inf])])
    bits = wanted.view(np.uint32)
    missing = [f"{int(b):08X}" for sign in (0, 0x80000000) for b in bits | sign if int(b) not in present]
    assert not missing, f"edges not in hif8_encode.csv: {missing[:10]}"
    assert {FLOAT32_MAX_BITS, FLOAT32_MAX_BITS | 0x80000000, 0x7FC00000} <= present


@pytest.mark.parametrize(("value", "code"), [
    (2.0**-23, 0x01),  # the midpoint between 0 and the smallest value rounds up
    (-(2.0**-23), 0x81),
    (40960.0, 0x6F),  # inf, not 32768
    (np.nextafter(np.float32(40960), np.float32(0)), 0x6E),  # the largest input that stays finite
    (49152.0, 0x6F),  # not HiF8's largest value: its code is inf
    (-0.0, 0x00),  # one zero, whatever the sign
    (np.nextafter(np.float32(-(2.0**-23)), np.float32(0)), 0x00),  # rounds to zero: code 0x00, not 0x80 (NaN)
    (float("nan"), 0x80),
])
def test_the_edges_a_reader_is_told_about_are_rows_with_those_codes(value, code):
    _, rows = read_rows(VECTORS / "hif8_encode.csv")
    by_bits = {int(r["input_hex"], 16): int(r["code"]) for r in rows}
    bits = int(np.float32(value).view(np.uint32))
    assert by_bits[bits] == code
    with np.errstate(invalid="ignore"):
        assert int(np.float32(value).astype(en_dtypes.hifloat8).view(np.uint8)) == code


def test_the_packaged_vectors_are_what_the_codec_generates():
    for name, text in conformance.generate_vectors().items():
        assert (resources.files("hif8qat.formats") / "vectors" / name).read_text() == text, (
            f"{name} is stale: python -m hif8qat.formats.conformance --write src/hif8qat/formats/vectors --force")


def test_a_non_editable_install_ships_the_vectors():
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    patterns = project["tool"]["setuptools"]["package-data"]["hif8qat"]
    for path in VECTORS.glob("*.csv"):
        relative = path.relative_to(ROOT / "src" / "hif8qat").as_posix()
        assert any(fnmatch(relative, p) for p in patterns), f"{relative} is not package data"


# ---------------------------------------------------------------------------------------------------
# --write


def test_write_puts_the_two_tables_into_a_new_folder(tmp_path, capsys):
    rc, out, _ = run_main(capsys, "--write", str(tmp_path / "new" / "dir"))
    assert rc == 0
    for name in ("hif8_decode.csv", "hif8_encode.csv"):
        assert (tmp_path / "new" / "dir" / name).read_bytes() == (VECTORS / name).read_bytes()
        assert name in out


def test_write_refuses_to_overwrite_without_force_and_keeps_what_is_there(tmp_path, capsys):
    (tmp_path / "hif8_encode.csv").write_text("mine")
    rc, out, err = run_main(capsys, "--write", str(tmp_path))
    assert rc == 2 and err.startswith("error: --write:") and "--force" in err
    assert (tmp_path / "hif8_encode.csv").read_text() == "mine"
    assert not (tmp_path / "hif8_decode.csv").exists()  # nothing written when one file is refused
    rc, _, _ = run_main(capsys, "--write", str(tmp_path), "--force")
    assert rc == 0 and (tmp_path / "hif8_encode.csv").read_bytes() == (VECTORS / "hif8_encode.csv").read_bytes()


def test_write_into_an_unwritable_folder_is_one_error_line(tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    rc, out, err = run_main(capsys, "--write", str(tmp_path / "a_file" / "vectors"))
    assert rc == 2 and err.startswith("error: --write: cannot write the vectors into") and len(err.splitlines()) == 1


# ---------------------------------------------------------------------------------------------------
# The checker


def test_a_faithful_en_dtypes_implementation_passes_both_tables(capsys):
    rc, out, err = run_main(capsys, "--decode", "conformance_impls:faithful_decode",
                            "--encode", "conformance_impls:faithful_encode")
    assert rc == 0, out + err
    assert "decode: 0 of 256 codes differ" in out
    assert f"encode: 0 of {len(read_rows(VECTORS / 'hif8_encode.csv')[1])} inputs differ" in out


def test_the_package_codec_passes_when_no_implementation_is_named(capsys):
    rc, out, err = run_main(capsys)
    assert rc == 0, out + err
    assert "decode: checking hif8qat.formats:hif8_decode" in out and "decode: 0 of 256" in out
    assert "encode: checking hif8qat.formats:hif8_encode" in out and "encode: 0 of" in out


def test_a_decoder_that_adds_the_sign_differs_on_254_codes(capsys):
    rc, out, _ = run_main(capsys, "--decode", "conformance_impls:sign_added_decode")
    assert rc == 1
    assert "decode: 254 of 256 codes differ" in out
    # the first mismatch: 2^-22 read as 1 + 2^-22; then the count of the rest beyond the ten shown
    assert "  code 0x01: expected 2.384185791015625e-07 (0x34800000), got 1.000000238418579 (0x3F800002)" in out
    assert "  ... and 244 more" in out
    assert "encode:" not in out  # only the table asked for


def test_an_encoder_that_saturates_differs_exactly_on_the_inputs_that_overflow(capsys):
    _, rows = read_rows(VECTORS / "hif8_encode.csv")
    inputs = bits_to_float32([r["input_hex"] for r in rows])
    overflowing = int(np.sum(np.abs(inputs) >= 40960))  # NaN compares false
    rc, out, _ = run_main(capsys, "--encode", "conformance_impls:saturating_encode")
    assert rc == 1
    assert f"encode: {overflowing} of {len(rows)} inputs differ" in out
    assert "  input 0x47200000 (40960.0, overflow midpoint): expected code 0x6F (inf), got 0x6E (32768.0)" in out
    assert "0x471FFFFF" not in out  # the largest finite input is no mismatch


def test_any_nan_matches_any_nan_but_the_sign_of_zero_counts(capsys):
    rc, out, err = run_main(capsys, "--decode", "conformance_impls:other_nan_decode")
    assert rc == 0, out + err
    rc, out, _ = run_main(capsys, "--decode", "conformance_impls:negative_zero_decode")
    assert rc == 1 and "decode: 1 of 256 codes differ" in out
    assert "  code 0x00: expected 0.0 (0x00000000), got -0.0 (0x80000000)" in out


def test_a_callable_that_refuses_numpy_is_run_on_a_torch_tensor(capsys):
    rc, out, err = run_main(capsys, "--decode", "conformance_impls:torch_only_decode")
    assert rc == 0, out + err
    assert "decode: 0 of 256 codes differ" in out


def test_a_bfloat16_tensor_of_values_and_a_float8_tensor_of_bytes_are_read(capsys):
    rc, out, err = run_main(capsys, "--decode", "conformance_impls:bfloat16_tensor_decode",
                            "--encode", "conformance_impls:float8_tensor_encode")
    assert rc == 0, out + err
    assert "decode: 0 of 256 codes differ" in out and "encode: 0 of" in out


def test_a_callable_that_raises_gets_the_row_it_failed_on_named(capsys):
    _, rows = read_rows(VECTORS / "hif8_encode.csv")
    first_nan = next(i for i, r in enumerate(rows) if np.isnan(bits_to_float32([r["input_hex"]])[0]))
    rc, out, err = run_main(capsys, "--encode", "conformance_impls:raising_on_nan_encode")
    assert rc == 2
    assert err.startswith("error: conformance_impls:raising_on_nan_encode raised ValueError: NaN is not supported "
                          f"on data row {first_nan + 1} of hif8_encode.csv, input 0x{rows[first_nan]['input_hex']}")
    assert "Traceback" not in err and "differ" not in out


@pytest.mark.parametrize(("option", "spec", "message"), [
    ("--decode", "no_such_module_here:decode", "cannot import it (ModuleNotFoundError"),
    ("--decode", "conformance_impls:no_such_function", "cannot import it (AttributeError"),
    ("--encode", "conformance_impls:NOT_CALLABLE", "int is not callable"),
    ("--encode", "conformance_impls.faithful_encode", "takes MODULE:FUNC"),
    ("--decode", "conformance_impls:two_dimensional_decode", "returned shape (256, 1) for 256 inputs"),
    ("--decode", "conformance_impls:text_decode", "a decoder must return float values"),
])
def test_a_usage_error_is_one_error_line_and_exit_status_2(capsys, option, spec, message):
    rc, out, err = run_main(capsys, option, spec)
    assert rc == 2
    assert err.startswith("error: ") and message in err and len(err.splitlines()) == 1
    assert "differ" not in out


def test_every_name_is_resolved_before_any_table_is_checked(capsys):
    rc, out, err = run_main(capsys, "--decode", "conformance_impls:faithful_decode",
                            "--encode", "no_such_module_here:encode")
    assert rc == 2 and "no_such_module_here" in err and out == ""


def test_run_as_a_module_it_exits_with_the_status_and_no_traceback():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-m", "hif8qat.formats.conformance", "--decode",
                           "conformance_impls:sign_added_decode", "--encode", "conformance_impls:NOT_CALLABLE"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 2 and done.stderr.startswith("error: --encode") and "Traceback" not in done.stderr
    done = subprocess.run([sys.executable, "-m", "hif8qat.formats.conformance", "--decode",
                           "conformance_impls:sign_added_decode"], capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 1 and "decode: 254 of 256 codes differ" in done.stdout
