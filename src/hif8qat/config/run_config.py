"""Typed, validated run configuration.

The command line (:mod:`hif8qat.cli`, where Hydra composes it) hands a plain dict to `RunConfig.from_dict`:
every setting is checked *before* any model or data loads (`ConfigError` names the setting and its allowed
values), then `resolve_profile` applies the profile. Runs save and train from the resolved config."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from hif8qat import compute_dtype  # SETTINGS: train.autocast's values (auto, bf16, bf16_emulated, none)
from hif8qat.config import schema
from hif8qat.config.blocks import parse_high_precision_blocks
from hif8qat.config.data_source import validate_source
from hif8qat.config.eval_tasks import DEVICES as EVAL_DEVICES
from hif8qat.config.eval_tasks import DTYPES as EVAL_DTYPES
from hif8qat.config.eval_tasks import MODES as EVAL_MODES
from hif8qat.config.eval_tasks import SUITES, TASKS, fewshot_pool, resolve_tasks
from hif8qat.config.schema import MAX_SEED, PATH_NAME_RULE, is_path_name, type_problem, upper_bound_problems
from hif8qat.errors import RunError
from hif8qat.files import folder_problem
from hif8qat.quant.training import Hif8TrainingConfig
from hif8qat.scaling.settings import SettingError

PAPER_TOTAL_STEPS = 10_000
STAGES = ("train", "eval", "report", "all", "export")  # export: the 8-bit export of a trained run
NAMED_MODELS = ("tiny", "smollm2_135m", "openpangu_embedded_1b")
# Depths of the named models, so block indices can be checked before anything is loaded.
KNOWN_DEPTHS = {"smollm2_135m": 30, "openpangu_embedded_1b": 26, "HuggingFaceTB/SmolLM2-135M": 30}
TINY_DEFAULT_DEPTH = 4


class ConfigError(RunError, ValueError):
    """An invalid setting; the message names it and what is allowed (a ValueError too, for value checks)."""


def _fail(setting: str, value: Any, allowed: str) -> None:
    raise ConfigError(f"invalid setting {setting}={value!r}: allowed {allowed}")


def _check_choice(setting: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(setting, value, "one of " + ", ".join(map(str, choices)))


def _check_positive(setting: str, value: Any, *, integer: bool = False, allow_zero: bool = False) -> None:
    kind = int if integer else (int, float)
    ok = isinstance(value, kind) and not isinstance(value, bool)
    if ok:  # inf passes "> 0" and nan fails every comparison: a finite number only
        ok = math.isfinite(value) and (value >= 0 if allow_zero else value > 0)
    if not ok:
        _fail(setting, value, ("an integer" if integer else "a finite number") + (" >= 0" if allow_zero else " > 0"))


def check_path_name(setting: str, value: Any) -> None:
    """The path rule: ``value`` becomes one folder name under results_root, never a way out of it.

    Args:
        setting: the setting's dotted name.
        value: its value.

    Raises:
        ConfigError: a value that is not one folder name.
    """
    if not is_path_name(value):
        _fail(setting, value, PATH_NAME_RULE)


def _check_type(setting: str, annotation: str, value: Any) -> None:
    allowed = type_problem(annotation, value)
    if allowed:
        _fail(setting, value, allowed)


def setting_keys(cls) -> list[str]:
    """The keys of a config section as the YAML and the command line write them (``quant.history_len``).

    Args:
        cls: the section's dataclass.

    Returns:
        Its keys.
    """
    return list(cls.setting_keys()) if hasattr(cls, "setting_keys") else [f.name for f in fields(cls)]


def _from_mapping(cls, data: dict[str, Any], prefix: str):
    """Build dataclass `cls` from `data`, rejecting unknown keys (typos) by name."""
    data = dict(data or {})
    names = setting_keys(cls)
    unknown = sorted(set(data) - set(names))
    if unknown:
        _fail(f"{prefix}.{unknown[0]}", data[unknown[0]], "known keys: " + ", ".join(sorted(names)))
    try:
        return cls.from_settings(data) if hasattr(cls, "from_settings") else cls(**data)
    except SettingError as err:  # a held library config's check: named as the user writes the setting
        raise ConfigError(f"invalid setting {prefix}.{err.field}={err.value!r}: allowed {err.allowed}") from None
    except ValueError as err:
        raise ConfigError(f"invalid setting in {prefix}: {err}") from None


@dataclass
class ExperimentConfig:
    name: str = "custom"
    paper_run: str | None = None
    baseline: str | None = None
    # The experiment this one is a one-or-few-factor variant of; `changes` are relative to it.
    derived_from: str | None = None
    description: str = ""
    # Dotted settings (or whole sections) in which it differs from `derived_from` (checked by the tests).
    changes: list[str] = field(default_factory=list)


@dataclass
class ModelConfig:
    name: str = "smollm2_135m"
    trust_remote_code: bool | None = None
    revision: str | None = None


@dataclass
class DataConfig:
    source: str = "mini"
    cache_dir: str | None = None
    eval_windows: int = 16


# Hif8TrainingConfig fields the pipeline sets itself: the numerics decide emulate_bf16, and high_precision_blocks
# is filled in from the depth-relative spec of QuantConfig.high_precision_blocks once the model's depth is known.
_NOT_USER_KEYS = ("emulate_bf16", "high_precision_blocks")


@dataclass
class QuantConfig:
    """The library's :class:`~hif8qat.quant.training.Hif8TrainingConfig` (``training``: frozen, checked once when
    made; the conversion reads it) and what the pipeline adds: ``enabled``, ``bf16_warmup_steps``, and
    ``high_precision_blocks`` written relative to the model's depth (``none``, ``[i, ...]``, ``first<k>_last<m>``),
    which :func:`resolve_profile` turns into the indices it puts into ``training``. The YAML, the command line and
    each run's saved config write the section flat (``quant.history_len``, ``quant.scope``)."""

    enabled: bool = False
    high_precision_blocks: Any = "none"
    bf16_warmup_steps: int = 0
    training: Hif8TrainingConfig = field(default_factory=Hif8TrainingConfig)

    @classmethod
    def setting_keys(cls) -> list[str]:
        """The section's keys as the YAML and the command line write them.

        Returns:
            The library config's user-facing fields, then the pipeline's.
        """
        library = [f.name for f in fields(Hif8TrainingConfig) if f.name not in _NOT_USER_KEYS]
        return [*library, *cls._own_keys()]

    @classmethod
    def _own_keys(cls) -> list[str]:
        return [f.name for f in fields(cls) if f.name != "training"]

    @classmethod
    def from_settings(cls, data: dict[str, Any]) -> QuantConfig:
        """From the flat ``quant:`` section.

        Args:
            data: the section's settings.

        Returns:
            The config.

        Raises:
            SettingError: a bad library setting, naming the field, the value and what is allowed.
        """
        own = set(cls._own_keys())
        library = {k: (dict(v) if isinstance(v, dict) else v) for k, v in data.items() if k not in own}
        return cls(**{k: v for k, v in data.items() if k in own}, training=Hif8TrainingConfig(**library))

    def to_dict(self) -> dict[str, Any]:
        """The flat form, in the order the saved configs of earlier runs have it (delayed-scaling fields first).

        Returns:
            Setting -> value.
        """
        return {**self.training.scaling().to_dict(), "enabled": self.enabled, "scope": self.training.scope,
                "high_precision_blocks": self.high_precision_blocks, "bf16_warmup_steps": self.bf16_warmup_steps}


@dataclass
class TrainConfig:
    steps: int = PAPER_TOTAL_STEPS
    lr: float = 1e-4
    lr_warmup_steps: int = 300
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    eps: float = 1e-8
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    global_batch_size: int = 1024
    micro_batch_size: int = 16
    seq_len: int = 1024
    autocast: str = "auto"
    device: str = "auto"
    distributed: str = "ddp"
    compile: bool = False
    optimizer_impl: str = "auto"  # one of schema.OPTIMIZER_IMPLS
    activation_checkpointing: bool = False
    checkpoint_every: int = 500
    keep_checkpoints: int = 2
    # After the run (export written): None keeps keep_checkpoints, 0 frees their disk (export/ holds the weights).
    keep_checkpoints_when_done: int | None = None
    # Optimizer steps with a non-finite gradient norm are skipped; one more in a row than this stops the run.
    max_consecutive_skips: int = 3
    resume: str = "auto"
    # Resume a checkpoint (train.resume=<folder>) that another run's settings wrote, deliberately.
    resume_allow_mismatch: bool = False
    log_every: int = 1
    val_every: int = 0
    num_threads: int = 0


@dataclass
class EvalConfig:
    tasks: list[str] = field(default_factory=lambda: ["mini_mmlu", "mini_hellaswag", "mini_arc"])
    modes: list[str] = field(default_factory=lambda: ["bf16", "hif8"])
    limit: int | None = None
    batch_size: int = 8
    num_fewshot: dict[str, int] = field(default_factory=dict)
    local_datasets: dict[str, str] = field(default_factory=dict)
    # auto: the training device and its numerics (bf16 = FP32 weights under bf16 autocast, as trained).
    device: str = "auto"
    dtype: str = "auto"
    # Fixed seeded subsets: task -> number of documents ("full" = every document); see evaluate.subset_indices.
    subset: Any = "full"
    subset_seed: int = 0
    # Paper tasks read the offline benchmark copies (hif8qat.evaluate.offline_benchmarks) unless a local copy is named.
    offline_data: bool = False


@dataclass
class ProfileConfig:
    name: str = "mini"
    # Total optimizer steps at this profile; step-valued settings are scaled by steps / train.steps.
    steps: int | None = None


@dataclass
class QuirksConfig:
    name: str = "none"
    double_label_shift: bool = False
    bf16_params: bool = False


@dataclass
class LoggerConfig:
    wandb: bool = False
    wandb_project: str = "hif8-qat"
    wandb_mode: str = "offline"
    progress_bar: bool = True


@dataclass
class RunConfig:
    stage: str = "all"
    seed: int = 0
    force: bool = False
    trust_unverified: bool = False
    results_root: str = "results/runs"
    run_tag: str = ""
    experiment: ExperimentConfig = field(default_factory=ExperimentConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    quant: QuantConfig = field(default_factory=QuantConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)
    quirks: QuirksConfig = field(default_factory=QuirksConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_dict(cls, data: dict[str, Any], *, known_experiments: list[str] | None = None,
                  check_paths: bool = True) -> RunConfig:
        """The validated configuration of a plain dict (a composed Hydra config, or a run's saved one).

        Args:
            data: section -> settings.
            known_experiments: the experiment names a baseline may name (None: not checked).
            check_paths: check that local paths (model, data, cache, resume folder, eval data) exist.

        Returns:
            The configuration.

        Raises:
            ConfigError: an unknown key or an invalid setting.
        """
        top_level = {f.name for f in fields(cls)}
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key in _SECTION_TYPES:
                kwargs[key] = _from_mapping(_SECTION_TYPES[key], value or {}, key)
            elif key in top_level:
                kwargs[key] = value
            else:
                _fail(key, value, "known top-level keys: " + ", ".join(f.name for f in fields(cls)))
        cfg = cls(**kwargs)
        cfg.validate(known_experiments=known_experiments, check_paths=check_paths)
        return cfg

    def to_dict(self) -> dict[str, Any]:
        """The configuration as plain values (the ``quant`` section flat).

        Returns:
            Section -> settings.
        """
        d = dataclasses.asdict(self)
        d["quant"] = self.quant.to_dict()
        return d

    # ------------------------------------------------------------------ validation
    def validate(self, *, known_experiments: list[str] | None = None, check_paths: bool = True) -> None:
        """Check every setting and the relations between them, before any compute.

        Args:
            known_experiments: the experiment names a baseline may name (None: not checked).
            check_paths: check that local paths (model, data, cache, resume folder, eval data) exist.

        Raises:
            ConfigError: naming the first invalid setting and what is allowed.
        """
        self._validate_booleans()
        self._validate_types()
        self._validate_upper_bounds()  # before the relations between settings, so a huge value is named itself
        _check_choice("stage", self.stage, STAGES)
        if not 0 <= self.seed <= MAX_SEED:
            _fail("seed", self.seed, f"an integer from 0 to {MAX_SEED}")
        self._validate_paths()
        for key in ("baseline", "derived_from"):
            value = getattr(self.experiment, key)
            if known_experiments is not None and value is not None:
                _check_choice(f"experiment.{key}", value, tuple(known_experiments))
        self._validate_model(check_paths)
        self._validate_data(check_paths)
        self._validate_train(check_paths)
        self._validate_quant()
        self._validate_eval(check_paths)
        if self.profile.steps is not None:
            _check_positive("profile.steps", self.profile.steps, integer=True)

    def _validate_upper_bounds(self) -> None:
        flat = {f"{section}.{key}": value for section, values in self.to_dict().items() if isinstance(values, dict)
                for key, value in values.items()}
        for setting, value, allowed in upper_bound_problems(flat):
            _fail(setting, value, allowed)

    def _validate_booleans(self) -> None:
        """Every bool setting takes true or false only: truthiness would read force=maybe as a decision."""
        for section in fields(self):
            value = getattr(self, section.name)
            pairs = ([(f"{section.name}.{f.name}", f.type, getattr(value, f.name)) for f in fields(value)]
                     if dataclasses.is_dataclass(value) else [(section.name, section.type, value)])
            for setting, annotation, v in pairs:
                if annotation == "bool" and not isinstance(v, bool):
                    _fail(setting, v, "true or false")
                if annotation == "bool | None" and v is not None and not isinstance(v, bool):
                    _fail(setting, v, "true, false or null")

    def _validate_types(self) -> None:
        for section in fields(self):
            value = getattr(self, section.name)
            if dataclasses.is_dataclass(value):
                for f in fields(value):
                    _check_type(f"{section.name}.{f.name}", f.type, getattr(value, f.name))
            else:
                _check_type(section.name, section.type, value)

    def _validate_paths(self) -> None:
        """Every user string that becomes part of a run's path, by the one path rule; results_root non-empty."""
        if not self.results_root.strip():
            _fail("results_root", self.results_root, "a non-empty folder path (default results/runs)")
        check_path_name("experiment.name", self.experiment.name)
        check_path_name("profile.name", self.profile.name)

    def _validate_model(self, check_paths: bool) -> None:
        name = self.model.name
        if not isinstance(name, str) or not name:
            _fail("model.name", name, "a named model (" + ", ".join(NAMED_MODELS) + "), a hub id or a local path")
        if name.startswith("tiny:") and not (name[5:].isdigit() and int(name[5:]) >= 1):
            _fail("model.name", name, "tiny or tiny:N with N >= 1 blocks")
        local = Path(name).expanduser()  # a folder without config.json failed in transformers, after a run folder
        usable = (local / "config.json").is_file() or (local.is_file() and local.suffix == ".gguf")
        if check_paths and name.startswith(("/", "./", "../", "~")) and not usable:
            why = "this folder has no config.json" if local.is_dir() else "this path does not exist or is a file"
            _fail("model.name", name, f"an existing local model directory ({why}), a hub id, or one of "
                  + ", ".join(NAMED_MODELS))  # model.trust_remote_code: checked with the other booleans

    def _validate_data(self, check_paths: bool) -> None:
        source = self.data.source
        forms = "'mini', 'fineweb', or an existing local directory, file or glob of .parquet/.jsonl/.json/.txt files"
        if not isinstance(source, str) or not source.strip():
            _fail("data.source", source, forms)
        if check_paths and source.strip() not in ("mini", "fineweb"):
            try:
                validate_source(source)
            except ValueError as err:
                why = str(err) if Path(source).expanduser().exists() else "no such file or folder, no glob match"
                raise ConfigError(f"invalid setting data.source={source!r} ({why}): allowed {forms}") from None
        _check_positive("data.eval_windows", self.data.eval_windows, integer=True)
        if check_paths and self.data.cache_dir:
            problem = folder_problem(self.data.cache_dir)
            if problem:
                _fail("data.cache_dir", self.data.cache_dir, f"a folder this process can write ({problem})")

    def _validate_train(self, check_paths: bool = True) -> None:
        t = self.train
        _check_positive("train.steps", t.steps, integer=True)
        _check_positive("train.lr", t.lr)
        _check_positive("train.eps", t.eps)
        _check_positive("train.lr_warmup_steps", t.lr_warmup_steps, integer=True, allow_zero=True)
        if t.lr_warmup_steps >= t.steps:
            _fail("train.lr_warmup_steps", t.lr_warmup_steps, f"fewer than train.steps={t.steps}")
        if len(t.betas) != 2 or not all(0 <= b < 1 for b in t.betas):
            _fail("train.betas", t.betas, "two numbers in [0, 1)")
        _check_positive("train.weight_decay", t.weight_decay, allow_zero=True)
        _check_positive("train.grad_clip", t.grad_clip, allow_zero=True)
        for name in ("global_batch_size", "micro_batch_size", "seq_len", "checkpoint_every", "log_every"):
            _check_positive(f"train.{name}", getattr(t, name), integer=True)
        if t.global_batch_size % t.micro_batch_size:
            _fail("train.global_batch_size", t.global_batch_size,
                  f"a multiple of train.micro_batch_size={t.micro_batch_size}")
        _check_positive("train.keep_checkpoints", t.keep_checkpoints, integer=True)
        if t.keep_checkpoints_when_done is not None:
            _check_positive("train.keep_checkpoints_when_done", t.keep_checkpoints_when_done, integer=True,
                            allow_zero=True)
        _check_positive("train.max_consecutive_skips", t.max_consecutive_skips, integer=True, allow_zero=True)
        _check_positive("train.val_every", t.val_every, integer=True, allow_zero=True)
        _check_positive("train.num_threads", t.num_threads, integer=True, allow_zero=True)
        _check_choice("train.autocast", t.autocast, compute_dtype.SETTINGS)
        _check_choice("train.optimizer_impl", t.optimizer_impl, schema.OPTIMIZER_IMPLS)
        _check_choice("train.device", t.device, ("auto", "cpu", "cuda"))
        _check_choice("train.distributed", t.distributed, ("ddp", "fsdp"))
        if t.resume not in ("auto", "never") and check_paths and not _is_checkpoint_dir(Path(t.resume)):
            _fail("train.resume", t.resume, "auto, never, or an existing, complete checkpoint directory "
                  "(one holding a COMPLETE marker, e.g. <run>/checkpoints/step_0000008)")

    def _validate_quant(self) -> None:
        q = self.quant
        _check_choice("quant.enabled", q.enabled, (True, False))
        _check_positive("quant.bf16_warmup_steps", q.bf16_warmup_steps, integer=True, allow_zero=True)
        if q.bf16_warmup_steps >= self.train.steps:
            _fail("quant.bf16_warmup_steps", q.bf16_warmup_steps, f"fewer than train.steps={self.train.steps}")
        if q.enabled:  # the library's settings (a BF16 run's too: a typo is a typo) were checked when made
            self.high_precision_block_list()  # raises on a bad spec or an index beyond the model's depth

    def _validate_eval(self, check_paths: bool) -> None:
        e = self.eval
        if not e.modes:  # stage=all would train, evaluate nothing and exit 0
            _fail("eval.modes", e.modes, "a non-empty list of " + ", ".join(EVAL_MODES))
        for mode in e.modes:
            _check_choice("eval.modes[]", mode, EVAL_MODES)
        if e.limit is not None:
            _check_positive("eval.limit", e.limit, integer=True)
        _check_positive("eval.batch_size", e.batch_size, integer=True)
        _check_choice("eval.device", e.device, EVAL_DEVICES)
        _check_choice("eval.dtype", e.dtype, EVAL_DTYPES)
        known = f"task names {', '.join(TASKS)} or suites {', '.join(SUITES)}"
        if not e.tasks or isinstance(e.tasks, str):
            _fail("eval.tasks", e.tasks,
                  f"a non-empty list (eval.tasks=[mini], eval.tasks=[mmlu,hellaswag]) of {known}")
        try:
            selected = {s.name: s for s in resolve_tasks(list(e.tasks))}
        except ValueError:
            _fail("eval.tasks", e.tasks, f"a list of {known}")
        for task, shots in (e.num_fewshot or {}).items():
            if task not in TASKS:
                _fail(f"eval.num_fewshot.{task}", shots, f"keys among {', '.join(TASKS)}")
            _check_positive(f"eval.num_fewshot.{task}", shots, integer=True, allow_zero=True)
            pool = fewshot_pool(task)
            if pool is not None and shots > pool:
                _fail(f"eval.num_fewshot.{task}", shots, f"at most {pool}, the examples in {task}'s few-shot split")
        for key, path in (e.local_datasets or {}).items():
            # A local copy replaces a paper task's hub dataset; mini tasks ship their data, so a key naming one
            # (or a task that is not evaluated) would be silently ignored.
            spec = selected.get(key)
            if (spec is None or spec.mini) and "/" not in str(key):
                paper = [n for n, s in selected.items() if not s.mini]
                _fail(f"eval.local_datasets.{key}", path, "keys that are a paper task in eval.tasks ("
                      + (", ".join(paper) or "none selected") + ") or a hub dataset id such as cais/mmlu")
            if not isinstance(path, str) or not path:
                _fail(f"eval.local_datasets.{key}", path, "a local folder holding a copy of the dataset")
            if check_paths and not Path(path).expanduser().exists():
                _fail(f"eval.local_datasets.{key}", path, "an existing local folder (this path does not exist)")
        if e.subset != "full":
            if not isinstance(e.subset, dict):
                _fail("eval.subset", e.subset, "full, or a mapping task -> number of documents (or full)")
            for task, n in e.subset.items():
                if task not in e.tasks:
                    _fail(f"eval.subset.{task}", n, "keys among eval.tasks: " + ", ".join(map(str, e.tasks)))
                if n != "full":
                    _check_positive(f"eval.subset.{task}", n, integer=True)
        if not isinstance(e.subset_seed, int) or isinstance(e.subset_seed, bool) or e.subset_seed < 0:
            _fail("eval.subset_seed", e.subset_seed, "an integer >= 0")

    # ------------------------------------------------------------------ derived values
    def model_depth(self) -> int | None:
        """Number of transformer blocks, known without loading weights (None if it cannot be known).

        Returns:
            The number, or None.
        """
        name = self.model.name
        if name == "tiny":
            return TINY_DEFAULT_DEPTH
        if name.startswith("tiny:"):
            return int(name[5:])
        if name in KNOWN_DEPTHS:
            return KNOWN_DEPTHS[name]
        config_file = Path(name).expanduser() / "config.json"
        if config_file.exists():
            cfg = json.loads(config_file.read_text())
            return cfg.get("num_hidden_layers") or cfg.get("n_layer") or cfg.get("num_layers")
        return None

    def high_precision_block_list(self) -> list[int]:
        """The high-precision block indices for this model's depth.

        Returns:
            The sorted indices.

        Raises:
            ConfigError: a setting the depth rules out.
        """
        try:
            return parse_high_precision_blocks(self.quant.high_precision_blocks, self.model_depth())
        except ValueError as err:
            raise ConfigError(f"{err} (model.name={self.model.name})") from None

    def grad_accum_steps(self, world_size: int) -> int:
        """Micro-batches per optimizer step on ``world_size`` ranks.

        Args:
            world_size: the number of ranks.

        Returns:
            ``global_batch_size / (micro_batch_size * world_size)``.

        Raises:
            ConfigError: the global batch is not a multiple of that.
        """
        per_step = self.train.micro_batch_size * world_size
        if self.train.global_batch_size % per_step:
            raise ConfigError(f"invalid setting train.global_batch_size={self.train.global_batch_size}: allowed a "
                              f"multiple of train.micro_batch_size x world size = {per_step}")
        return self.train.global_batch_size // per_step

    def step_factor(self) -> float:
        """The profile's factor on step-valued settings (``profile.steps / train.steps``; 1 without one).

        Returns:
            The factor.
        """
        if self.profile.steps is None:
            return 1.0
        return self.profile.steps / self.train.steps


def _is_checkpoint_dir(path: Path) -> bool:
    """A checkpoint folder as checkpoint.save_checkpoint writes it, marked complete (checked without torch)."""
    return (path.expanduser() / "COMPLETE").is_file()


def _scale_steps(value: int, factor: float) -> int:
    """Scale a step count; a non-zero count stays at least 1 so a phase never silently disappears."""
    return 0 if value == 0 else max(1, int(round(value * factor)))


def _scale_schedule(value: Any, factor: float) -> Any:
    if not isinstance(value, dict):
        return value
    scaled: dict[int, Any] = {}
    for step, v in value.items():
        new = _scale_steps(step, factor)
        scaled[new] = v  # a later switch that collides with an earlier one wins, as it would at paper scale
    return scaled


def resolve_profile(cfg: RunConfig) -> RunConfig:
    """Apply the profile: step-valued settings scaled by one factor, high-precision blocks "first k, last m"
    mapped to the model's depth. Idempotent: the result has profile.steps == train.steps.

    Args:
        cfg: the configuration.

    Returns:
        The resolved configuration.
    """
    factor = cfg.step_factor()
    out = dataclasses.replace(
        cfg,
        train=dataclasses.replace(cfg.train),
        quant=dataclasses.replace(cfg.quant),
        profile=dataclasses.replace(cfg.profile),
    )
    if factor != 1.0:
        out.train.steps = cfg.profile.steps
        out.train.lr_warmup_steps = _scale_steps(cfg.train.lr_warmup_steps, factor)
        out.quant.bf16_warmup_steps = _scale_steps(cfg.quant.bf16_warmup_steps, factor)
        training = cfg.quant.training
        out.quant.training = dataclasses.replace(training, algo=_scale_schedule(training.algo, factor),
                                                 interval=_scale_schedule(training.interval, factor))
    out.profile.steps = out.train.steps
    if out.quant.enabled:
        out.quant.high_precision_blocks = cfg.high_precision_block_list()
        out.quant.training = dataclasses.replace(out.quant.training,
                                                 high_precision_blocks=out.quant.high_precision_blocks)
    out.validate()
    return out


_SECTION_TYPES = {
    "experiment": ExperimentConfig,
    "model": ModelConfig,
    "data": DataConfig,
    "quant": QuantConfig,
    "train": TrainConfig,
    "eval": EvalConfig,
    "profile": ProfileConfig,
    "quirks": QuirksConfig,
    "logger": LoggerConfig,
}
