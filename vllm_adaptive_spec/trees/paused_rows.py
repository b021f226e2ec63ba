"""The rows an EAGLE-3 head reads late: the target's hidden states of the steps
in which the load budget paused drafting.

An EAGLE-3 head reads the target's auxiliary hidden states of position ``p``
(with token ``p + 1``) in the step that produced them, and never again. While
the load budget pauses drafting (``budget/pause_control.py``) no draft pass runs, so each
paused request's rows (input token and hidden states) are kept, and the next
drafting step feeds them first to complete the head's KV.

Decision: a paused step keeps its rows as one *block* (the rows the step
gathered for the whole batch anyway; without a copy when every request is
paused), and each request keeps views into blocks. A paused step then costs
no tensor operation per request, where a copy per request and step was the
largest part of a paused head's own cost at batch 64.

Memory is counted in block rows, exactly: a block lives while any request
keeps rows in it, whole. Rows released (a request resumed, finished or gave
its rows up) stay in memory while their block lives; when the blocks hold
more than twice the rows still kept, or more than the byte bound, the kept
rows are compacted into one block (each row is copied about once per
compaction that its block's releases pay for). Beyond ``limit_bytes`` of
kept rows, the requests keeping the most give theirs up (``given_up``) and
with them the head's drafts for the rest of their lives (their draft KV
would have a hole), until half the bound is left: the compaction that frees
their rows then comes once per half a bound of new rows, not once a step (at
batch 64 a copy of the whole bound every step or two cost 3.5-5.6 ms a step
in the engine).
Between steps the blocks hold at most ``limit_bytes``.
"""

from __future__ import annotations

import itertools

import torch

from vllm_adaptive_spec.trees.packed_ranges import packed_ranges


class _Block:
    """One paused step's kept rows: input tokens ``[R]`` and hidden states ``[R, H]``."""

    __slots__ = ("tokens", "hidden", "holders")

    def __init__(self, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        self.tokens, self.hidden, self.holders = tokens, hidden, 0

    @property
    def rows(self) -> int:
        return self.tokens.shape[0]


class _Kept:
    """A request's kept rows, positions ``start .. end - 1``, as ``(block, offset, length)`` parts in order."""

    __slots__ = ("start", "end", "parts")

    def __init__(self, start: int) -> None:
        self.start = self.end = start
        self.parts: list[tuple[_Block, int, int]] = []

    @property
    def rows(self) -> int:
        return self.end - self.start

    def views(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Its tokens and hidden states, part by part (views of the blocks)."""
        tokens = [block.tokens[offset:offset + length] for block, offset, length in self.parts]
        hidden = [block.hidden[offset:offset + length] for block, offset, length in self.parts]
        return tokens, hidden


class PausedRows:
    """Every request's kept rows (see the module's docstring)."""

    def __init__(self, limit_bytes: int) -> None:
        self.limit_bytes = limit_bytes
        self.given_up: set[str] = set()
        self._kept: dict[str, _Kept] = {}
        self.kept_rows = 0  # rows the requests keep
        self.block_rows = 0  # rows of the live blocks: what is in memory
        self.row_bytes = 0  # one row's token and hidden states (known from the first paused step)

    def rows(self, request_id: str) -> int:
        kept = self._kept.get(request_id)
        return 0 if kept is None else kept.rows

    def requests_held(self) -> int:
        """Requests with state here: kept rows, or given up."""
        return len(self._kept) + len(self.given_up)

    @property
    def bytes(self) -> int:
        return self.block_rows * self.row_bytes

    def keep(self, tokens: torch.Tensor, hidden: torch.Tensor, spans: list[tuple[str, int, int, int]]) -> None:
        """One paused step. ``tokens`` ``[N]`` and ``hidden`` ``[N, H]``: the
        step's rows, freshly gathered (never views of buffers vLLM reuses);
        ``spans``: ``(request_id, first_position, offset, length)`` for each
        paused request, its rows ``offset .. offset + length - 1``, in order.
        Rows not in a span are not kept (one gather leaves them out)."""
        if not spans:
            return
        if sum(length for *_, length in spans) != tokens.shape[0]:
            index = packed_ranges([offset for *_, offset, _ in spans], [length for *_, length in spans])
            index = torch.from_numpy(index).to(tokens.device)
            tokens, hidden = tokens[index], hidden[index]
            offsets = itertools.accumulate((length for *_, length in spans), initial=0)
            spans = [(request_id, position, offset, length)
                     for (request_id, position, _, length), offset in zip(spans, offsets)]
        block = _Block(tokens, hidden)
        self.row_bytes = hidden[0].numel() * hidden.element_size() + tokens.element_size()
        self.block_rows += block.rows
        for request_id, position, offset, length in spans:
            kept = self._kept.get(request_id)
            if kept is not None and kept.end != position:  # not contiguous (cannot happen in vLLM's step order)
                self._release(self._kept.pop(request_id))
                kept = None
            if kept is None:
                kept = self._kept[request_id] = _Kept(position)
            kept.parts.append((block, offset, length))
            kept.end += length
            block.holders += 1
            self.kept_rows += length

    def take(self, request_id: str, position: int) -> tuple[int, list[torch.Tensor], list[torch.Tensor]] | None:
        """Release the request's kept rows and return them, ``(first
        position, tokens, hidden states)`` as lists of parts in order; None
        where it keeps none that end at ``position``."""
        kept = self._kept.pop(request_id, None)
        if kept is None:
            return None
        self._release(kept)
        if kept.end != position:
            return None
        return kept.start, *kept.views()

    def drop(self, request_ids) -> None:
        """Forget finished or preempted requests."""
        for request_id in request_ids:
            self.given_up.discard(request_id)
            kept = self._kept.pop(request_id, None)
            if kept is not None:
                self._release(kept)

    def bound(self) -> None:
        """Once a step: beyond ``limit_bytes`` of kept rows give up the
        largest down to half of it, and compact the blocks where they hold
        more than twice the kept rows or more than ``limit_bytes``."""
        if not self.row_bytes:
            return
        if self.kept_rows * self.row_bytes > self.limit_bytes:
            self.give_up_largest()
        if self.block_rows > 2 * self.kept_rows or self.bytes > self.limit_bytes:
            self._compact()

    def give_up_largest(self) -> None:
        """Requests keeping the most rows give them up until the rest fit half of ``limit_bytes``."""
        for request_id in sorted(self._kept, key=lambda r: self._kept[r].rows, reverse=True):
            if 2 * self.kept_rows * self.row_bytes <= self.limit_bytes:
                return
            self._release(self._kept.pop(request_id))
            self.given_up.add(request_id)

    def _release(self, kept: _Kept) -> None:
        self.kept_rows -= kept.rows
        for block, _, _ in kept.parts:
            block.holders -= 1
            if not block.holders:
                self.block_rows -= block.rows

    def _compact(self) -> None:
        """Copy every kept row into one block; the old blocks are freed."""
        everyone = list(self._kept.values())
        if not everyone:
            return
        views = [kept.views() for kept in everyone]
        block = _Block(torch.cat([t for tokens, _ in views for t in tokens]),
                       torch.cat([h for _, hidden in views for h in hidden]))
        block.holders = len(everyone)
        offset = 0
        for kept in everyone:
            kept.parts = [(block, offset, kept.rows)]
            offset += kept.rows
        self.block_rows = block.rows
