"""`kvcache serve --kv-pin FILE`: the file read and checked before the model loads (a regular file
of at most PIN_FILE_BYTES, UTF-8 text, one JSON value a line: a text or a list of chat messages,
at most MAX_PINNED_PROMPTS of them; an error names the flag, the file and the line), then each
prompt pinned and prefilled once the engine is built, said on stderr while it runs."""

from __future__ import annotations

import json
import sys

from kvcache.files import read_text

PIN_FILE_BYTES = 4 << 20  # a --kv-pin file's size at most
MAX_PINNED_PROMPTS = 1024  # prompts a --kv-pin file may hold (each is prefilled at start)
ROLES = ("system", "developer", "user", "assistant")  # (developer is read as system, as the server does)
FLAG = "--kv-pin"


def refuse_with_tenants(kv_pin: str | None, api_keys: str | None, require_cache_salt: bool) -> None:
    """ValueError naming both flags when --kv-pin comes with --api-keys or --require-cache-salt: a
    pinned prompt's blocks are unsalted, so no tenant's request (each salted by its tenant or its
    cache_salt) could reach them, or, were they reachable, they would be shared across tenants."""
    if not kv_pin:
        return
    other = "--api-keys" if api_keys is not None else "--require-cache-salt" if require_cache_salt else None
    if other is not None:
        raise ValueError(f"{FLAG} cannot be used with {other}: pinned prompts are cached without a salt, so "
                         f"no tenant's request would reach them (or they would be shared between tenants); "
                         f"give {FLAG} or {other}, not both")


def read_pin_file(path: str) -> list[tuple[int, object]]:
    """[(line number, prompt)] of a --kv-pin file, a prompt a text or chat messages [{"role",
    "content"}]; ValueError naming the flag, the file and the line of anything else, OSError
    naming them for a file that cannot be read."""
    text = read_text(path, FLAG, PIN_FILE_BYTES)  # a regular file, size-checked, UTF-8
    entries = []
    for number, line in enumerate(text.split("\n"), 1):  # (not splitlines: JSON strings may hold U+2028)
        if not line.strip():
            continue
        where = f"{FLAG} {path}, line {number}"
        if len(entries) == MAX_PINNED_PROMPTS:
            raise ValueError(f"{where}: more than {MAX_PINNED_PROMPTS} prompts (each is prefilled at start); "
                             "pin the few prefixes many requests share")
        try:
            value = json.loads(line)
        except ValueError as error:
            raise ValueError(f"{where}: not JSON ({error})") from None
        except RecursionError:
            raise ValueError(f"{where}: JSON nested too deeply") from None
        entries.append((number, _prompt(value, where)))
    return entries


def _prompt(value: object, where: str) -> object:
    """`value` when it is a non-empty text or a non-empty list of {"role", "content"} messages with
    a known role and text content (developer read as system); ValueError naming what is wrong."""
    if isinstance(value, str):
        if not value:
            raise ValueError(f"{where}: an empty text (a prompt needs a token at least)")
        _check_text(value, where, "the text")
        return value
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: expected a text or a list of chat messages, got {type(value).__name__}")
    messages = []
    for index, message in enumerate(value):
        name = f"messages[{index}]"
        if not isinstance(message, dict):
            raise ValueError(f"{where}: {name} must be an object {{\"role\", \"content\"}}, got "
                             f"{type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if role not in ROLES:
            raise ValueError(f"{where}: {name}.role must be one of {', '.join(ROLES)}; got {role!r:.80}")
        if not isinstance(content, str):
            raise ValueError(f"{where}: {name}.content must be a text, got {type(content).__name__}")
        _check_text(content, where, f"{name}.content")
        messages.append({"role": "system" if role == "developer" else role, "content": content})
    return messages


def _check_text(text: str, where: str, name: str) -> None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError(f"{where}: {name} holds a lone surrogate (a \\ud800-\\udfff escape without its "
                         "pair): not text") from None


def pin_prompts(engine, entries: list[tuple[int, object]], path: str, context: int) -> None:
    """Pin the prompts of `read_pin_file` in `engine` and prefill them, said on stderr before the
    prefill (a pause of seconds) and after; ValueError naming the line of a prompt the chat
    template refuses or that is longer than a request may be (`context` tokens)."""
    from kvcache.engine.prompts import prompt_ids
    from kvcache.generation.params import SamplingParams

    if not entries:
        return
    prompts, tokens = [], 0
    for number, prompt in entries:
        where = f"{FLAG} {path}, line {number}"
        try:
            ids = prompt_ids(prompt, engine.tokenizer, engine.model.config.vocab_size)
        except Exception as error:  # noqa: BLE001 (a chat template that refuses these messages)
            raise ValueError(f"{where}: {error}") from None
        if len(ids) >= context:
            raise ValueError(f"{where}: the prompt has {len(ids)} tokens; a request holds at most "
                             f"{context} (--ctx-size), a token of answer included")
        tokens += engine.pin(ids)
        prompts.append(ids)
    print(f"kvcache serve: pinning {len(prompts)} prompts ({FLAG}): prefilling "
          f"{sum(map(len, prompts))} tokens…", file=sys.stderr, flush=True)
    engine.generate(prompts, SamplingParams(max_tokens=1))
    print(f"kvcache serve: pinned {len(prompts)} prompts ({tokens} tokens in whole blocks), prefilled",
          file=sys.stderr, flush=True)
