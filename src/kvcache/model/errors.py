"""Errors of model configs and checkpoint loading."""


class ConfigError(ValueError):
    """A config.json the model cannot run as written."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded exactly as the model expects."""
