"""hif8qat's Hydra launchers: hydra-submitit-launcher's, with a sweep's failed jobs reported as one `error:` line
each (hif8qat.launch.slurm.ReportFailedJobs). Here because Hydra instantiates launchers from the hydra_plugins
package only; conf/hydra/launcher/slurm.yaml and local.yaml name them."""

from hydra_plugins.hydra_submitit_launcher.submitit_launcher import LocalLauncher, SlurmLauncher

from hif8qat.launch.slurm import ReportFailedJobs


class ReportingSlurmLauncher(ReportFailedJobs, SlurmLauncher):
    """hydra/launcher=slurm (and slurm_cpu)."""


class ReportingLocalLauncher(ReportFailedJobs, LocalLauncher):
    """hydra/launcher=local."""
