"""Tables and figures: accuracy drops with paired confidence intervals, training-loss APE, claims with their
intervals and verdicts, scaling telemetry.

``build_report`` reads a profile's run folders (``results/runs/<profile>/<experiment>/seed<k>/``) and writes
``results/tables/*.csv|md`` and ``results/figures/*.png``; ``python -m hif8qat.report --paper`` builds the same
tables from the authors' published logs. Every table has a sidecar ``<table>.sources.json`` naming the files
that produced it and their commits. docs/design.md ("What the report measures") gives the definitions.

Modules: ``sources`` (run folders and their files), ``pairing``, ``conditions`` (whether two evaluations were made
alike), ``items`` (two evaluations compared per seed),
``tables`` (the per-run tables), ``telemetry``, ``replay``, ``seeds``, ``claims`` and ``readme`` (the claims
and their section in words), ``sweeps``, ``anchor``, ``paper`` (the authors' data), ``notes``, ``table_files``,
``figures``, ``build`` (``build_report``), ``cli``. The measures themselves are in :mod:`hif8qat.stats`."""

from hif8qat.errors import require_pipeline_extra

require_pipeline_extra("hif8qat.report")  # before any module of it imports the extra
# ruff: noqa: E402 (the imports below come after that check on purpose)

# The names the notebooks, run.py and tests use as ``report.<name>``.
from hif8qat.report.anchor import anchor_table
from hif8qat.report.build import build_report
from hif8qat.report.claims import (
    CLAIM_KEYS,
    DEFAULT_MARGINS,
    ITEM_METRICS,
    LOSS_BLOCK,
    METRIC_UNITS,
    NOT_RECORDED,
    all_contrasts,
    claims_table,
    mde_table,
    seed_contrasts,
)
from hif8qat.report.cli import format_report, main
from hif8qat.report.figures import make_figures, plot_loss_pair
from hif8qat.report.items import EXACT_BELOW_DISCORDANT, align_samples
from hif8qat.report.pairing import pair_runs
from hif8qat.report.paper import (
    AUTHORS_RUN_TO_EXP,
    HEADLINE_SUMMARY,
    PAPER_APE_PAIRS,
    PAPER_RUNS,
    PAPER_TASK_ORDER,
    SUMMARY_TASKS,
    build_paper_tables,
    format_paper_tables,
    paper_ape_table,
    paper_drop_table,
    paper_headline,
    parse_summary,
    read_authors_run,
)
from hif8qat.report.paths import ANCHOR_DIR, ANCHOR_PUBLISHED, FIGURES_DIR, PAPER_DIR, REPO, TABLES_DIR
from hif8qat.report.readme import (
    CLAIMS_BEGIN,
    CLAIMS_END,
    PAPER_CLAIMS,
    between_markers,
    build_claims,
    claims_section,
    replace_between_markers,
)
from hif8qat.report.replay import REPLAY_ESTIMATORS, recorded_amax_traces, replay_exceedance
from hif8qat.report.seeds import seed_null_table, seed_spread
from hif8qat.report.sources import (
    RunInfo,
    UnreadableResultFile,
    discover_runs,
    read_metrics,
    read_telemetry_dumps,
)
from hif8qat.report.sweeps import plot_sweeps, sweep_table
from hif8qat.report.table_files import to_markdown, write_table
from hif8qat.report.tables import SCALING_FACTORS
from hif8qat.report.telemetry import scaling_outcome, telemetry_summary
from hif8qat.stats.paired import (
    DropCI,
    binomial_se_pp,
    holm,
    loss_ape,
    paired_bootstrap_drop,
    relative_drop,
    running_ape,
)

__all__ = [
    "REPO", "PAPER_DIR", "TABLES_DIR", "FIGURES_DIR", "PAPER_RUNS", "PAPER_APE_PAIRS", "AUTHORS_RUN_TO_EXP",
    "SUMMARY_TASKS", "HEADLINE_SUMMARY", "PAPER_TASK_ORDER", "relative_drop", "loss_ape", "holm", "running_ape",
    "DropCI", "paired_bootstrap_drop", "align_samples", "telemetry_summary", "read_authors_run", "read_metrics",
    "UnreadableResultFile", "to_markdown", "write_table", "paper_ape_table", "parse_summary", "paper_drop_table",
    "paper_headline", "binomial_se_pp", "build_paper_tables", "format_paper_tables", "RunInfo", "discover_runs",
    "REPLAY_ESTIMATORS", "recorded_amax_traces", "replay_exceedance", "EXACT_BELOW_DISCORDANT", "SCALING_FACTORS",
    "scaling_outcome", "seed_spread", "seed_null_table", "DEFAULT_MARGINS", "METRIC_UNITS", "ITEM_METRICS",
    "NOT_RECORDED", "LOSS_BLOCK", "seed_contrasts", "CLAIM_KEYS", "claims_table", "mde_table", "sweep_table",
    "plot_sweeps", "PAPER_CLAIMS", "CLAIMS_BEGIN", "CLAIMS_END", "claims_section", "replace_between_markers",
    "between_markers", "ANCHOR_DIR", "ANCHOR_PUBLISHED", "anchor_table", "pair_runs", "all_contrasts",
    "build_claims", "build_report", "plot_loss_pair", "read_telemetry_dumps", "make_figures", "format_report",
    "main",
]
