"""Running requests to completion on an engine without a server: a list of prompts with progress
(`Engine.generate`), and the warm-up before serving (`Engine.warm_up`)."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.engine.prompts import prompt_ids
from kvcache.generation.params import SamplingParams
from kvcache.report.progress import ProgressBar


def run_to_completion(
    engine, prompts: Sequence, params: SamplingParams, progress: bool | Callable[[int, int], None]
) -> list:
    """Every prompt's Completion, in order, once all finished: the engine's steps run here unless
    its loop runs them. progress: True for a bar on stderr, or a callable progress(done, total)
    called after each step that finished some. Every prompt is checked before any is queued."""
    for prompt in prompts:  # refuse a bad batch before queueing any of it
        prompt_ids(prompt, engine.tokenizer, engine.model.config.vocab_size)
    report = _progress_reporter(progress)
    handles = [engine.submit(prompt, params) for prompt in prompts]
    done = 0
    while done < len(handles):
        if not engine.running_in_background:
            engine.step()
        else:
            handles[done].result()
        finished = sum(handle.done for handle in handles)
        if finished != done and report is not None:
            report(finished, len(handles))
        done = finished
    return [handle.result() for handle in handles]


def warm_up(engine) -> None:
    """`Engine.warm_up`: a prompt chunk beside five single tokens, then one row alone, two new
    tokens each, sized to the pool and the context, inside `Engine.warming` (the observers' warm-up:
    the store tier off, every request probed; the counters and the step costs anew after). Under a
    salt of their own, so no request attaches what they left cached (a token or two of theirs can
    start a real prompt)."""
    params = SamplingParams(max_tokens=2, ignore_eos=True, cache_salt="kvcache warm-up")
    room = engine.model.config.max_position_embeddings
    if engine.pool_tokens is not None:  # (the batch's blocks: a small pool's quarter)
        room = min(room, engine.pool_tokens // 4)
    chunk = max(1, min(40, room - 2))
    with engine.warming():
        for batch in ([[0] * chunk, *([token] for token in range(5))], [[0]]):
            for handle in [engine.submit(prompt, params) for prompt in batch]:
                handle.result()

def _progress_reporter(progress) -> Callable[[int, int], None] | None:
    """The progress argument as a callable (done, total), or None."""
    if callable(progress):
        return progress
    if not progress:
        return None
    bar = ProgressBar("kvcache engine")
    return lambda done, total: bar(done / total, f"{done}/{total} requests finished")
