"""Running a list of prompts to completion on an engine (`Engine.generate`), with progress."""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvcache.engine.prompts import prompt_ids
from kvcache.generation.params import SamplingParams
from kvcache.progress import ProgressBar


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


def _progress_reporter(progress) -> Callable[[int, int], None] | None:
    """The progress argument as a callable (done, total), or None."""
    if callable(progress):
        return progress
    if not progress:
        return None
    bar = ProgressBar("kvcache engine")
    return lambda done, total: bar(done / total, f"{done}/{total} requests finished")
