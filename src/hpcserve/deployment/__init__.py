"""One deployment = one driver process (a Slurm job, or a detached process here) that takes Ray, the
health check and the engines through their stages: how it is launched, watched and stopped (runs), the
driver itself, the checks before anything starts (preflight) and the engines' placement (replicas)."""
