"""Errors of checkpoint loading."""


class CheckpointError(ValueError):
    """A checkpoint folder that cannot be loaded exactly as the model expects."""
