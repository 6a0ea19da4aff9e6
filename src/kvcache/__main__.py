"""`python -m kvcache` is the `kvcache` command."""

from kvcache.cli import main

raise SystemExit(main())
