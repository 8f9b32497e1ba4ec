"""hif8qat's Hydra launchers: hydra-submitit-launcher's, with a sweep's failed jobs reported as one `error:` line
each (hif8qat.launch.slurm.ReportFailedJobs), and Hydra's in-process launcher, the default of `python run.py -m`,
with a failed point recorded while the sweep goes on. All three end with one summary of the sweep's points
(hif8qat.launch.sweep). Here because Hydra instantiates launchers from the hydra_plugins package only;
conf/hydra/launcher/slurm.yaml, local.yaml and sequential.yaml name them."""

from hydra._internal.core_plugins.basic_launcher import BasicLauncher
from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

from hif8qat.launch.slurm import ReportFailedJobs
from hif8qat.launch.sweep import DONE, FAILED, STATES, finish_sweep, outcome


class ReportingSlurmLauncher(ReportFailedJobs, SlurmLauncher):
    """hydra/launcher=slurm (and slurm_cpu)."""


class ReportingLocalLauncher(ReportFailedJobs, LocalLauncher):
    """hydra/launcher=local."""


class SequentialLauncher(BasicLauncher):
    """hydra/launcher=sequential, the default: the points one after another in this process. A point's failure
    is its outcome (run.py's job returns it under -m), so the points after it run; then the summary."""

    def launch(self, job_overrides, initial_job_idx):
        returns = super().launch(job_overrides, initial_job_idx)
        points = []
        for num, (overrides, ret) in enumerate(zip(job_overrides, returns), start=initial_job_idx):
            if getattr(ret.status, "name", "") == "FAILED":  # raised before run.py's job could record it
                err = ret._return_value
                result = outcome(FAILED, f"error: {type(err).__name__}: {err}")
            else:
                value = ret.return_value
                result = value if isinstance(value, dict) and value.get("state") in STATES else outcome(DONE)
            points.append((num, list(overrides), result))
        finish_sweep(self.config.hydra.sweep.dir, points)
        return returns
