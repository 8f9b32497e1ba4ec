#!/usr/bin/env bash
# Builds (or completes) a virtual environment from a pinned requirements file, as `make venv` needs it:
#   1. torch's pinned line alone, then kept as a constraint, so no other package can pull a different torch build
#      (an unpinned torch from PyPI is the multi-GB CUDA build);
#   2. the rest of the requirements under that constraint;
#   3. this project, editable, without dependencies;
#   4. (uv) the bytecode of the modules the project imports: tools/warm_bytecode.py.
# INSTALLER=auto (the default) installs with uv, pinned below and installed by pip into the environment: the same
# pins in seconds instead of minutes. uv reads none of pip's configuration, so tools/uv_config.py hands it pip's
# indexes, find-links and constraints (and refuses settings it cannot translate); whatever fails with uv is then
# done with pip, which completes the environment. INSTALLER=pip: pip only. INSTALLER=uv: uv or fail.
#
#   tools/build_env.sh VENV REQUIREMENTS [PACKAGE ...]    PACKAGEs: pip-installed first, beside pip's upgrade
set -euo pipefail

UV_PIN=${UV_PIN:-uv==0.13.9}
installer=${INSTALLER:-auto}
case $installer in
    auto|uv|pip) ;;
    *) echo "tools/build_env.sh: INSTALLER=$installer: allowed values are auto, uv, pip" >&2; exit 2 ;;
esac
[ $# -ge 2 ] || { echo "usage: tools/build_env.sh VENV REQUIREMENTS [PACKAGE ...]" >&2; exit 2; }
venv=$1 requirements=$2
shift 2
py=$venv/bin/python
tools=$(cd "$(dirname "$0")" && pwd)
torch_pin=$(grep -m1 '^torch==' "$requirements") || { echo "$requirements has no torch==VERSION line" >&2; exit 2; }

test -x "$py" || "${PYTHON:-python3}" -m venv "$venv"
"$py" -m pip install -q --upgrade pip "$@"
printf '%s\n' "$torch_pin" > "$venv/torch-constraint.txt"

with_uv() {
    "$py" -m pip install -q "$UV_PIN" >/dev/null 2>&1 || { echo "tools/build_env.sh: pip could not install $UV_PIN" >&2; return 1; }
    local settings
    settings=$("$py" "$tools/uv_config.py") || return 1
    local -a install
    # no --compile-bytecode: warm_bytecode.py below compiles the ~4,000 files the project imports, not all 20,000
    eval "install=(\"$venv/bin/uv\" pip install -q --python \"$py\" $settings)"
    "${install[@]}" "$torch_pin" &&
        "${install[@]}" -c "$venv/torch-constraint.txt" -r "$requirements" &&
        "${install[@]}" --no-deps -e . &&
        # where PYTHONDONTWRITEBYTECODE is set, a module without .pyc is compiled again by every process (18 s, not
        # 7, for run.py's imports): written once here. Best effort: without it the environment still works.
        { HF_HUB_OFFLINE=1 "$py" "$tools/warm_bytecode.py" || echo "tools/build_env.sh: bytecode not written" >&2; }
}

with_pip() {
    "$py" -m pip install -q "$torch_pin" &&
        "$py" -m pip install -q -c "$venv/torch-constraint.txt" -r "$requirements" &&
        "$py" -m pip install -q --no-deps -e .
}

if [ "$installer" = pip ]; then
    with_pip
elif ! (with_uv); then
    [ "$installer" = uv ] && { echo "tools/build_env.sh: the uv install failed (INSTALLER=uv)" >&2; exit 1; }
    echo "tools/build_env.sh: the uv install did not complete; installing with pip (INSTALLER=pip skips uv)" >&2
    with_pip
fi
