"""hif8-qat entry point: the Hydra application over conf/ (what it does is hif8qat.cli).

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

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent / "src"))

from hif8qat.launch.versions import exit_if_unsupported  # noqa: E402

exit_if_unsupported()  # first: a library outside pyproject.toml's ranges is one error line, not a traceback later

import hydra  # noqa: E402

from hif8qat.cli.command_line import prepare_argv  # noqa: E402

if __name__ == "__main__":  # --baseline and a refused line are answered before the job's modules load
    sys.argv = prepare_argv(sys.argv)

from hif8qat.cli.startup_timer import RUN_MODULE, StartupTimer  # noqa: E402

if __name__ == "__main__" and sys.argv[1:2] == ["--estimate"]:  # make all & co.: how long their runs will take here,
    startup_timer = StartupTimer(RUN_MODULE)  # a run's imports, timed beside the estimate's own (next line)
    from hif8qat.cli.estimate import estimate

    sys.exit(estimate(sys.argv[2:], startup_timer))  # answered before the job's modules (the evaluator) load

from hif8qat.cli.main import run_job  # noqa: E402


@hydra.main(config_path="conf", config_name="config", version_base="1.3")  # beside conf/: Hydra's job is "run"
def main(cfg) -> None:
    return run_job(cfg)  # under -m: the point's outcome, for the launcher's summary


if __name__ == "__main__":
    main()
