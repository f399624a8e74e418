"""The exception tree. Every error a user can cause or fix derives from HpcserveError.

HpcserveError
├── ConfigError          the deployment file is wrong (exit code 2)
├── UsageError           a CLI argument or a request to the API is wrong (exit code 2)
├── CommandError         an external command (sbatch, squeue, ray, ...) failed; quotes its output
│   └── SlurmError
├── StageError           a deployment stage failed; names the stage, the diagnosis, the log to read
├── NotFoundError        no deployment of that name
└── UnsafePathError      a folder or secret that other users could write, plant or read (exit code 2)
"""

from __future__ import annotations


class HpcserveError(Exception):
    """Base of all errors hpcserve reports to the user without a traceback."""

    exit_code = 1


class ConfigError(HpcserveError):
    exit_code = 2


class UsageError(HpcserveError):
    exit_code = 2


class NotFoundError(HpcserveError):
    exit_code = 2


class CommandError(HpcserveError):
    """An external command failed. Carries the argument list and its raw output."""

    def __init__(self, argv: list[str], returncode: int | None, output: str, hint: str = ""):
        self.argv = argv
        self.returncode = returncode
        self.output = output
        what = "timed out" if returncode is None else f"exited with code {returncode}"
        text = f"`{' '.join(argv)}` {what}"
        if output.strip():
            text += ":\n" + output.strip()
        if hint:
            text += f"\nHint: {hint}"
        super().__init__(text)


class SlurmError(CommandError):
    pass


class StageError(HpcserveError):
    """A stage of a deployment failed: which stage, why, and which log to read."""

    def __init__(self, stage: str, diagnosis: str, log: str | None = None):
        self.stage = stage
        self.diagnosis = diagnosis
        self.log = log
        text = f"stage '{stage}' failed: {diagnosis}"
        if log:
            text += f"\nRead: {log}"
        super().__init__(text)


class UnsafePathError(HpcserveError):
    """A folder others can write into, a secret file that is not ours alone, a link where a file should be:
    refused before anything starts (another user of a shared cluster could plant what hpcserve would run)."""

    exit_code = 2
