"""`hpcserve doctor CONFIG`: what is missing or wrong on this site, before any job is submitted.

checks.py  pure functions: captured command output in, findings out (severity, what, fix)
probe.py   the one srun step that looks at the compute nodes from inside (model, vLLM/Ray, ports)
runner.py  runs the commands (one swappable runner), calls the checks; exit code 2 on a blocker
"""

from hpcserve.doctor.findings import Finding, Severity, exit_code

__all__ = ["Finding", "Severity", "exit_code"]
