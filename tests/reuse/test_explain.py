"""The prefix-miss explainer classifies each cause from constructed prompts: a character per token,
chat messages rendered with segments, no model."""

import os

import pytest

from kvcache.blocks.allocator import salt_root
from kvcache.reuse.explain import PrefixExplainer, Segment

BLOCK = 4


def decode(ids):
    return "".join(chr(i) for i in ids)


def render(messages, tools=None):
    """A toy chat template: each part's text with its segment's token range (one token per char)."""
    ids, segments = [], []

    def part(name, text):
        segments.append(Segment(name, len(ids), len(ids) + len(text)))
        ids.extend(ord(c) for c in text)

    for index, (role, text) in enumerate(messages):
        part("system" if role == "system" else f"message {index}", f"<|{role}|>{text}<|end|>")
        if index == 0 and tools:
            part("tools", "".join(f"<tool>{tool}</tool>" for tool in tools))
    part("generation prompt", "<|assistant|>")
    return ids, segments


def explainer(**options):
    return PrefixExplainer(BLOCK, decode=decode, **options)


SYSTEM = ("system", "You are a careful helper. Today is 2026-12-05, 10:41.")
TURN = [SYSTEM, ("user", "Write a haiku about caches please"), ("assistant", "Blocks kept warm in memory")]


def seen_then(first, second, **options):
    explain = explainer(**options)
    explain.record(*first)
    return explain.explain(*second)


def test_a_repeated_prompt_is_a_hit_matching_all_but_its_last_token():
    """The last token is always run (for its logits): every token before it matched."""
    ids, segments = render(TURN)
    answer = seen_then((ids, b"", segments), (ids, b"", segments))
    assert (answer.cause, answer.first_divergent_token) == ("hit", None)
    assert answer.matched_tokens == len(ids) - 1


def test_a_prompt_shorter_than_a_block_says_so():
    answer = explainer().explain([1, 2, 3])
    assert answer.cause == "shorter_than_block" and answer.matched_tokens == 0


def test_a_prompt_like_nothing_seen_is_never_seen():
    explain = explainer()
    explain.record(render([("user", "something else entirely")])[0])
    ids, segments = render(TURN)
    answer = explain.explain(ids, segments=segments)
    assert (answer.cause, answer.matched_tokens, answer.first_divergent_token) == ("never_seen", 0, 0)


def test_the_same_prompt_under_another_cache_salt_is_told_apart():
    ids, segments = render(TURN)
    answer = seen_then((ids, salt_root("alice"), segments), (ids, salt_root("bob"), segments))
    assert answer.cause == "cache_salt" and answer.matched_tokens == 0


def test_a_changed_timestamp_in_the_system_prompt_is_a_volatile_field():
    old, old_segments = render(TURN)
    later = [("system", SYSTEM[1].replace("10:41", "10:57")), *TURN[1:]]
    new, segments = render(later)
    answer = seen_then((old, b"", old_segments), (new, b"", segments))
    assert answer.cause == "volatile_system_field" and answer.segment == "system"
    assert answer.first_divergent_token == decode(old).index("10:41") + 3
    assert answer.matched_tokens == answer.first_divergent_token


def test_a_dropped_think_block_is_history_re_rendered():
    with_reasoning = [*TURN[:2], ("assistant", "<think>count syllables</think>Blocks kept warm in memory")]
    old, old_segments = render(with_reasoning)
    new, segments = render([*TURN, ("user", "another one")])
    answer = seen_then((old, b"", old_segments), (new, b"", segments))
    assert answer.cause == "reasoning_rerendered" and answer.segment == "message 2"


def test_an_empty_think_block_added_is_history_re_rendered():
    old, old_segments = render(TURN)
    new, segments = render([*TURN[:2], ("assistant", "<think></think>Blocks kept warm in memory")])
    assert seen_then((old, b"", old_segments), (new, b"", segments)).cause == "reasoning_rerendered"


def test_tools_sent_in_another_order_are_reordered():
    old, old_segments = render(TURN, tools=["search", "read_file"])
    new, segments = render(TURN, tools=["read_file", "search"])
    answer = seen_then((old, b"", old_segments), (new, b"", segments))
    assert (answer.cause, answer.segment) == ("tools_reordered", "tools")


def test_whitespace_or_case_only_changes_are_normalisation():
    old, old_segments = render(TURN)
    new, segments = render([*TURN[:2], ("Assistant", "Blocks kept  warm in memory")])
    answer = seen_then((old, b"", old_segments), (new, b"", segments))
    assert (answer.cause, answer.segment) == ("normalisation", "message 2")


def test_another_message_text_is_an_edit():
    old, old_segments = render(TURN)
    new, segments = render([*TURN[:2], ("assistant", "A different answer here")])
    assert seen_then((old, b"", old_segments), (new, b"", segments)).cause == "edited"


def test_blocks_no_tier_holds_are_evicted_from_the_tiers_asked():
    ids, segments = render(TURN)
    explain = explainer()
    explain.record(ids, segments=segments)
    answer = explain.explain(ids, segments=segments, held=lambda digest: False, tiers="memory,disk")
    assert (answer.cause, answer.tier, answer.first_divergent_token) == ("evicted", "memory,disk", 0)


def test_a_match_past_the_sliding_window_stops_at_the_window():
    ids, segments = render(TURN)
    answer = seen_then((ids, b"", segments), (ids, b"", segments), window=16)
    assert (answer.cause, answer.first_divergent_token) == ("window", 16)


def test_the_closest_of_many_earlier_prompts_is_the_one_compared():
    explain = explainer()
    old, old_segments = render(TURN)
    explain.record(old, segments=old_segments)
    explain.record(render([("user", "unrelated")])[0])
    new, segments = render([*TURN, ("user", "next turn")])
    answer = explain.explain(new, segments=segments)
    assert answer.matched_tokens >= len(old) - len("<|assistant|>")
    assert answer.segment in ("message 2", "message 3")


def test_the_record_is_bounded():
    explain = explainer(capacity=3)
    for index in range(10):
        explain.record([index] * 8)
    assert len(explain) == 3


def test_bad_settings_name_themselves():
    with pytest.raises(ValueError, match="block_size"):
        PrefixExplainer(0)
    with pytest.raises(ValueError, match="capacity"):
        PrefixExplainer(4, capacity=0)


def test_a_prompt_that_continues_an_earlier_one_whole_is_a_hit():
    """The next turn of a chat holds the previous prompt whole, then the reply and a new message:
    nothing diverged, whatever the new text holds (here a think block)."""
    old, old_segments = render(TURN[:2])
    reply = ("assistant", "<think>five seven five</think>Blocks kept warm in memory")
    new, segments = render([*TURN[:2], reply, ("user", "Another, please")])
    answer = seen_then((old, b"", old_segments), (new, b"", segments))
    assert (answer.cause, answer.first_divergent_token, answer.matched_tokens) == ("hit", None, len(old))
    assert answer.segment == "message 2"


def test_tools_reordered_are_told_by_their_text_where_the_tokens_merge_across_joints():
    """A tokenizer merges the characters where one tool's text meets the next (`}\\n{`), so the same
    tools in another order are other token ids; their text holds the same characters."""
    pieces = {1: "<sys>", 2: '{"a"}', 3: '\\n{"b"}', 4: '{"b"}', 5: '\\n{"a"}', 6: "</sys>", 7: "<gen>"}
    old, new = [1, 1, 1, 1, 2, 3, 6, 7, 7, 7, 7, 7], [1, 1, 1, 1, 4, 5, 6, 7, 7, 7, 7, 7]
    segments = [Segment("system", 0, 4), Segment("tools", 4, 6), Segment("system", 6, 7),
                Segment("generation prompt", 7, 12)]
    explain = PrefixExplainer(BLOCK, decode=lambda ids: "".join(pieces[i] for i in ids))
    explain.record(old, segments=segments)
    answer = explain.explain(new, segments=segments)
    assert (answer.cause, answer.segment, answer.first_divergent_token) == ("tools_reordered", "tools", 4)


PARTIAL_BLOCK = 48  # CHAT's render: two whole blocks, then the user's message's end and the generation prompt
CHAT = TURN[:2]


@pytest.mark.parametrize(("question", "cause"), [("Write a haiku about caches  please", "normalisation"),
                                                 ("Write a haiku about caches, please", "edited")])
def test_a_change_inside_the_last_partial_block_is_found_and_classified(question, cause):
    """The prompt's last, incomplete block has no hash: its tokens are compared one by one."""
    old, old_segments = render(CHAT)
    new, segments = render([SYSTEM, ("user", question)])
    at = len(os.path.commonprefix([decode(old), decode(new)]))
    assert at >= PARTIAL_BLOCK * ((len(new) - 1) // PARTIAL_BLOCK)  # past the last whole block
    explain = PrefixExplainer(PARTIAL_BLOCK, decode=decode)
    explain.record(old, segments=old_segments)
    answer = explain.explain(new, segments=segments)
    assert (answer.cause, answer.segment, answer.first_divergent_token, answer.matched_tokens) == (
        cause, "message 1", at, at)


def test_the_turn_after_a_perturbed_one_is_compared_with_the_prompt_it_continues():
    """A turn, the same turn with a change inside its last partial block, then the next turn that
    continues the first: a hit against the first, though the perturbed one is newer and shares as
    many whole blocks."""
    explain = PrefixExplainer(PARTIAL_BLOCK, decode=decode)
    old, old_segments = render(CHAT)
    explain.record(old, segments=old_segments)
    perturbed, perturbed_segments = render([SYSTEM, ("user", "Write a haiku about caches  please")])
    explain.record(perturbed, segments=perturbed_segments)
    new, segments = render([*TURN, ("user", "Another, please")])
    answer = explain.explain(new, segments=segments)
    assert (answer.cause, answer.first_divergent_token, answer.matched_tokens) == ("hit", None, len(old))


def test_a_remembered_reply_is_the_closest_only_where_the_history_holds_its_start():
    """What the server holds after a reply (prompt and reply tokens) is compared with a next turn
    that sends the reply back, changed partway (named there, in the reply's message); a history
    whose message holds none of the reply continues the prompt alone, a hit as before."""
    asked, asked_segments = render(TURN[:2])
    reply = [ord(c) for c in "Blocks kept warm in memory<|end|>"]
    changed, changed_segments = render(TURN[:2] + [("assistant", "Blocks kept cold in memory"),
                                                   ("user", "Another")])
    explain = explainer()
    explain.observe(asked, segments=asked_segments)
    explain.record_reply(asked, reply, segments=asked_segments)
    found = explain.explain(changed, segments=changed_segments)
    at = len(asked) + len("Blocks kept ")
    assert (found.cause, found.first_divergent_token, found.segment) == ("edited", at, "message 2")
    other, other_segments = render(TURN[:2] + [("assistant", "Nothing alike"), ("user", "Another")])
    assert explain.explain(other, segments=other_segments).cause == "hit"


def test_a_reply_that_opened_with_reasoning_sent_back_without_it_is_reasoning_rerendered():
    """A history whose message holds none of the server's reply (not its first token) continues the
    prompt; where the reply opened with a <think> block the message lacks (a client that drops
    reasoning, a template that renders nothing in its place), that is named at the reply's start."""
    asked, asked_segments = render(TURN[:2])
    explain = explainer()
    explain.observe(asked, segments=asked_segments)
    explain.record_reply(asked, [ord(c) for c in "<think>count</think>Blocks kept warm<|end|>"],
                         segments=asked_segments)
    dropped, dropped_segments = render(TURN[:2] + [("assistant", "Blocks kept warm"), ("user", "More")])
    found = explain.explain(dropped, segments=dropped_segments)
    assert (found.cause, found.first_divergent_token, found.segment) == (
        "reasoning_rerendered", len(asked), "message 2")
    kept, kept_segments = render(TURN[:2] + [("assistant", "<think>count</think>Blocks kept warm"),
                                              ("user", "More")])
    assert explain.explain(kept, segments=kept_segments).cause == "hit"
