"""Width-bucketed uniform tree steps.

A CUDA graph replays one shape: a decode step of ``B`` requests with ``R``
rows each. Trees of the sizes the load budget chooses are ragged, so a
drafting step gives every decode request the same ``W`` draft slots, ``W``
the smallest of a few widths that holds the step's largest tree; the slots a
tree does not fill are ``-1``, which vLLM itself uses for drafts it does not
verify (its scheduler pads a request's rejected grammar drafts with them, its
runner clamps them before the embedding), and which the plugin's layout
turns into padding rows that no row sees and none can accept. A request
without a tree in such a step gets ``W`` placeholders (vLLM's sampler takes
its token from its first row, as for vLLM's own placeholders). Adaptivity
stays in which nodes fill the slots and which width a step uses.

Decision: widths 2, 4, 8, 16 and ``N``: each halving of
padding rows beyond 16 buys little on a GPU, where rows up to about 64 cost
almost nothing (``../shared/gpu/README.md``), and five widths keep the
captured graphs few.
"""

from __future__ import annotations

import bisect

PAD = -1
WIDTHS = (2, 4, 8, 16)


def step_widths(max_nodes: int) -> tuple[int, ...]:
    """The widths a step may use when a tree holds ``max_nodes`` at most."""
    return tuple(sorted({width for width in WIDTHS if width < max_nodes} | {max_nodes}))


def step_width(longest: int, widths: tuple[int, ...]) -> int:
    """The smallest width that holds ``longest`` drafts (0: a draft-free step)."""
    if longest == 0:
        return 0
    return next((width for width in widths if width >= longest), widths[-1])


def uniform_drafts(drafts: list[list[int]], decoding: list[bool], widths: tuple[int, ...],
                   max_tokens: int | None = None) -> list[list[int]]:
    """Each decoding request's drafts padded with ``-1`` to the step's width
    (:func:`step_width` of the longest); requests not decoding (a partial
    prompt, whose drafts vLLM ignores) keep none. A step without any draft
    stays draft-free. With ``max_tokens`` (the scheduler's token budget) the
    width is the widest whose step fits, trees cut to it (a breadth-first
    prefix is a tree), so the scheduler never cuts the uniform step; when
    not even the narrowest fits, the drafts stay as they are."""
    width = step_width(max((len(d) for d in drafts), default=0), widths)
    if width == 0:
        return drafts
    if max_tokens is not None:
        requests = sum(decoding)
        fitting = [w for w in widths if requests * (1 + w) <= max_tokens]
        if not fitting:
            return drafts
        width = min(width, fitting[-1])
    return [list(d[:width]) + [PAD] * (width - len(d[:width])) if decode else []
            for d, decode in zip(drafts, decoding)]


def drafted_nodes(drafts: list[int]) -> int:
    """How many of a request's scheduled drafts are tree nodes: those before
    the first ``-1`` (the rest are padding; all of them are for vLLM's own
    placeholders)."""
    return next((k for k, token in enumerate(drafts) if token < 0), len(drafts))


def plugin_batch_sizes(max_num_seqs: int, max_tokens: int) -> list[int]:
    """The batch sizes the plugin captures its graphs for (and pads steps
    to), in vLLM's default pattern without speculation (1, 2, 4, every 8 to
    256, every 16 beyond) up to ``max_num_seqs`` and ``max_tokens`` (vLLM's
    largest capture size, beyond which it dispatches no graph), that limit
    itself included. Decision: the plugin's own list, since vLLM's sizes are
    rounded to multiples of ``1 + num_speculative_tokens`` under speculation
    (with 16 drafts and ``max_num_seqs`` 8 not one of them would be a batch
    size)."""
    limit = min(max_num_seqs, max_tokens)
    pattern = [1, 2, 4, *range(8, 256, 8), *range(256, limit + 1, 16)]
    return sorted({size for size in pattern if size < limit} | {limit}) if limit >= 1 else []


def padded_rows(num_tokens: int, limit: int) -> int:
    """The rows a draft forward of ``num_tokens`` rows is padded to where no
    graph pads it: the next of :func:`plugin_batch_sizes`, at most ``limit``."""
    sizes = plugin_batch_sizes(limit, limit)
    index = bisect.bisect_left(sizes, num_tokens)
    return sizes[index] if index < len(sizes) else num_tokens


def uniform_rows(max_query_len: int, num_tokens: int, num_reqs: int) -> int | None:
    """Every request's row count when they all have the same, else None."""
    return max_query_len if num_reqs and num_tokens == num_reqs * max_query_len else None
