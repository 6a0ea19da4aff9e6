"""The engine's scheduler: one step's plan as a pure function of what is running, what waits, the
free blocks and the limits (no model, no tensors; testable alone).

A sequence is its known tokens (prompt, then generated) of which `cached` are in the KV cache; a
forward runs the tokens the cache lacks. A running sequence lacking one token decodes (one token,
in the batched decode step); one lacking more is prefilling, in chunks. Each step:

1. every decoding sequence gets its token; when their new blocks do not fit, the newest running
   sequences are preempted (their blocks freed, the requests sent back to the front of the queue
   to be recomputed; their full blocks stay cached, so the recompute finds them);
   a decoding sequence that drafts (speculative decoding, `speculation`) then gets room for
   its draft, oldest first, as far as the token budget and the free blocks left allow (less of
   it, or none: a draft never preempts anything, and no draft runs in a step that preempts);
2. the token budget left (while sequences decode, at most the step's prefill cap) goes to
   prefill chunks: first of running sequences still prefilling (oldest first), then of waiting
   requests admitted in arrival order while the running cap and the free blocks allow (first
   come, first served: a request that does not fit holds back the ones behind it).
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class RunningSeq:
    """A sequence holding a row of the cache."""

    seq_id: int
    arrival: int  # submission order
    tokens: int  # known tokens: prompt (+ generated)
    cached: int  # of them, in the cache
    blocks: int  # blocks its table holds
    freeable: int  # blocks that preempting it returns (the ones no other sequence shares)
    draft: int = 0  # draft tokens it would verify beside its next token when it decodes


@dataclass(frozen=True)
class WaitingSeq:
    """A request waiting for a row: its tokens, and what the prefix cache would attach."""

    seq_id: int
    arrival: int
    tokens: int
    prefix: int  # tokens the prefix cache would attach (at most tokens - 1; a part of a block
    # past the whole ones is copied on the first write: it holds prefix // block_size blocks)
    prefix_idle: int  # of those blocks, ones no sequence uses now (attaching takes them)


@dataclass(frozen=True)
class Limits:
    block_size: int
    max_running: int  # sequences holding a row at once
    token_budget: int  # tokens one step runs, decode and prefill together


@dataclass
class Plan:
    """One step: who decodes, who prefills how many tokens, who joins, who is preempted."""

    decode: list[int] = field(default_factory=list)  # seq ids, one token each
    prefill: list[tuple[int, int]] = field(default_factory=list)  # (seq id, tokens to run)
    admit: list[int] = field(default_factory=list)  # waiting seq ids that take a row now
    preempt: list[int] = field(default_factory=list)  # running seq ids whose rows are freed
    drafts: dict[int, int] = field(default_factory=dict)  # decoding seq id -> draft tokens it runs

    @property
    def tokens(self) -> int:
        return len(self.decode) + sum(self.drafts.values()) + sum(count for _, count in self.prefill)


def blocks_for(tokens: int, block_size: int) -> int:
    return -(-tokens // block_size)


def schedule(
    running: list[RunningSeq],
    waiting: list[WaitingSeq],
    free_blocks: int,
    limits: Limits,
    prefill_cap: int | None = None,
) -> Plan:
    """The plan of one step (see the module docstring). `free_blocks`: blocks the pool can hand
    out (free, or cached and unused); `waiting` in queue order (preempted requests first).
    prefill_cap: the most prompt tokens a step may run while sequences decode (the engine's
    bound on what a prompt may add to their step, `step_costs`); None: what the token budget
    leaves."""
    plan = Plan()
    size = limits.block_size
    active = sorted(running, key=lambda seq: seq.arrival)
    free_blocks = _decode(plan, active, free_blocks, size)
    if not plan.preempt:  # (memory is short: no draft takes what a preemption gave back)
        free_blocks = _drafts(plan, active, free_blocks, limits.token_budget - len(plan.decode), size)
    budget = limits.token_budget - len(plan.decode) - sum(plan.drafts.values())
    if plan.decode and prefill_cap is not None:
        budget = min(budget, prefill_cap)
    for seq in active:
        lacking = seq.tokens - seq.cached
        if lacking <= 1 or budget <= 0:
            continue
        count = _fits(seq.cached, min(lacking, budget), seq.blocks, free_blocks, size)
        if count:
            plan.prefill.append((seq.seq_id, count))
            free_blocks -= blocks_for(seq.cached + count, size) - seq.blocks
            budget -= count
    if active and plan.tokens == 0 and len(active) > 1:
        # every running sequence is prefilling and none has room: free the newest's blocks, so
        # the older ones move on next step
        victim = active.pop()
        plan.preempt.append(victim.seq_id)
        return plan
    held = len(active)
    if plan.preempt:
        return plan  # memory is short this step: nothing new joins
    for seq in waiting:
        if budget <= 0 or held >= limits.max_running:
            break
        prefix_blocks = seq.prefix // size
        room = free_blocks - seq.prefix_idle  # attaching idle cached blocks takes them from the pool
        count = _fits(seq.prefix, min(seq.tokens - seq.prefix, budget), prefix_blocks, room, size)
        if count == 0:
            break  # first come, first served: nobody overtakes it
        plan.admit.append(seq.seq_id)
        plan.prefill.append((seq.seq_id, count))
        free_blocks = room - (blocks_for(seq.prefix + count, size) - prefix_blocks)
        budget -= count
        held += 1
    return plan


def _decode(plan: Plan, active: list[RunningSeq], free_blocks: int, size: int) -> int:
    """Plan every decoding sequence's token, preempting the newest (popped from `active`, in
    arrival order) while their new blocks do not fit; the free blocks left."""
    need = {
        seq.seq_id: blocks_for(seq.cached + 1, size) - seq.blocks
        for seq in active
        if seq.tokens - seq.cached == 1
    }
    while sum(need.values()) > free_blocks and len(active) > 1:
        victim = active.pop()  # the newest
        plan.preempt.append(victim.seq_id)
        free_blocks += victim.freeable
        need.pop(victim.seq_id, None)
    if sum(need.values()) > free_blocks:  # one sequence alone: submit refused what could not fit
        raise RuntimeError("the pool cannot hold one running sequence's next token")
    plan.decode = [seq.seq_id for seq in active if seq.seq_id in need]
    return free_blocks - sum(need.values())


def _drafts(plan: Plan, active: list[RunningSeq], free_blocks: int, budget: int, size: int) -> int:
    """Give the decoding sequences that draft (oldest first) as much of their drafts as `budget`
    tokens and the free blocks allow, after their next tokens; the free blocks left."""
    decoding = set(plan.decode)
    for seq in active:
        if seq.seq_id not in decoding or seq.draft <= 0 or budget <= 0:
            continue
        held = max(seq.blocks, blocks_for(seq.cached + 1, size))  # (the next token's counted)
        count = _fits(seq.cached + 1, min(seq.draft, budget), held, free_blocks, size)
        if count:
            plan.drafts[seq.seq_id] = count
            free_blocks -= blocks_for(seq.cached + 1 + count, size) - held
            budget -= count
    return free_blocks


def _fits(cached: int, wanted: int, blocks: int, free_blocks: int, size: int) -> int:
    """The most tokens (<= wanted) a sequence holding `cached` tokens in `blocks` blocks can add
    with `free_blocks` more blocks."""
    room = (blocks + free_blocks) * size - cached
    return max(0, min(wanted, room))
