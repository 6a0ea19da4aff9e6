"""A checkpoint's tokenizer: `tokenizer.json` through the `tokenizers` library, its special
tokens, and its chat template rendered the way Hugging Face renders it (jinja2, sandboxed).

    tokenizer = load_tokenizer(folder)
    inputs = tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                           return_tensors="pt", return_dict=True)
    model(**inputs)  # input_ids and attention_mask, left-padded for batches

Templates run in jinja2's ImmutableSandboxedEnvironment: a template file is data from the
internet, so it must not reach Python internals.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvcache.defaults import is_gguf, resolve_model_dir
from kvcache.files import MAX_TOKENIZER_BYTES, check_size, read_json_object, read_text
from kvcache.text.chat_template import MAX_TEMPLATE_BYTES, compile_chat_template, render_chat_template
from kvcache.text.tokenizer_error import TokenizerError

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class BatchEncoding(dict):
    """A dict of tensors (or lists) that also reads as attributes and moves with `.to(device)`."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None

    def to(self, device) -> BatchEncoding:
        return BatchEncoding(
            {name: value.to(device) if hasattr(value, "to") else value for name, value in self.items()}
        )


class Tokenizer:
    """Text <-> token ids for one checkpoint, with its special tokens and chat template."""

    padding_side = "left"

    def __init__(
        self,
        backend,
        special_tokens: dict[str, str | None],
        chat_template: str | None = None,
        add_bos_token: bool | None = None,
    ) -> None:
        self.backend = backend  # a tokenizers.Tokenizer
        self.special_tokens = special_tokens
        self.chat_template = chat_template
        self.add_bos_token = add_bos_token
        self._compiled_template = None

    # special tokens -------------------------------------------------------------------------
    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.backend.token_to_id(token)

    @property
    def bos_token_id(self) -> int | None:
        return self.token_to_id(self.bos_token)

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        """The padding id: the pad token, else the eos token, else 0 (padding is masked anyway)."""
        for token in (self.pad_token, self.eos_token):
            token_id = self.token_to_id(token)
            if token_id is not None:
                return token_id
        return 0

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    # encoding and decoding ------------------------------------------------------------------
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos, *ids]  # tokenizer_config asks for a BOS its post-processor does not add
        return ids

    def __call__(
        self,
        text: str | list[str],
        add_special_tokens: bool = True,
        return_tensors: str | None = None,
    ) -> BatchEncoding:
        """Encode one text or a batch; batches are left-padded with an attention mask."""
        texts = [text] if isinstance(text, str) else list(text)
        rows = [self.encode(item, add_special_tokens=add_special_tokens) for item in texts]
        return self._pad(rows, return_tensors, single=isinstance(text, str))

    def decode(self, ids, skip_special_tokens: bool = False) -> str:
        """The text of token ids (a list, or a 1-D tensor). Ids past the tokenizer's vocabulary
        (a model's padded embedding rows) decode to nothing, as in transformers; a negative id
        raises TokenizerError."""
        listed = _as_list(ids)
        negative = [token for token in listed if not 0 <= token < 1 << 32]
        if negative:
            raise TokenizerError(f"token ids must be >= 0 (and below 2**32), got {negative[:5]}")
        return self.backend.decode(listed, skip_special_tokens=skip_special_tokens)

    def batch_decode(self, rows, skip_special_tokens: bool = False) -> list[str]:
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in rows]

    def _pad(self, rows: list[list[int]], return_tensors: str | None, single: bool) -> BatchEncoding:
        width = max((len(row) for row in rows), default=0)
        pad = self.pad_token_id
        ids = [[pad] * (width - len(row)) + row for row in rows]
        mask = [[0] * (width - len(row)) + [1] * len(row) for row in rows]
        if return_tensors is None:
            return BatchEncoding(
                input_ids=ids[0] if single else ids, attention_mask=mask[0] if single else mask
            )
        if return_tensors != "pt":
            raise TokenizerError(f"return_tensors must be 'pt' or None, got {return_tensors!r}")
        import torch

        return BatchEncoding(
            input_ids=torch.tensor(ids, dtype=torch.long),
            attention_mask=torch.tensor(mask, dtype=torch.long),
        )

    # chat -----------------------------------------------------------------------------------
    def apply_chat_template(
        self,
        messages: list[dict[str, Any]] | list[list[dict[str, Any]]],
        add_generation_prompt: bool = False,
        tokenize: bool = True,
        return_tensors: str | None = None,
        return_dict: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ):
        """Render messages with the chat template, as Hugging Face does, then tokenize.

        A list of conversations gives a left-padded batch. tokenize=False returns the text.
        Without return_dict, returns the ids (a tensor with return_tensors="pt").
        """
        batched = bool(messages) and isinstance(messages[0], list | tuple)
        conversations = messages if batched else [messages]
        texts = [
            self.render_chat(conversation, add_generation_prompt, chat_template, **template_kwargs)
            for conversation in conversations
        ]
        if not tokenize:
            return texts if batched else texts[0]
        # the template writes the special tokens itself (HF tokenizes it the same way)
        rows = [self.encode(text, add_special_tokens=False) for text in texts]
        encoded = self._pad(rows, return_tensors, single=not batched and return_tensors is None)
        return encoded if return_dict else encoded["input_ids"]

    def render_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str:
        """The prompt text for a conversation (no tokenization)."""
        source = chat_template or self.chat_template
        if source is None:
            raise TokenizerError(
                "this tokenizer has no chat template (no chat_template in tokenizer_config.json "
                "or chat_template.jinja); pass chat_template=... or use a plain prompt"
            )
        template = compile_chat_template(source) if chat_template else self._template()
        values = {name: value for name, value in self.special_tokens.items() if value is not None}
        return render_chat_template(
            template,
            messages=messages,
            add_generation_prompt=add_generation_prompt,
            **values,
            **template_kwargs,
        )

    def _template(self):
        if self._compiled_template is None:
            self._compiled_template = compile_chat_template(self.chat_template)
        return self._compiled_template


def _as_list(ids) -> list[int]:
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    return [int(token) for token in ids]


def _token_text(value) -> str | None:
    """A special token as written in tokenizer_config.json: a string or {"content": ...}."""
    if isinstance(value, dict):
        return value.get("content")
    return value


def load_tokenizer(path: str | Path | None = None) -> Tokenizer:
    """Load `tokenizer.json`, special tokens and chat template from a local checkpoint folder
    (None: kvcache's bundled default model), or the tokenizer a GGUF file carries."""
    from tokenizers import Tokenizer as Backend

    path = resolve_model_dir(path)
    if is_gguf(path):
        from kvcache.text.tokenizer_gguf import read_gguf_tokenizer

        return Tokenizer(*read_gguf_tokenizer(Path(path).expanduser()))
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise TokenizerError(f"{str(path)!r} is not a local folder; kvcache reads tokenizers from disk only")
    tokenizer_file = folder / "tokenizer.json"
    if not tokenizer_file.is_file():
        hint = (
            " (a sentencepiece tokenizer.model alone is not supported)"
            if (folder / "tokenizer.model").is_file()
            else ""
        )
        raise TokenizerError(f"{folder} has no tokenizer.json{hint}")
    check_size(tokenizer_file, MAX_TOKENIZER_BYTES, "tokenizer.json")
    try:
        backend = Backend.from_file(str(tokenizer_file))
    except Exception as error:  # noqa: BLE001 (the tokenizers library's own error, named)
        raise TokenizerError(
            f"{tokenizer_file} is not a tokenizer file the tokenizers library reads: {error}"
        ) from None

    settings: dict[str, Any] = {}
    for name in ("special_tokens_map.json", "tokenizer_config.json"):  # later file wins
        file = folder / name
        if file.is_file():
            settings.update(read_json_object(file, "tokenizer settings file", TokenizerError))
    special_tokens = {name: _token_text(settings.get(name)) for name in SPECIAL_TOKEN_NAMES}
    for name in ("eos_token", "bos_token"):  # a stop or a start the model could never see
        token = special_tokens.get(name)
        if token is not None and (not isinstance(token, str) or backend.token_to_id(token) is None):
            raise TokenizerError(
                f"{name} {token!r} from the tokenizer settings is not in {tokenizer_file.name}'s vocabulary"
            )

    chat_template = settings.get("chat_template")
    if isinstance(chat_template, list):  # named templates: use the default one
        named = {item.get("name"): item.get("template") for item in chat_template}
        chat_template = named.get("default") or next(iter(named.values()), None)
    template_file = folder / "chat_template.jinja"
    if chat_template is None and template_file.is_file():
        chat_template = read_text(template_file, "chat template", MAX_TEMPLATE_BYTES)
    return Tokenizer(backend, special_tokens, chat_template, settings.get("add_bos_token"))
