"""Reusing keys and values across calls outside the engine: prefix caches and chat sessions over a
paged cache (`prefix`), and prompt-cache files (`prompt_cache`)."""
