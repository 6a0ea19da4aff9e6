"""One line per request on the `kvcache.access` logger (the serve command prints it on stderr):
who asked, the route, the status, the tokens and why it stopped, how long it took.

    127.0.0.1 POST /v1/chat/completions 200 stream; prompt 37 (cached 32) + 8 tokens, stop;
        first token 0.031 s; 0.42 s                                        (one line in the log)
"""

from __future__ import annotations

import logging
import time

LOGGER = logging.getLogger("kvcache.access")


def peer_of(request) -> str:
    """The client's address as the connection gives it ("-" when unknown)."""
    return request.client.host if request.client is not None else "-"


def log_request(peer: str, path: str, status: int, started: float, *, stream: bool = False,
                completion=None, note: str = "") -> None:
    """Log one finished request. started: its `time.perf_counter()` on arrival; completion: the
    engine's `Completion` when it ran; note: what went wrong (an error's message), if anything."""
    if not LOGGER.isEnabledFor(logging.INFO):
        return
    parts = [f"{peer} POST {path} {status}" + (" stream" if stream else "")]
    if completion is not None:
        usage = completion.usage
        parts.append(f"prompt {usage.prompt_tokens} (cached {usage.cached_tokens}) + "
                     f"{len(completion.tokens)} tokens, {completion.finish_reason}")
        if completion.time_to_first_token_s is not None:
            parts.append(f"first token {completion.time_to_first_token_s:.3f} s")
    parts.append(f"{time.perf_counter() - started:.2f} s")
    if note:
        parts.append(note if len(note) <= 200 else note[:200] + "…")
    LOGGER.info("; ".join(parts))
