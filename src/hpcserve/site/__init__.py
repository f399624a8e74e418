"""Site profiles: how a site runs hpcserve's processes on its compute nodes (site: in the config).

    venv        the processes run on the node as they are; cluster.setup activates the environment
    apptainer   every process runs in `apptainer exec [--nv] --bind ... IMAGE` (or singularity)
    pyxis       every srun step gets --container-image=IMAGE --container-mounts=... (enroot + pyxis)
    gres: false the partition has no GRES: GPUs are not requested through Slurm (whole nodes instead)

profiles.py turns a SiteSpec into argv prefixes and srun options (pure functions); the batch script
renders them and hands them to the driver's launcher through one environment variable.
"""
