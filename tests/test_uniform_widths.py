"""Width-bucketed uniform steps: the widths, and drafts padded to them."""

from vllm_adaptive_spec.trees.uniform_widths import drafted_nodes, step_width, step_widths, uniform_drafts


def test_widths_end_at_the_node_budget():
    assert step_widths(16) == (2, 4, 8, 16)
    assert step_widths(32) == (2, 4, 8, 16, 32)
    assert step_widths(5) == (2, 4, 5)
    assert step_widths(1) == (1,)


def test_a_step_takes_the_smallest_width_holding_its_largest_tree():
    widths = step_widths(16)
    assert [step_width(n, widths) for n in (0, 1, 2, 3, 5, 9, 16)] == [0, 2, 2, 4, 8, 16, 16]


def test_every_decoding_request_gets_the_steps_width():
    drafts = [[5, 6, 7], [], [8], [9, 1]]
    padded = uniform_drafts(drafts, [True, True, False, True], step_widths(16))
    assert padded == [[5, 6, 7, -1], [-1, -1, -1, -1], [], [9, 1, -1, -1]]
    assert [drafted_nodes(d) for d in padded] == [3, 0, 0, 2]
    # A step in which nothing is drafted stays draft-free.
    assert uniform_drafts([[], []], [True, True], step_widths(16)) == [[], []]


def test_a_uniform_step_stays_within_the_token_budget():
    """Three decoding requests and a token budget of 20 tokens a step: width 4
    (3 x 5 rows) fits, 8 does not, so the tree of 6 is cut to its first 4
    nodes; with 5 tokens not even width 2 fits and nothing changes."""
    drafts = [[5, 6, 7, 8, 9, 10], [], [1]]
    assert uniform_drafts(drafts, [True] * 3, step_widths(16), max_tokens=20) == [
        [5, 6, 7, 8], [-1, -1, -1, -1], [1, -1, -1, -1]]
    assert uniform_drafts(drafts, [True] * 3, step_widths(16), max_tokens=5) == drafts
