"""A GGUF file's sentencepiece tokenizer (`tokenizer.ggml.model` "llama": pieces, scores, token
types): the ids and text of the tokenizer.json the model would ship (a `tokenizers` BPE with byte
fallback and the "▁" normalizer, trained here), llama.cpp's merge-by-score order on random
vocabularies, transformers' own reading of the same file, the file's chat template, `kvcache
generate` on a gemma3 file carrying one, and bad metadata refused by its key."""

from __future__ import annotations

import functools
import json
import random

import gguf
import pytest
import torch
from gguf_files import SentencePieceVocab, write_gguf
from tiny_models import hf_model, save_checkpoint
from tokenizers import (
    AddedToken,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
    trainers,
)

from kvcache import load_tokenizer
from kvcache.text.tokenizer import TokenizerError
from kvcache.text.tokenizer_gguf_spm import SPACE, sentencepiece_backend

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "A quick brown dog jumps over the lazy fox!",
    "Hello, world. Hello again, world of tokens and pieces.",
    "Über naïve café déjà vu, ünïcödé text with 日本語 and emoji 😀.",
    "def main():\n    return 42  # the answer\n\n",
    "Numbers like 12345 and 3.14159 appear in text, as do tabs\tand  double  spaces.",
    "She sells sea shells by the sea shore; the shells she sells are sea shells.",
]
SPECIALS = ["<unk>", "<s>", "</s>"]
CONTROL, USER = "<|end|>", "<|user|>"  # a control token and a user-defined one, phi3's
TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}{{ '<|' + message['role'] + '|>\\n' + message['content'] "
    "+ '<|end|>\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
HARD_TEXTS = [
    "", " ", "  ", "   leading spaces", "trailing spaces  ", "\n", "\n\nx\n", "a", "hello world",
    "tabs\tand\r\nnewlines", "the the the thethethe", "shellsshells seashore",
    "bytes the vocabulary lacks: € ß 𝄞 ☃ \x00\x07 ÿ",  # byte fallback, one character into 2-4 tokens
    "日本語のテキスト", "😀😀 emoji", "ünïcödé", "spelled in text: <s> and </s>", f"{USER}hi{CONTROL}",
]


def _texts(count: int = 400) -> list[str]:
    """The corpus, the hard cases, random word sequences and random strings of its characters."""
    rng = random.Random(53)
    words = " ".join(CORPUS).split(" ")
    characters = sorted(set("".join(CORPUS))) + list("€ß𝄞\n\t ")
    texts = CORPUS + HARD_TEXTS
    for _ in range(count // 2):
        texts.append(" ".join(rng.choice(words) for _ in range(rng.randint(1, 9))))
        texts.append("".join(rng.choice(characters) for _ in range(rng.randint(1, 40))))
    return texts


@functools.cache
def _train() -> tuple[list[tuple[str, str]], list[str]]:
    """(the merges, in the order learned; the characters) of a BPE trained on CORPUS as
    sentencepiece trains one: words split before each "▁", so pieces hold a space only at their
    start."""
    trained = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    trained.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), normalizers.Replace(" ", SPACE)])
    trained.pre_tokenizer = pre_tokenizers.Metaspace(replacement=SPACE, prepend_scheme="never", split=True)
    trained.train_from_iterator(CORPUS * 3, trainers.BpeTrainer(vocab_size=420, special_tokens=SPECIALS,
                                                                show_progress=False))
    model = json.loads(trained.to_str())["model"]
    merges = [tuple(m.split(" ")) if isinstance(m, str) else tuple(m) for m in model["merges"]]
    alphabet = [t for t, _ in sorted(model["vocab"].items(), key=lambda item: item[1])
                if t not in SPECIALS and len(t) == 1]
    return merges, alphabet


def _vocab(add_space_prefix: bool | None = True, **flags) -> SentencePieceVocab:
    """A sentencepiece vocabulary laid out as its model files are: unknown, BOS, EOS, the 256 byte
    tokens, the merged pieces best first (scores 0, -1, ...), the characters last; then a control
    and a user-defined token, as converted chat models carry them."""
    merges, alphabet = _train()
    tokens = [*SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256))]
    types = [2, 3, 3] + [6] * 256
    pieces = list(dict.fromkeys(["".join(merge) for merge in merges] + alphabet))
    tokens += pieces + [CONTROL, USER]
    types += [1] * len(pieces) + [3, 4]
    scores = [0.0] * (len(SPECIALS) + 256) + [-float(rank) for rank in range(len(pieces))] + [0.0, 0.0]
    return SentencePieceVocab(tokens, scores, types, add_space_prefix=add_space_prefix,
                              chat_template=TEMPLATE, **flags)


def _reference(vocab: SentencePieceVocab, prefix: bool = True) -> Tokenizer:
    """The tokenizer.json such a model ships (Llama 2's shape; Gemma's without the prefix space):
    the trained merges, byte fallback, BOS added by its post-processor."""
    merges, _ = _train()
    ids = {token: index for index, token in enumerate(vocab.tokens)}
    reference = Tokenizer(models.BPE(vocab=ids, merges=merges, byte_fallback=True, fuse_unk=True,
                                     unk_token="<unk>"))
    escape = normalizers.Replace(" ", SPACE)
    reference.normalizer = normalizers.Sequence([normalizers.Prepend(SPACE), escape] if prefix else [escape])
    steps = [decoders.Replace(SPACE, " "), decoders.ByteFallback(), decoders.Fuse()]
    reference.decoder = decoders.Sequence(steps + [decoders.Strip(" ", 1, 0)] if prefix else steps)
    specials = [*SPECIALS, CONTROL]
    reference.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in specials])
    reference.add_tokens([AddedToken(USER, special=False, normalized=False)])
    reference.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return reference


@pytest.fixture(scope="module")
def llama_spm(tmp_path_factory):
    """A tiny llama checkpoint whose embedding has a row per token of `_vocab()`."""
    torch.manual_seed(53)
    folder = tmp_path_factory.mktemp("spm") / "llama"
    return save_checkpoint(hf_model("llama", vocab_size=len(_vocab().tokens)), folder)


def _file(folder, path, vocab=None, **fields):
    return write_gguf(folder, path, sentencepiece=vocab or _vocab(), fields=fields or None)


@pytest.fixture(scope="module")
def spm_file(llama_spm, tmp_path_factory):
    return _file(llama_spm, tmp_path_factory.mktemp("spm_file") / "llama-spm.gguf")


def test_a_files_sentencepiece_ids_are_the_shipped_tokenizers_on_many_texts(spm_file):
    ours, reference = load_tokenizer(spm_file), _reference(_vocab())
    for text in _texts():
        for special in (True, False):
            assert ours.encode(text, add_special_tokens=special) == reference.encode(
                text, add_special_tokens=special).ids, (text, special)


def _plain(text: str) -> bool:
    """No special or added token spelled in it (decoding without special tokens drops those)."""
    return not any(token in text for token in [*SPECIALS, CONTROL, USER])


def test_decoding_gives_back_each_text_as_the_shipped_tokenizer_does(spm_file):
    ours, reference = load_tokenizer(spm_file), _reference(_vocab())
    for text in _texts():
        ids = ours.encode(text)
        assert ours.decode(ids) == reference.decode(ids, skip_special_tokens=False), text
        assert ours.decode(ids, skip_special_tokens=True) == reference.decode(ids), text
        if _plain(text):
            assert ours.decode(ids, skip_special_tokens=True) == text, text


def test_a_reply_streamed_token_by_token_is_the_reply_decoded_whole(spm_file):
    """The decoder strips one leading space (the prefix space): a reply streamed by ReplyText, which
    decodes windows of recent tokens, still joins into the whole reply's text."""
    from kvcache.generation.text import ReplyText

    tokenizer = load_tokenizer(spm_file)
    for text in _texts(120):
        ids = tokenizer.encode(text, add_special_tokens=False)
        reply = ReplyText(tokenizer)
        streamed = "".join(reply.add(token) for token in ids) + reply.finish()
        assert streamed == tokenizer.decode(ids, skip_special_tokens=True), text


def test_a_character_the_vocabulary_lacks_is_its_utf8_bytes(spm_file):
    tokenizer = load_tokenizer(spm_file)
    ids = tokenizer.encode("𝄞", add_special_tokens=False)
    pieces = [tokenizer.backend.id_to_token(token) for token in ids]
    assert pieces[1:] == [f"<0x{byte:02X}>" for byte in "𝄞".encode()]  # after the prefix space "▁"
    assert tokenizer.decode(ids) == "𝄞"
    assert tokenizer.decode(ids[:-1]).endswith("\ufffd")  # a character cut short, for ReplyText to hold


def test_the_empty_text_is_the_bos_alone(spm_file):
    tokenizer = load_tokenizer(spm_file)
    assert tokenizer.encode("") == [1] and tokenizer.encode("", add_special_tokens=False) == []


def test_text_after_a_special_token_starts_with_a_prefix_space_as_in_llama_cpp(spm_file):
    """llama.cpp adds the prefix space to every piece of text that follows a special token."""
    tokenizer = load_tokenizer(spm_file)
    hello = tokenizer.encode("hello", add_special_tokens=False)
    assert tokenizer.backend.id_to_token(hello[0]).startswith(SPACE)
    assert tokenizer.encode("<s>hello", add_special_tokens=False) == [1, *hello]
    control = tokenizer.token_to_id(CONTROL)
    assert tokenizer.encode(f"{CONTROL}hello", add_special_tokens=False) == [control, *hello]


def test_without_a_prefix_space_the_text_starts_as_written_as_gemma_files_say(llama_spm, tmp_path):
    vocab = _vocab(add_space_prefix=False)
    ours = load_tokenizer(_file(llama_spm, tmp_path / "gemma-like.gguf", vocab))
    reference = _reference(vocab, prefix=False)
    first = ours.encode("hello world", add_special_tokens=False)[0]
    assert not ours.backend.id_to_token(first).startswith(SPACE)
    for text in _texts(100):
        ids = ours.encode(text)
        assert ids == reference.encode(text).ids, text
        assert ours.decode(ids, skip_special_tokens=True) == (text if _plain(text) else reference.decode(ids))


def test_flags_the_file_leaves_out_read_as_llama_cpp_reads_them(llama_spm, tmp_path):
    """No add_bos_token, add_space_prefix or special ids: a BOS and a prefix space are added, and
    BOS, EOS and unknown are tokens 1, 2 and 0."""
    vocab = _vocab(add_space_prefix=None, add_bos=None, add_eos=None)
    absent = {f"tokenizer.ggml.{name}_token_id": None for name in ("bos", "eos", "unknown")}
    tokenizer = load_tokenizer(_file(llama_spm, tmp_path / "bare.gguf", vocab, **absent))
    named = (tokenizer.bos_token, tokenizer.eos_token, tokenizer.special_tokens["unk_token"])
    assert named == ("<s>", "</s>", "<unk>")
    assert tokenizer.encode("hello") == _reference(_vocab()).encode("hello").ids


def test_add_eos_token_ends_every_encoding_with_the_eos(llama_spm, tmp_path):
    tokenizer = load_tokenizer(_file(llama_spm, tmp_path / "eos.gguf", _vocab(add_eos=True)))
    ids = tokenizer.encode("hello world")
    assert (ids[0], ids[-1]) == (1, 2)
    assert ids[1:-1] == tokenizer.encode("hello world", add_special_tokens=False)
    assert tokenizer.encode("", add_special_tokens=True) == [1, 2]


def test_transformers_reading_of_the_file_gives_the_same_ids(spm_file):
    """transformers builds the same BPE from the file's scores. Its prefix space goes only before
    the whole text, and not when the text starts with a space; llama.cpp and sentencepiece add it
    there too (" hi" is ▁▁hi there, ▁hi in transformers) and after each special token: those texts
    are left out here."""
    from transformers import AutoTokenizer

    theirs = AutoTokenizer.from_pretrained(str(spm_file.parent), gguf_file=spm_file.name)
    ours = load_tokenizer(spm_file)
    for text in _texts(200):
        if _plain(text) and not text.startswith(" "):
            assert ours.encode(text) == theirs.encode(text), text


def test_the_files_chat_template_renders_with_its_tokens(spm_file):
    tokenizer = load_tokenizer(spm_file)
    messages = [{"role": "user", "content": "Hello, world"}, {"role": "assistant", "content": "Hi fox"}]
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == "<s><|user|>\nHello, world<|end|>\n<|assistant|>\nHi fox<|end|>\n<|assistant|>\n"
    ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    assert ids == _reference(_vocab()).encode(text, add_special_tokens=False).ids
    assert ids[:2] == [1, tokenizer.token_to_id(USER)] and ids.count(tokenizer.token_to_id(CONTROL)) == 2


def _llama_cpp_merges(text: str, vocab: dict[str, int], scores: list[float]) -> list[int]:
    """llama.cpp's SPM algorithm written out plainly: merge the adjacent pair whose joined text is
    the best-scored token (ties: the leftmost) until none is a token; leftovers as their bytes."""
    pieces = list(text)
    while True:
        best = None
        for at in range(len(pieces) - 1):
            joined = vocab.get(pieces[at] + pieces[at + 1])
            if joined is not None and (best is None or scores[joined] > best[0]):
                best = (scores[joined], at)
        if best is None:
            break
        at = best[1]
        pieces[at:at + 2] = [pieces[at] + pieces[at + 1]]
    ids = []
    for piece in pieces:
        ids += [vocab[piece]] if piece in vocab else [vocab[f"<0x{byte:02X}>"] for byte in piece.encode()]
    return ids


@pytest.mark.parametrize("seed", range(4))
def test_merges_follow_llama_cpps_score_order_on_random_vocabularies(seed):
    """Random pieces of a small alphabet with distinct random scores: any two tokens that join into
    a token merge, however the pieces were made."""
    rng = random.Random(seed)
    alphabet = list("ab▁cé")
    pieces = set(alphabet)
    while len(pieces) < 60:
        pieces.add("".join(rng.choice(alphabet) for _ in range(rng.randint(2, 5))))
    tokens = [*SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256)), *sorted(pieces)]
    types = [2, 3, 3] + [6] * 256 + [1] * len(pieces)
    scores = [0.0] * 259 + rng.sample(range(-1000, 0), len(pieces))
    vocab = {token: index for index, token in enumerate(tokens)}
    backend = sentencepiece_backend(tokens, [float(s) for s in scores], types, "<unk>", False, "random")
    for _ in range(300):
        text = "".join(rng.choice(alphabet + ["x", "€"]) for _ in range(rng.randint(0, 30)))
        assert backend.encode(text).ids == _llama_cpp_merges(text.replace(" ", SPACE), vocab, scores), text


def test_the_best_scored_pair_merges_first_where_unigram_would_take_the_best_total():
    """"abc" with ab (-1) and bc (-2): llama.cpp (and sentencepiece's BPE) join a+b first, giving
    ab c; a Unigram model over the same scores takes a bc, whose scores sum higher (-12 > -31)."""
    tokens = [*SPECIALS, *(f"<0x{byte:02X}>" for byte in range(256)), "a", "b", "c", "ab", "bc"]
    types = [2, 3, 3] + [6] * 256 + [1] * 5
    scores = [0.0] * 259 + [-10.0, -10.0, -30.0, -1.0, -2.0]
    ours = sentencepiece_backend(tokens, scores, types, "<unk>", False, "hand-made")
    assert ours.encode("abc").tokens == ["ab", "c"]
    unigram = Tokenizer(models.Unigram(list(zip(tokens, scores)), unk_id=0, byte_fallback=True))
    assert unigram.encode("abc").tokens == ["a", "bc"]


def test_scores_stored_as_integers_read_as_llama_cpp_reads_them(llama_spm, tmp_path, spm_file):
    vocab = _vocab()
    integers = ([int(score) for score in vocab.scores], gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.INT32)
    tokenizer = load_tokenizer(_file(llama_spm, tmp_path / "int-scores.gguf", vocab,
                                     **{"tokenizer.ggml.scores": integers}))
    floats = load_tokenizer(spm_file)
    for text in _texts(60):
        assert tokenizer.encode(text) == floats.encode(text), text


def test_a_vocabulary_cut_into_too_many_merges_is_refused(spm_file, monkeypatch):
    """The merges are bounded before they are all listed (a hostile vocabulary of "a", "aa", "aaa"
    ... cuts n tokens n²/2 ways)."""
    from kvcache.text import tokenizer_gguf_spm

    monkeypatch.setattr(tokenizer_gguf_spm, "MAX_MERGES", 50)
    message = "tokenizer.ggml.tokens can be cut into two tokens in more than 50 ways"
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(spm_file)


def _bad_files(vocab: SentencePieceVocab):
    count = len(vocab.tokens)
    array, f32, u32, string = (gguf.GGUFValueType.ARRAY, gguf.GGUFValueType.FLOAT32,
                               gguf.GGUFValueType.UINT32, gguf.GGUFValueType.STRING)
    nan_scores = [*vocab.scores[:-1], float("nan")]
    long_piece = [*vocab.tokens[:-3], "z" * 2000, *vocab.tokens[-2:]]
    return {
        "scores missing": ({"tokenizer.ggml.scores": None}, "tokenizer.ggml.scores is missing"),
        "scores short": ({"tokenizer.ggml.scores": (vocab.scores[:-1], array, f32)},
                         f"tokenizer.ggml.scores must be {count:,} numbers"),
        "scores of text": ({"tokenizer.ggml.scores": (vocab.tokens, array, string)},
                           "tokenizer.ggml.scores must be"),
        "a NaN score": ({"tokenizer.ggml.scores": (nan_scores, array, f32)},
                        "tokenizer.ggml.scores holds a NaN"),
        "a token more than rows": ({"tokenizer.ggml.tokens": ([*vocab.tokens, "extra"], array, string)},
                                   "tokenizer.ggml.tokens holds .* token_embd.weight has"),
        "a repeated token": ({"tokenizer.ggml.tokens": ([*vocab.tokens[:-1], "<s>"], array, string)},
                             "tokenizer.ggml.tokens repeats a token"),
        "a type out of range": ({"tokenizer.ggml.token_type": ([*vocab.types[:-1], 9], array,
                                                               gguf.GGUFValueType.INT32)},
                                "tokenizer.ggml.token_type holds a type outside"),
        "bos past the vocabulary": ({"tokenizer.ggml.bos_token_id": (count, u32)},
                                    "tokenizer.ggml.bos_token_id .* is not a token id"),
        "unknown id past it": ({"tokenizer.ggml.unknown_token_id": (count + 7, u32)},
                               "tokenizer.ggml.unknown_token_id"),
        "prefix flag not a bool": ({"tokenizer.ggml.add_space_prefix": (1, u32)},
                                   "tokenizer.ggml.add_space_prefix must be a bool"),
        "a piece too long": ({"tokenizer.ggml.tokens": (long_piece, array, string)},
                             rf"tokenizer.ggml.tokens\[{count - 3}\] has 2,000 characters"),
        "another kind": ({"tokenizer.ggml.model": ("t5", string)}, "of kind 't5'"),
    }


@pytest.mark.parametrize("case", list(_bad_files(_vocab())))
def test_bad_tokenizer_metadata_is_refused_naming_its_key(llama_spm, tmp_path, case):
    fields, message = _bad_files(_vocab())[case]
    path = _file(llama_spm, tmp_path / "bad.gguf", **fields)
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(path)


def test_a_byte_level_file_asking_for_a_bos_without_its_id_is_refused(llama_spm, tmp_path):
    """A byte-level file has no default BOS id (a sentencepiece file's is llama.cpp's, token 1)."""
    path = write_gguf(llama_spm, tmp_path / "bpe.gguf", fields={"tokenizer.ggml.bos_token_id": None})
    message = "add_bos_token is true but tokenizer.ggml.bos_token_id is not set"
    with pytest.raises(TokenizerError, match=message):
        load_tokenizer(path)


@pytest.mark.kernels
def test_kvcache_generate_runs_a_gemma3_file_carrying_a_sentencepiece_tokenizer(tmp_path, capsys):
    """The prompt and the chat message are tokenized by the file's tokenizer (the chat one through
    the file's template), and the text printed is the new tokens decoded."""
    from kvcache.cli import main

    vocab = _vocab(add_space_prefix=False)  # as gemma files are written
    torch.manual_seed(1)
    folder = save_checkpoint(hf_model("gemma3_text", vocab_size=len(vocab.tokens)), tmp_path / "gemma3")
    path = str(write_gguf(folder, tmp_path / "gemma3-spm.gguf", sentencepiece=vocab))
    tokenizer = load_tokenizer(path)
    prompt = ["generate", "-m", path, "--prompt", "The quick brown fox", "--max-tokens", "4"]
    assert main([*prompt, "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert len(report["tokens"]) == 4 and report["text"].strip()
    assert report["text"] == tokenizer.decode(report["tokens"], skip_special_tokens=True)
    assert main(prompt) == 0
    printed = capsys.readouterr()
    assert printed.out.strip() == report["text"].strip()
    assert f"after a {len(tokenizer.encode('The quick brown fox'))}-token prompt" in printed.err
    assert main(["generate", "-m", path, "--chat", "Hello, world", "--max-tokens", "4"]) == 0
    message = [{"role": "user", "content": "Hello, world"}]
    chat = tokenizer.apply_chat_template(message, add_generation_prompt=True)
    assert f"after a {len(chat)}-token prompt" in capsys.readouterr().err
