"""The training job's errors that the user can act on: ``train_grpo.main`` prints them as one
line, without a traceback. Every module of the job may raise them, so this module imports nothing."""


class ConfigError(ValueError):
    """A bad flag value or an inconsistent combination; the message says which and why."""


class JobError(RuntimeError):
    """A failure the user can act on; ``main`` prints it without a traceback."""
