"""TokenizerError, apart so that the tokenizer readers (folders, GGUF files) can share it."""


class TokenizerError(ValueError):
    """A tokenizer folder or a call that cannot be served as asked."""
