"""hif8-qat entry point, the only Hydra-aware file and the one reader of conf/.

    python run.py experiment=exp3 profile=mini stage=all     # train + evaluate (+ its row of the report)
    python run.py -m experiment=exp6 quant.history_len=16,32,64 seed=0,1,2
    torchrun --nproc_per_node 8 run.py experiment=exp8 profile=paper
    python run.py --baseline exp3 profile=mini                 # the run exp3 is compared with (exp1)
    python run.py experiment=exp8 profile=mini stage=export  # its 8-bit export (HiF8 codes + scales)

It composes the config, converts it once into the typed, validated `RunConfig`, checks that the model, data
and evaluation datasets it names can be had (every setting is checked before a model is loaded or a run
folder is created), and dispatches stage=train|eval|report|all|export. Every user-actionable failure (a RunError)
is printed as ``error: <message>`` with exit status 2.
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT / "src"))

from hif8qat.launch.versions import exit_if_unsupported  # noqa: E402

exit_if_unsupported()  # first: a library outside pyproject.toml's ranges is one error line, not a traceback later

import hydra  # noqa: E402
from hydra import compose, initialize_config_dir  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from hydra.core.override_parser.overrides_parser import OverridesParser  # noqa: E402
from hydra.errors import HydraException, MissingConfigException, OverrideParseException  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

from hif8qat.config.run_config import ConfigError, RunConfig, resolve_profile  # noqa: E402
from hif8qat.errors import RunError, concerning  # noqa: E402

# Overrides that select or steer a run without changing what it trains: they never enter its folder name.
# The profile group is in the folder path, but its settings (profile.steps) change the training: tagged.
_UNTAGGED = ("experiment", "seed", "stage", "force", "results_root", "run_tag", "train.resume", "train.resume_allow_mismatch",
             "train.num_threads", "train.checkpoint_every", "train.keep_checkpoints", "train.keep_checkpoints_when_done", "train.log_every",
             "train.val_every", "data.eval_windows", "data.cache_dir", "quant.telemetry_dump_every",
             "quant.telemetry_stats_every", "eval", "logger", "hydra")
_IN_PATH = ("profile", "profile.name")
# key={...} typed on the command line (schedules such as quant.interval={0:1,1000:10}, eval.local_datasets).
_DICT_OVERRIDE = re.compile(r"^\+{0,2}(?!hydra[./])([A-Za-z_][\w.]*)=(\{.*)$", re.S)


def known_experiments() -> list[str]:
    return sorted(p.stem for p in (ROOT / "conf" / "experiment").glob("*.yaml"))


def run_tag_from_overrides(overrides: list[str]) -> str:
    """Training-relevant command-line overrides, so two sweep points never share a run folder."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in _IN_PATH:
            continue
        if not any(key == p or key.startswith(p + ".") or key.startswith(p + "/") for p in _UNTAGGED):
            kept.append(item.lstrip("+~"))
    return ",".join(sorted(kept))


def force_add_dict_overrides(argv: list[str]) -> list[str]:
    """Rewrite ``key={...}`` as ``++key={...}``: Hydra refuses a plain override that adds a key to a dict
    (``eval.local_datasets={mmlu: ...}`` would need ``+``); ``++`` always applies. See replace_typed_dicts."""
    out = list(argv[:1])
    for arg in argv[1:]:
        match = _DICT_OVERRIDE.match(arg)
        out.append(f"++{match[1]}={match[2]}" if match else arg)
    return out


def _setting_names() -> list[str]:
    """Every setting RunConfig knows, dotted as on the command line."""
    from dataclasses import fields, is_dataclass

    names = []
    for f in fields(RunConfig):
        section = f.default_factory() if callable(f.default_factory) else None
        keys = getattr(section, "FLAT_KEYS", None) or [g.name for g in fields(section)] if is_dataclass(section) else []
        names += [f"{f.name}.{key}" for key in keys] if keys else [f.name]
    return names


def _unknown_setting_message(key: str, override: str) -> str:
    import difflib

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
        typed = err.override[2:] if err.override.startswith("++") and err.override[2:] in typed_overrides else err.override
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
    point of the sweep (every combination of the swept values), so a bad point anywhere is found."""
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
    """argv (without the program) as Hydra 1.3's @hydra.main reads it: .overrides, .multirun, and .plain (False
    for a line that runs no job of this config: --help, --info, another config ...); None for a line Hydra
    refuses with its own usage message.

    Hydra's own parser is private (hydra._internal.utils.get_args_parser): this one declares the same flags,
    with the values they take, so that a flag's value is never read as an override. tests/test_user_errors.py
    holds the two parsers to the same reading of the lines run.py meets."""
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
    an override it cannot parse) end its process with exit 1 and a message that names no alternative. Returns
    the error message, or None when the line composes (or is not a plain run: --help, another config, ...).
    typed_overrides: the line as the user typed it, before force_add_dict_overrides, for the messages."""
    args = hydra_command_line(argv)
    if args is None or not args.plain:
        return None  # Hydra reports its own usage errors and answers --help, --info ... itself
    combo: list[str] = list(args.overrides)
    try:
        for combo in override_combinations(args.overrides, args.multirun):
            with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
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
    sacct-less job watching made quiet. Raises LauncherError (a setting that cannot work) before any job is
    submitted; returns [] for any other launcher."""
    args = hydra_command_line(argv)
    if args is None or not args.multirun or args.config_path or args.config_name or args.config_dir:
        return []
    try:
        with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
            first = override_combinations(args.overrides, True)[0]
            launcher = compose(config_name="config", overrides=first, return_hydra_config=True).hydra.launcher
    except HydraException:
        return []  # Hydra reports it itself
    if not str(launcher.get("_target_", "")).endswith("SlurmLauncher"):
        return []
    from hif8qat.launch.slurm import RESOURCE_KEYS, launcher_overrides, quiet_sacct

    values = OmegaConf.to_container(launcher, resolve=True, throw_on_missing=False)
    explicit = {o.split("=", 1)[0].lstrip("+~").removeprefix("hydra.launcher.") for o in args.overrides}
    pinned, note = launcher_overrides(values, explicit & set(RESOURCE_KEYS))
    print(note, file=sys.stderr)
    quiet_sacct(note=lambda line: print(line, file=sys.stderr))
    return pinned


def insert_overrides(argv: list[str], extra: list[str]) -> list[str]:
    """argv with `extra` overrides right after its last override (Hydra's overrides are one positional run: an
    override after ``--cfg hydra -p x`` would be an unrecognized argument)."""
    args = hydra_command_line(argv[1:])
    if not extra or args is None:
        return argv
    at = max((i for i, a in enumerate(argv) if i and a in args.overrides), default=len(argv) - 1) + 1
    return argv[:at] + extra + argv[at:]


def replace_typed_dicts(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A dict typed on the command line replaces the configured one: Hydra would merge them, so exp3's
    ``quant.interval={0: 1, 1000: 10}`` overridden by ``{0: 5}`` would silently run ``{0: 5, 1000: 10}``."""
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_delete() and isinstance(override.value(), dict):
            with open_dict(cfg):
                OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    return cfg


def _resolve(cfg: DictConfig) -> dict:
    """The config as plain values; an interpolation that does not resolve is the user's ConfigError."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        return OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as err:  # ${oc.env:UNSET}, ${train.nonexistent}: the user's interpolation
        key = getattr(err, "full_key", None) or "a setting"
        message = str(err).splitlines()[0] if str(err) else type(err).__name__
        raise ConfigError(f"cannot resolve {key}: {message}. An interpolation names an existing setting "
                          "(${train.lr}) or a set environment variable (${oc.env:NAME,default})") from None


# Settings that may read an environment variable (${oc.env:NAME,default}): paths, which the shipped configs take
# from the environment (OPENPANGU_PATH, FINEWEB_PATH) and which a run must record resolved to be repeated or
# resumed. Elsewhere the value would enter the run folder's name (run_tag, names) or the saved config unasked,
# a secret included: refused, not resolved and hidden, since the saved config is what a resume compares.
ENV_SETTINGS = ("model.name", "data.source", "data.cache_dir", "results_root", "train.resume", "eval.local_datasets")
_REFERENCE = re.compile(r"\$\{([A-Za-z_][\w.]*)\}")


def _leaves(node, prefix: str = ""):
    if isinstance(node, dict):
        for key, value in node.items():
            yield from _leaves(value, f"{prefix}{key}.")
    elif isinstance(node, list):
        for i, value in enumerate(node):
            yield from _leaves(value, f"{prefix}{i}.")
    else:
        yield prefix[:-1], node


def _reads_env(raw: dict, value, seen: frozenset = frozenset()) -> bool:
    """Whether a raw (unresolved) value reads the environment, itself or through the settings it names."""
    if not isinstance(value, str) or "${" not in value:
        return False
    if "oc.env" in value:
        return True
    return any(ref not in seen and _reads_env(raw, raw.get(ref), seen | {ref}) for ref in _REFERENCE.findall(value))


def refuse_env_interpolation(cfg: DictConfig) -> None:
    """ConfigError for a setting outside ENV_SETTINGS whose value comes from an environment variable."""
    container = OmegaConf.to_container(cfg, resolve=False)
    container.pop("hydra", None)
    raw = dict(_leaves(container))
    for key, value in raw.items():
        if not any(key == s or key.startswith(s + ".") for s in ENV_SETTINGS) and _reads_env(raw, value):
            raise ConfigError(f"invalid setting {key}={value!r}: it reads an environment variable, whose value "
                              "would be written into the run folder's name or its saved config; allowed a literal "
                              "value (an environment variable only in the paths " + ", ".join(ENV_SETTINGS) + ")")


def to_run_config(cfg: DictConfig, overrides: list[str]) -> RunConfig:
    data = _resolve(cfg)  # an interpolation that does not resolve is named as such first
    refuse_env_interpolation(cfg)
    data.pop("hydra", None)
    if not data.get("run_tag"):
        data["run_tag"] = run_tag_from_overrides(overrides)
    run_cfg = RunConfig.from_dict(data, known_experiments=known_experiments())
    from hif8qat.config.numerics import resolve_run

    return resolve_run(resolve_profile(run_cfg))  # train.autocast=auto: the numerics this machine will use


def baseline_note(cfg: RunConfig, run_dir: Path) -> None:
    """stage=all does not start the baseline (`make expN` does, under any launcher): say how, when the one run
    the report would pair this run with (same seed, same training settings) is missing or unevaluated."""
    from hif8qat.runs.folders import find_baseline_run, is_done

    base = cfg.experiment.baseline
    if not base:
        return
    found, why = find_baseline_run(Path(cfg.results_root), cfg.profile.name, base, run_dir)
    if found is not None and is_done(found) and (found / "eval").exists():
        return
    state = why or f"{found} is not finished and evaluated"
    settings = " ".join(o for o in cfg.run_tag.split(",") if o and not o.lstrip("+").startswith("quant."))
    print(f"note: baseline {base}: {state}, so the report has no drops for {cfg.experiment.name} yet. Run it with "
          f"`python run.py experiment={base} profile={cfg.profile.name} seed={cfg.seed} stage=all "
          f"results_root={cfg.results_root}{' ' + settings if settings else ''}`; `make {cfg.experiment.name}` "
          "runs it first.")


def eval_numerics(cfg: RunConfig) -> tuple[str, str]:
    """eval.device / eval.dtype, with auto resolved to the training device and numerics."""
    from hif8qat.evaluate import resolve_numerics

    return resolve_numerics(cfg.eval.device, cfg.eval.dtype, train_device=cfg.train.device,
                            train_autocast=cfg.train.autocast)


def evaluate(cfg: RunConfig, run_dir: Path, ctx=None) -> None:
    """Evaluate the run's export in each configured mode that has no results yet (force=true redoes them).

    Under torchrun (ctx of several ranks) every rank evaluates its share of the requests and rank 0, which
    alone checks and locks the folder and chooses the modes, writes the results (hif8qat.evaluate.ranks)."""
    from hif8qat.evaluate import evaluate_run
    from hif8qat.evaluate.heldout import after_eval

    main = ctx is None or ctx.is_main
    modes = on_rank0(ctx, lambda: _modes_to_evaluate(cfg, run_dir))
    device, dtype = eval_numerics(cfg)
    if modes:
        on_gpu_ranks = ctx is not None and ctx.world_size > 1 and device == "cuda"
        settings = (f"the evaluation settings (eval.tasks={list(cfg.eval.tasks)}, eval.num_fewshot="
                    f"{dict(cfg.eval.num_fewshot)}, eval.limit={cfg.eval.limit}, eval.subset={cfg.eval.subset})")
        with concerning(settings, libraries=("lm_eval", "datasets", "pyarrow")):  # what lm-eval cannot honour
            evaluate_run(run_dir, modes=modes, tasks=list(cfg.eval.tasks), batch_size=cfg.eval.batch_size,
                         device=str(ctx.device) if on_gpu_ranks else device,  # each rank its own GPU
                         dtype=dtype, limit=cfg.eval.limit, num_fewshot=dict(cfg.eval.num_fewshot) or None,
                         local_datasets=dict(cfg.eval.local_datasets) or None, subset=cfg.eval.subset,
                         subset_seed=cfg.eval.subset_seed, offline_data=cfg.eval.offline_data,
                         results_root=Path(cfg.results_root), trust_remote_code=cfg.model.trust_remote_code)
    elif main:
        print(f"{run_dir}: evaluation already done for modes {cfg.eval.modes} (force=true redoes it)")
    if main:  # one process computes a quantized run's held-out distances (up to three models); once per run
        after_eval(cfg, run_dir, device=device, dtype=dtype)


def _modes_to_evaluate(cfg: RunConfig, run_dir: Path) -> list[str]:
    from hif8qat.runs.folders import has_export, is_done, lock_run_dir

    if not has_export(run_dir):
        if is_done(run_dir):
            raise RunError(f"{run_dir} is marked finished but has no export/ to evaluate: run stage=all, which "
                           "writes it again from the run's final checkpoint (or says how to retrain it)")
        raise RunError(f"{run_dir} has no export/ to evaluate; train it first (stage=train or all)")
    lock_run_dir(run_dir)  # eval/ is written into the run folder: one writer at a time
    return [m for m in cfg.eval.modes if cfg.force or not _mode_done(run_dir / "eval" / m)]


def _mode_done(mode_dir: Path) -> bool:
    """A mode is done when its results.json and the files it recorded read back intact; a truncated or
    edited one is evaluated again rather than kept."""
    from hif8qat.artefacts import CorruptArtefact
    from hif8qat.evaluate.outputs import verify_eval_dir

    if not (mode_dir / "results.json").exists():
        return False
    try:
        verify_eval_dir(mode_dir)
    except CorruptArtefact as err:
        print(f"{err.path} is corrupt or truncated: evaluating {mode_dir.name} again")
        return False
    return True


def on_rank0(ctx, decide):
    """decide() on rank 0, its answer (or its RunError) sent to every rank, so no rank waits at a collective
    for a rank 0 that refused; the other ranks exit quietly (rank 0 reports the error once)."""
    if ctx is None or ctx.world_size == 1:
        return decide()
    import torch.distributed as dist

    box: list = [None]
    error = None
    if ctx.is_main:
        try:
            box = [(decide(), None)]
        except RunError as err:
            error, box = err, [(None, str(err))]
    dist.broadcast_object_list(box, src=0)
    if error is not None:
        raise error
    answer, message = box[0]
    if message is not None:
        raise SystemExit(2)
    return answer


def report(cfg: RunConfig, only_experiment: str | None = None) -> None:
    """Tables and figures for the profile; with only_experiment, print that experiment's rows."""
    from hif8qat.report import build_report, format_report

    # Tables and figures live in the results root they come from (<results_root>/{tables,figures}/<profile>/):
    # a user's report never rewrites the committed tables of results/reference_runs.
    root = Path(cfg.results_root)
    rep = build_report(root, cfg.profile.name, root / "tables" / cfg.profile.name,
                       root / "figures" / cfg.profile.name, figures=only_experiment is None)
    if only_experiment is None:
        print(format_report(rep))
        return
    # The console gets the experiment's verdicts against its baseline; the tables (hundreds of characters wide)
    # stay in their files.
    claims = rep["tables"].get(f"claims_{cfg.profile.name}")
    if claims is not None and len(claims) and "experiment" in claims:
        rows = claims[(claims["experiment"] == only_experiment) & (claims["against"] == "baseline")]
        if len(rows):
            print(f"\n{only_experiment} against {rows['counterpart'].iloc[0]} "
                  f"({int(rows['n_seeds'].max())} seed(s); difference, 95 % CI, verdict):")
        for row in rows.itertuples():
            where = "training" if row.mode == "train" else f"{row.mode} {row.task}"
            print(f"  {where:<30} {row.metric:<12} {row.cost:+9.3f} [{row.ci_lo:+.3f}, {row.ci_hi:+.3f}] "
                  f"{row.unit}: {row.difference}, {row.equivalence}")
    print(f"tables: {root / 'tables' / cfg.profile.name}/ (claims, drops, ape, heldout, ...: .md and .csv)")


def prepare_shared(cfg: RunConfig, ctx) -> tuple[Path, str]:
    """Rank 0 alone locks the run folder and decides what to do with it; the other ranks follow its decision.

    Rank 0 holds the folder's lock for the whole job, on behalf of every rank (torchrun stops them all when
    it exits)."""
    from hif8qat.runs.folders import prepare_run_dir

    return on_rank0(ctx, lambda: prepare_run_dir(cfg))


def dispatch(cfg: RunConfig) -> None:
    from hif8qat.runs.folders import release_run_dir, run_dir_for
    from hif8qat.runs.launch_env import env_from_slurm

    env_from_slurm()  # under srun, every task must know its rank before deciding anything

    if cfg.stage == "report":
        report(cfg)
        return
    if cfg.stage == "export":  # the deployable 8-bit export of a trained run
        from hif8qat.train.export import export_8bit_stage

        export_8bit_stage(cfg)
        return
    if cfg.stage in ("eval", "all"):
        eval_numerics(cfg)  # an evaluation device this machine lacks fails before training, not after
    from hif8qat.train.loop import setup_distributed

    ctx = setup_distributed(cfg.train.device if cfg.stage != "eval" else eval_numerics(cfg)[0])
    if cfg.stage == "eval":  # evaluation never touches the training folder's state
        try:  # under torchrun every rank scores its share; rank 0 writes eval/
            evaluate(cfg, run_dir_for(cfg), ctx)
        finally:
            if ctx.is_main:
                release_run_dir(run_dir_for(cfg))
        return
    run_dir, status = prepare_shared(cfg, ctx)
    if cfg.stage == "all" and ctx.is_main:
        baseline_note(cfg, run_dir)
    try:
        if cfg.stage in ("train", "all"):
            if status == "done":
                print(f"{run_dir} is finished: skipping training (force=true reruns it)")
            else:
                from hif8qat.train.loop import train

                train(cfg, run_dir, ctx)
        if cfg.stage == "all":
            evaluate(cfg, run_dir, ctx)
            if ctx.is_main:
                report(cfg, only_experiment=cfg.experiment.name)
    finally:
        release_run_dir(run_dir)  # a multirun sweep runs its jobs in this one process


@hydra.main(config_path="conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    from hif8qat.launch.preflight import preflight
    from hif8qat.runs.launch_env import env_from_slurm

    overrides = list(HydraConfig.get().overrides.task)

    def run() -> None:
        run_cfg = to_run_config(replace_typed_dicts(cfg, overrides), overrides)
        env_from_slurm()  # under srun, preflight's memory check must know the world size
        check_cache_env()
        preflight(run_cfg)
        dispatch(run_cfg)

    code = guarded(run)
    if code:
        sys.exit(code)


def check_cache_env() -> None:
    """$HIF8QAT_CACHE (models, tokens, evaluation data) must be a folder this process can write, before any
    run folder exists."""
    import os

    from hif8qat.files import folder_problem

    path = os.environ.get("HIF8QAT_CACHE")
    problem = folder_problem(path) if path else None
    prefilled = bool(path) and Path(path).expanduser().is_dir() and any(Path(path).expanduser().iterdir())
    if problem and not (prefilled and "not writable" in problem):  # a shared read-only cache, filled: used
        raise RunError(f"HIF8QAT_CACHE={path} cannot hold the project's cache: {problem}. Point it at a "
                       "writable folder, or unset it (default ~/.cache/hif8qat)")


def guarded(job) -> int:
    """The exception boundary (hif8qat.boundary.guarded): the project's own errors (RunError), a disk that
    refuses a write, a path the file system refuses and a library's refusal of the input a setting named
    become one ``error:`` line and exit status 2; Ctrl-C one ``interrupted`` line and status 130. Anything else
    propagates as a traceback: it is a bug to fix, not a message to print."""
    from hif8qat.boundary import guarded as boundary

    return boundary(job)


def config_for(profile: str, experiment: str, seed: int, extra: tuple[str, ...] = ()) -> RunConfig:
    """The RunConfig `python run.py profile=... experiment=... seed=... EXTRA...` would run (for hif8qat.launch.time_estimate)."""
    overrides = [f"profile={profile}", f"experiment={experiment}", f"seed={seed}", *extra]
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides), overrides)


def experiment_baseline(experiment: str, overrides: list[str] = ()) -> str | None:
    """experiment.baseline of the run `python run.py experiment=EXPERIMENT OVERRIDES...` would start (None: it
    has none). The whole line is checked as that run checks it: a RunError names what is wrong with it."""
    line = [f"experiment={experiment}", *overrides]
    forced = force_add_dict_overrides(["run.py", *line])[1:]
    problem = check_command_line(forced, line)
    if problem:
        raise ConfigError(problem)
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        cfg = compose(config_name="config", overrides=forced)
    return to_run_config(replace_typed_dicts(cfg, forced), forced).experiment.baseline


def baseline_main(argv: list[str]) -> int:
    """``python run.py --baseline EXPERIMENT [OVERRIDES...]`` prints the baseline of that run (nothing when it
    has none). `make expN` starts it before the experiment, under any launcher, so a bad setting in the line is
    refused here, before the baseline trains."""
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


if __name__ == "__main__":
    # run.py's own commands, for the Makefile: answered from the composed config, never run as a Hydra job
    if sys.argv[1:2] == ["--estimate"]:  # make all & co.: how long their unfinished runs will take here
        from hif8qat.launch.time_estimate import main as estimate_main

        sys.exit(estimate_main(sys.argv[2:], config_for))
    if sys.argv[1:2] == ["--baseline"]:  # make expN: the run to train first
        sys.exit(baseline_main(sys.argv[2:]))
    typed = sys.argv[1:]
    sys.argv = force_add_dict_overrides(sys.argv)
    problem = check_command_line(sys.argv[1:], typed)
    if problem:
        print(f"error: {problem}", file=sys.stderr)
        sys.exit(2)
    from hif8qat.launch.slurm import LauncherError

    try:
        sys.argv = insert_overrides(sys.argv, slurm_launcher_overrides(sys.argv[1:]))
    except LauncherError as err:
        print(f"error: {err}", file=sys.stderr)
        sys.exit(2)
    main()
