"""`python -m kvcache` is the `kvcache` command."""

from kvcache.cli import console_main

console_main()
