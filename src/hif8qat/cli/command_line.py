"""``python run.py``'s command line checked before Hydra reads it: Hydra's own failures (an unknown experiment or
setting, an override it cannot parse) end its process with exit 1 and a message that names no alternative, so
the line is composed here first, every point of a sweep included, and a problem is one ``error:`` line."""

from __future__ import annotations

import argparse
import contextlib
import difflib
import itertools
import re
import sys
from dataclasses import fields, is_dataclass

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from hydra.errors import HydraException, MissingConfigException, OverrideParseException
from omegaconf import OmegaConf

from hif8qat.boundary import guarded
from hif8qat.cli.hydra_config import (
    CONF_DIR,
    _resolve,
    refuse_env_interpolation,
    replace_typed_dicts,
    to_run_config,
)
from hif8qat.config.run_config import ConfigError, RunConfig, setting_keys
from hif8qat.errors import RunError
from hif8qat.launch.slurm import RESOURCE_KEYS, LauncherError, launcher_overrides, quiet_sacct

# key={...} typed on the command line (schedules such as quant.interval={0:1,1000:10}, eval.local_datasets).
_DICT_OVERRIDE = re.compile(r"^\+{0,2}(?!hydra[./])([A-Za-z_][\w.]*)=(\{.*)$", re.S)


def force_add_dict_overrides(argv: list[str]) -> list[str]:
    """Rewrite ``key={...}`` as ``++key={...}``: Hydra refuses a plain override that adds a key to a dict
    (``eval.local_datasets={mmlu: ...}`` would need ``+``); ``++`` always applies. See replace_typed_dicts.

    Args:
        argv: the command line, program first.

    Returns:
        The rewritten command line."""
    out = list(argv[:1])
    for arg in argv[1:]:
        match = _DICT_OVERRIDE.match(arg)
        out.append(f"++{match[1]}={match[2]}" if match else arg)
    return out


def _setting_names() -> list[str]:
    """Every setting RunConfig knows, dotted as on the command line."""
    names = []
    for f in fields(RunConfig):
        section = f.default_factory() if callable(f.default_factory) else None
        keys = setting_keys(type(section)) if is_dataclass(section) else []
        names += [f"{f.name}.{key}" for key in keys] if keys else [f.name]
    return names


def _unknown_setting_message(key: str, override: str) -> str:
    names = _setting_names()
    parent = next((n for n in names if key.startswith(n + ".")), None)
    if parent:  # an entry below a setting that holds a mapping (eval.subset, quant.interval, ...)
        entry = key[len(parent) + 1:]
        return (f"cannot set {key} ({override}): {parent} is one setting holding a mapping; write it whole, e.g. "
                f"{parent}={{{entry}: {override.split('=', 1)[-1]}}} (it replaces the configured value)")
    section = key.split(".", 1)[0]
    close = difflib.get_close_matches(key, names, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(close)}?" if close else "."
    same = [n for n in names if n.startswith(section + ".")]
    known = (f" The settings of {section}: " + ", ".join(n.split(".", 1)[1] for n in same) + ".") if same else (
        " Sections and top-level settings: " + ", ".join(sorted({n.split(".", 1)[0] for n in names})) + ".")
    return f"unknown setting {key} ({override}){hint}{known}"


def _hydra_error_message(err: Exception, combo: list[str], typed_overrides: list[str]) -> str:
    """One line naming what is wrong with the command line, for Hydra's composition failures."""
    if isinstance(err, MissingConfigException) and getattr(err, "options", None) is not None:
        group, _, choice = str(err.missing_cfg_file).rpartition("/")
        return f"invalid setting {group}={choice!r}: allowed one of " + ", ".join(sorted(err.options, key=_natural))
    if isinstance(err, OverrideParseException):
        typed = (err.override[2:] if err.override.startswith("++") and err.override[2:] in typed_overrides
                 else err.override)
        return (f"cannot parse the command-line override {typed!r}: {str(err).splitlines()[0]}. "
                "Lists are written key=[a,b], mappings key={a: 1, b: 2} (quoted for the shell: "
                "'quant.interval={0: 1, 1000: 10}'), a value with a comma or brace in quotes: key='a,b'")
    key = getattr(err.__cause__, "full_key", None)
    if key and "not in struct" in str(err.__cause__):
        override = next((o for o in combo if o.split("=", 1)[0].lstrip("+~") == key), key)
        return _unknown_setting_message(key, override)
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return "; ".join(lines)


def _natural(name: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", name))


def override_combinations(overrides: list[str], multirun: bool) -> list[list[str]]:
    """The override lists to compose to check a command line: the line itself, and under multirun one list per
    point of the sweep (every combination of the swept values), so a bad point anywhere is found.

    Args:
        overrides: the line's overrides.
        multirun: whether the line runs with ``-m``.

    Returns:
        One override list per point.

    Raises:
        OverrideParseException: an override Hydra cannot parse."""
    parsed = OverridesParser.create().parse_overrides(overrides)  # raises OverrideParseException
    if not multirun:
        return [list(overrides)]
    choices: list[list[str]] = []
    for override in parsed:
        if override.is_sweep_override():
            try:
                values = list(override.sweep_string_iterator())
            except Exception:  # noqa: BLE001 - glob sweeps need Hydra's loader: left to Hydra to check
                continue
            choices.append([f"{override.get_key_element()}={v}" for v in values])
        else:
            choices.append([override.input_line])
    # Every point Hydra's basic sweeper will run: a value can be valid alone and not with another sweep's
    # (train.micro_batch_size=4 with train.global_batch_size=6), so the cross product, not one sweep at a time.
    return [list(point) for point in itertools.product(*choices)]


class _RefusedLine(Exception):
    pass


class _HydraLineParser(argparse.ArgumentParser):
    def error(self, message):  # a line Hydra's parser would refuse: Hydra prints its own usage for it
        raise _RefusedLine(message)


def hydra_command_line(argv: list[str]) -> argparse.Namespace | None:
    """argv as Hydra 1.3's @hydra.main reads it.

    Hydra's own parser is private (hydra._internal.utils.get_args_parser): this one declares the same flags,
    with the values they take, so that a flag's value is never read as an override.
    tests/integration/test_user_errors.py holds the two parsers to the same reading of the lines run.py meets.

    Args:
        argv: the command line without the program.

    Returns:
        A namespace with .overrides, .multirun and .plain (False for a line that runs no job of this config: --help,
        --info, another config ...); None for a line Hydra refuses with its own usage message."""
    ap = _HydraLineParser(add_help=False)
    ap.add_argument("overrides", nargs="*")
    for flags in (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"),
                  ("--multirun", "-m"), ("--shell-completion", "-sc")):
        ap.add_argument(*flags, action="store_true")
    ap.add_argument("--cfg", "-c", choices=["job", "hydra", "all"])
    for flags in (("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"), ("--config-dir", "-cd"),
                  ("--experimental-rerun",)):
        ap.add_argument(*flags)
    ap.add_argument("--info", "-i", nargs="?", const="all",
                    choices=["all", "config", "defaults", "defaults-tree", "plugins", "searchpath"])
    try:
        args = ap.parse_args(argv)
    except _RefusedLine:
        return None
    args.plain = not (args.help or args.hydra_help or args.version or args.info or args.shell_completion
                      or args.experimental_rerun or args.config_path or args.config_name or args.config_dir)
    return args


def check_command_line(argv: list[str], typed_overrides: list[str] = ()) -> str | None:
    """Compose the config as Hydra will, before Hydra does: its own failures (unknown experiment or setting,
    an override it cannot parse) end its process with exit 1 and a message that names no alternative.

    Args:
        argv: the command line without the program.
        typed_overrides: the line as the user typed it, before force_add_dict_overrides, for the messages.

    Returns:
        The error message, or None when the line composes (or is not a plain run: --help, another config, ...)."""
    args = hydra_command_line(argv)
    if args is None or not args.plain:
        return None  # Hydra reports its own usage errors and answers --help, --info ... itself
    combo: list[str] = list(args.overrides)
    try:
        for combo in override_combinations(args.overrides, args.multirun):
            with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
                cfg = compose(config_name="config", overrides=combo)
            if args.multirun:  # every point's settings, before the first job starts (one job would train)
                to_run_config(replace_typed_dicts(cfg, combo), combo)
            else:  # an interpolation that cannot resolve fails inside Hydra's job setup, as a traceback
                _resolve(cfg)
                refuse_env_interpolation(cfg)
    except HydraException as err:
        return _hydra_error_message(err, combo, typed_overrides)
    except RunError as err:
        return f"{err} (sweep point: {' '.join(combo)})" if args.multirun else str(err)
    return None


def slurm_launcher_overrides(argv: list[str]) -> list[str]:
    """Under -m with hydra/launcher=slurm or slurm_cpu: the launcher's GPUs, tasks and CPUs per node pinned as
    overrides, read from the partition where the config leaves them to it (hif8qat.launch.slurm), and the
    sacct-less job watching made quiet.

    Args:
        argv: the command line without the program.

    Returns:
        The overrides to add; [] for any other launcher.

    Raises:
        LauncherError: a setting that cannot work, before any job is submitted."""
    args = hydra_command_line(argv)
    if args is None or not args.multirun or args.config_path or args.config_name or args.config_dir:
        return []
    try:
        with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
            first = override_combinations(args.overrides, True)[0]
            launcher = compose(config_name="config", overrides=first, return_hydra_config=True).hydra.launcher
    except HydraException:
        return []  # Hydra reports it itself
    if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return []

    values = OmegaConf.to_container(launcher, resolve=True, throw_on_missing=False)
    explicit = {o.split("=", 1)[0].lstrip("+~").removeprefix("hydra.launcher.") for o in args.overrides}
    pinned, note = launcher_overrides(values, explicit & set(RESOURCE_KEYS))
    print(note, file=sys.stderr)
    quiet_sacct(note=lambda line: print(line, file=sys.stderr))
    return pinned


def insert_overrides(argv: list[str], extra: list[str]) -> list[str]:
    """argv with ``extra`` overrides right after its last override (Hydra's overrides are one positional run: an
    override after ``--cfg hydra -p x`` would be an unrecognized argument).

    Args:
        argv: the command line, program first.
        extra: the overrides to add.

    Returns:
        The new command line."""
    args = hydra_command_line(argv[1:])
    if not extra or args is None:
        return argv
    at = max((i for i, a in enumerate(argv) if i and a in args.overrides), default=len(argv) - 1) + 1
    return argv[:at] + extra + argv[at:]


def experiment_baseline(experiment: str, overrides: list[str] = ()) -> str | None:
    """experiment.baseline of the run ``python run.py experiment=EXPERIMENT OVERRIDES...`` would start. The whole
    line is checked as that run checks it.

    Args:
        experiment: the experiment's name.
        overrides: the run's other settings.

    Returns:
        The baseline experiment, or None when it has none.

    Raises:
        ConfigError: what is wrong with the line."""
    line = [f"experiment={experiment}", *overrides]
    forced = force_add_dict_overrides(["run.py", *line])[1:]
    problem = check_command_line(forced, line)
    if problem:
        raise ConfigError(problem)
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        cfg = compose(config_name="config", overrides=forced)
    return to_run_config(replace_typed_dicts(cfg, forced), forced).experiment.baseline


def baseline_main(argv: list[str]) -> int:
    """``python run.py --baseline EXPERIMENT [OVERRIDES...]`` prints the baseline of that run (nothing when it
    has none). `make expN` starts it before the experiment, under any launcher, so a bad setting in the line is
    refused here, before the baseline trains.

    Args:
        argv: the arguments after ``--baseline``.

    Returns:
        The exit status (2 with an ``error:`` line for a bad line)."""
    ap = argparse.ArgumentParser(prog="python run.py --baseline", description=baseline_main.__doc__.split("\n")[0])
    ap.add_argument("experiment")
    ap.add_argument("overrides", nargs="*", help="the run's other settings, as on run.py's command line")
    args = ap.parse_args(argv)
    found: list[str | None] = []

    def answer() -> None:
        with contextlib.redirect_stdout(sys.stderr):  # stdout is the answer (make reads it): notes go to stderr
            found.append(experiment_baseline(args.experiment, args.overrides))

    code = guarded(answer)
    if code:
        return code
    base = found[0]
    if base:
        print(base)
    return 0


def prepare_argv(argv: list[str]) -> list[str]:
    """``sys.argv`` as Hydra is to read it. ``--baseline`` (for the Makefile) is answered from the composed config
    and exits, never run as a Hydra job; a line Hydra would refuse exits with one ``error:`` line. Nothing of
    training, evaluation or the report is loaded for these answers.

    Args:
        argv: ``sys.argv``.

    Returns:
        The command line for Hydra (dict overrides forced, SLURM launcher settings pinned)."""
    if argv[1:2] == ["--estimate"]:  # answered by hif8qat.cli.main, which loads what the estimate needs
        return argv
    if argv[1:2] == ["--baseline"]:  # make expN: the run to train first
        sys.exit(baseline_main(argv[2:]))
    typed = argv[1:]
    argv = force_add_dict_overrides(argv)
    problem = check_command_line(argv[1:], typed)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    try:
        return insert_overrides(argv, slurm_launcher_overrides(argv[1:]))
    except LauncherError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
