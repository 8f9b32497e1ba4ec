"""The run configuration as ``python run.py`` composes it: Hydra's config from ``conf/``, the command line's
typed mappings, interpolations checked, then the typed, validated :class:`RunConfig` (``train.autocast=auto``
resolved for this machine). ``config_for`` composes one without a command line (the time estimate's runs)."""

from __future__ import annotations

import re
from pathlib import Path

from hydra import compose, initialize_config_dir
from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict
from omegaconf.errors import OmegaConfBaseException

from hif8qat.config.numerics import resolve_run
from hif8qat.config.run_config import ConfigError, RunConfig, resolve_profile
from hif8qat.runs.folders import saved_optimizer_impl

REPO = Path(__file__).resolve().parents[3]
CONF_DIR = REPO / "conf"  # run.py's Hydra config, beside it

# Overrides that select or steer a run without changing what it trains: they never enter its folder name.
# The profile group is in the folder path, but its settings (profile.steps) change the training: tagged.
_UNTAGGED = ("experiment", "seed", "stage", "force", "trust_unverified", "results_root", "run_tag", "train.resume",
             "train.resume_allow_mismatch", "train.num_threads", "train.checkpoint_every", "train.keep_checkpoints",
             "train.keep_checkpoints_when_done", "train.log_every", "train.val_every", "data.eval_windows",
             "data.cache_dir", "quant.telemetry_dump_every", "quant.telemetry_stats_every", "eval", "logger", "hydra")
_IN_PATH = ("profile", "profile.name")


def known_experiments() -> list[str]:
    """The experiments conf/experiment/ defines.

    Returns:
        Their names, sorted."""
    return sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def run_tag_from_overrides(overrides: list[str]) -> str:
    """Training-relevant command-line overrides, so two sweep points never share a run folder.

    Args:
        overrides: the line's overrides.

    Returns:
        The run tag: those overrides, sorted and joined by commas."""
    kept = []
    for item in overrides:
        key = item.split("=", 1)[0].lstrip("+~")
        if key in _IN_PATH:
            continue
        if not any(key == p or key.startswith(p + ".") or key.startswith(p + "/") for p in _UNTAGGED):
            kept.append(item.lstrip("+~"))
    return ",".join(sorted(kept))


def replace_typed_dicts(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """A dict typed on the command line replaces the configured one: Hydra would merge them, so exp3's
    ``quant.interval={0: 1, 1000: 10}`` overridden by ``{0: 5}`` would silently run ``{0: 5, 1000: 10}``.

    Args:
        cfg: the composed config (changed in place).
        overrides: the line's overrides.

    Returns:
        ``cfg``."""
    for override in OverridesParser.create().parse_overrides(overrides):
        if not override.is_delete() and isinstance(override.value(), dict):
            with open_dict(cfg):
                OmegaConf.update(cfg, override.key_or_group, override.value(), merge=False)
    return cfg


def _resolve(cfg: DictConfig) -> dict:
    """The config as plain values; an interpolation that does not resolve is the user's ConfigError."""
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
    """Refuse a setting outside ENV_SETTINGS whose value comes from an environment variable.

    Args:
        cfg: the composed config.

    Raises:
        ConfigError: naming the setting."""
    container = OmegaConf.to_container(cfg, resolve=False)
    container.pop("hydra", None)
    raw = dict(_leaves(container))
    for key, value in raw.items():
        if not any(key == s or key.startswith(s + ".") for s in ENV_SETTINGS) and _reads_env(raw, value):
            raise ConfigError(f"invalid setting {key}={value!r}: it reads an environment variable, whose value "
                              "would be written into the run folder's name or its saved config; allowed a literal "
                              "value (an environment variable only in the paths " + ", ".join(ENV_SETTINGS) + ")")


def to_run_config(cfg: DictConfig, overrides: list[str]) -> RunConfig:
    """The run's RunConfig from the composed config: interpolations resolved, checked, the run tag made from the
    overrides when not given, the profile applied.

    Args:
        cfg: the composed config.
        overrides: the line's overrides.

    Returns:
        The resolved RunConfig.

    Raises:
        ConfigError: a setting that is not allowed (the error names it and the allowed values)."""
    data = _resolve(cfg)  # an interpolation that does not resolve is named as such first
    refuse_env_interpolation(cfg)
    data.pop("hydra", None)
    if not data.get("run_tag"):
        data["run_tag"] = run_tag_from_overrides(overrides)
    run_cfg = RunConfig.from_dict(data, known_experiments=known_experiments())

    run_cfg = resolve_profile(run_cfg)
    # train.autocast=auto: the numerics this machine will use; train.optimizer_impl=auto: what a resumed run began with
    return resolve_run(run_cfg, saved_optimizer_impl=saved_optimizer_impl(run_cfg))


def config_for(profile: str, experiment: str, seed: int, extra: tuple[str, ...] = ()) -> RunConfig:
    """The RunConfig ``python run.py profile=... experiment=... seed=... EXTRA...`` would run (for the time estimate).

    Args:
        profile: the profile.
        experiment: the experiment.
        seed: the seed.
        extra: further overrides.

    Returns:
        The resolved RunConfig."""
    overrides = [f"profile={profile}", f"experiment={experiment}", f"seed={seed}", *extra]
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base="1.3"):
        return to_run_config(compose(config_name="config", overrides=overrides), overrides)
