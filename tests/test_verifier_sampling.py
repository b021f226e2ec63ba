"""Lossless sampling through the adapter's row processing (vLLM's own
temperature / top-k / top-p code) and tree acceptance, on synthetic logits.

Statistical test: chi-square goodness of fit of the committed first two tokens
against the exact processed target law, false-alarm rate alpha = 1e-3.
"""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from vllm_adaptive_spec.trees.tree import DraftTree, TreeBatch
from vllm_adaptive_spec.trees.verify import accept

ALPHA = 1e-3
VOCAB = 8
# Root children 0, 1, 2; node 0 (token 0) has children 3 (token 4), 4 (token 5).
TREE = DraftTree(tokens=[0, 1, 2, 4, 5], parents=[-1, -1, -1, 0, 0], q=[0.5, 0.3, 0.2, 0.6, 0.4])


def processed_law(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent reference of vLLM's order: temperature; keep the top-k
    tokens; renormalise; keep the most likely tokens until their mass reaches
    top_p."""
    probs = torch.softmax(logits.double() / temperature, -1)
    order = torch.argsort(probs, descending=True).tolist()
    kept = order[:top_k]
    mass = sum(float(probs[t]) for t in kept)
    chosen, running = [], 0.0
    for token in kept:
        if running >= top_p:
            break
        chosen.append(token)
        running += float(probs[token]) / mass
    law = torch.zeros_like(probs)
    law[chosen] = probs[chosen]
    return (law / law.sum()).numpy()


def sampling_metadata(batch: int, temperature: float, top_k: int, top_p: float):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.metadata import SamplingMetadata

    return SamplingMetadata(
        temperature=torch.full((batch,), temperature),
        all_greedy=False,
        all_random=True,
        top_p=torch.full((batch,), top_p),
        top_k=torch.full((batch,), top_k, dtype=torch.int32),
        generators={},
        max_num_logprobs=None,
        no_penalties=True,
        prompt_token_ids=None,
        frequency_penalties=torch.zeros(batch),
        presence_penalties=torch.zeros(batch),
        repetition_penalties=torch.ones(batch),
        output_token_ids=[[] for _ in range(batch)],
        allowed_token_ids_mask=None,
        bad_words_token_ids={},
        logitsprocs=LogitsProcessors(),
    )


def committed_pairs(row_logits: torch.Tensor, trials: int, temperature: float, top_k: int, top_p: float):
    """Run the adapter's row sampling and acceptance on ``trials`` identical
    requests; return the first committed token and the second (or -1 when the
    first left the tree, where the second would come from a later step)."""
    from vllm_adaptive_spec.adapter.verifier import tree_row_targets

    rows = row_logits.shape[0]
    logits = row_logits.repeat(trials, 1)
    # Drawn in chunks, as the verifier draws a large step.
    tokens = tree_row_targets(logits, list(range(0, trials * rows, rows)), list(range(trials)), [rows] * trials,
                              sampling_metadata(trials, temperature, top_k, top_p), max_rows=4096)
    result = accept(TreeBatch.from_trees([TREE] * trials), tokens.view(trials, rows))
    first = result.output_tokens[:, 0]
    second = torch.where(result.num_accepted >= 1, result.output_tokens[:, 1], -1)
    return first.numpy(), second.numpy()


def expected_pairs(laws: list[np.ndarray]) -> dict[tuple[int, int], float]:
    """Exact law of (first, second) with the second hidden (-1) off the tree."""
    root = laws[0]
    child_row = {token: node + 1 for node, (token, parent) in enumerate(zip(TREE.tokens, TREE.parents)) if parent == -1}
    cells = {}
    for x1 in range(VOCAB):
        if x1 in child_row:
            for x2 in range(VOCAB):
                cells[(x1, x2)] = root[x1] * laws[child_row[x1]][x2]
        else:
            cells[(x1, -1)] = root[x1]
    return cells


def chi_square_pvalue(first, second, cells) -> float:
    counts = {key: 0 for key in cells}
    for pair in zip(first.tolist(), second.tolist()):
        assert pair in counts, f"impossible outcome {pair}"
        counts[pair] += 1
    n = len(first)
    observed, expected, rare_obs, rare_exp = [], [], 0, 0.0
    for key, prob in cells.items():
        if prob * n < 5:
            rare_obs, rare_exp = rare_obs + counts[key], rare_exp + prob * n
        else:
            observed.append(counts[key])
            expected.append(prob * n)
    if rare_exp > 0:
        observed.append(rare_obs)
        expected.append(rare_exp)
    expected = np.array(expected) * (n / sum(expected))
    return chisquare(observed, expected).pvalue


@pytest.mark.parametrize(
    "temperature,top_k,top_p",
    [(1.0, VOCAB, 1.0), (0.7, VOCAB, 1.0), (1.3, 4, 1.0), (1.0, VOCAB, 0.8), (0.8, 5, 0.9)],
)
def test_committed_tokens_follow_the_processed_target(temperature, top_k, top_p):
    torch.manual_seed(0)
    row_logits = torch.randn(1 + len(TREE), VOCAB) * 1.5
    # Make tree tokens likely enough that paths are accepted often.
    row_logits[0, :3] += 1.5
    row_logits[1, 4:6] += 1.5
    laws = [processed_law(row, temperature, top_k, top_p) for row in row_logits]
    first, second = committed_pairs(row_logits, 60_000, temperature, top_k, top_p)
    assert (second >= 0).mean() > 0.3, "the tree was rarely used"
    assert chi_square_pvalue(first, second, expected_pairs(laws)) > ALPHA


def test_the_test_detects_a_wrong_temperature():
    """Power check: samples processed at another temperature are rejected."""
    torch.manual_seed(0)
    row_logits = torch.randn(1 + len(TREE), VOCAB) * 1.5
    laws = [processed_law(row, 1.0, VOCAB, 1.0) for row in row_logits]
    first, second = committed_pairs(row_logits, 60_000, 0.8, VOCAB, 1.0)
    assert chi_square_pvalue(first, second, expected_pairs(laws)) < ALPHA


def test_row_chunks_keep_requests_whole_and_within_the_bound():
    from vllm_adaptive_spec.adapter.verifier import row_chunks

    assert row_chunks([], 8) == []
    assert row_chunks([3, 3, 3], 8) == [range(0, 2), range(2, 3)]
    assert row_chunks([3, 5, 9, 1, 8], 8) == [range(0, 2), range(2, 3), range(3, 4), range(4, 5)]
    counts = torch.randint(1, 18, (200,), generator=torch.Generator().manual_seed(0)).tolist()
    chunks = row_chunks(counts, 40)
    assert [k for chunk in chunks for k in chunk] == list(range(200))
    assert all(sum(counts[k] for k in chunk) <= 40 for chunk in chunks)
    # Each chunk is full: the next request would not have fitted.
    assert all(sum(counts[k] for k in chunk) + counts[chunk[-1] + 1] > 40 for chunk in chunks[:-1])


def test_chunked_draws_equal_one_draw():
    """Seeded, unseeded-greedy and sampled requests of one step, some
    without trees: drawn in chunks of at most 10 rows, every row gets the
    token a single draw over all rows gives, seeded rows included (a
    request's noise comes from its generator in one call either way); a
    greedy batch gets each tree row's argmax."""
    from vllm_adaptive_spec.adapter.verifier import row_chunks, row_target_tokens, tree_row_targets

    gen = torch.Generator().manual_seed(1)
    batch, vocab = 9, 50
    counts_all = torch.randint(1, 7, (batch,), generator=gen).tolist()
    starts = [sum(counts_all[:i]) for i in range(batch)]
    logits = torch.randn(sum(counts_all), vocab, generator=gen) * 2
    requests = [0, 2, 3, 5, 6, 8]  # the requests with trees
    counts = [counts_all[r] for r in requests]

    def metadata():
        meta = sampling_metadata(batch, 0.9, 20, 0.95)
        meta.temperature[[2, 6]] = 0.0  # greedy
        return replace(meta, all_random=False,
                       generators={r: torch.Generator().manual_seed(100 + r) for r in (0, 3, 5, 8)})

    chunked = tree_row_targets(logits, starts, requests, counts, metadata(), max_rows=10)
    rows = torch.tensor([starts[r] + j for r in requests for j in range(counts_all[r])])
    owners = torch.tensor(requests).repeat_interleave(torch.tensor(counts))
    whole = row_target_tokens(logits[rows], owners.tolist(), metadata())
    assert len(row_chunks(counts, 10)) > 1
    assert torch.equal(chunked, whole)
    greedy = torch.isin(owners, torch.tensor([2, 6]))
    assert torch.equal(chunked[greedy], logits[rows][greedy].argmax(-1))
    # A greedy batch: one argmax over every row, the tree rows' kept.
    all_greedy = replace(sampling_metadata(batch, 0.0, vocab, 1.0), all_greedy=True, all_random=False)
    assert torch.equal(tree_row_targets(logits, starts, requests, counts, all_greedy, max_rows=10),
                       logits[rows].argmax(-1))



def _emitted_slots(seed: int, emitted: list[int], width: int = 5, vocab: int = 50):
    """Random logits of ``width`` rows a request, the requests' first rows, and
    an output of ``emitted[k]`` random tokens for request ``k`` (-1 after)."""
    rng = torch.Generator().manual_seed(seed)
    batch = len(emitted)
    logits = torch.randn(batch * width, vocab, generator=rng)
    output = torch.full((batch, width), -1, dtype=torch.int32)
    for request, count in enumerate(emitted):
        output[request, :count] = torch.randint(0, vocab, (count,), generator=rng, dtype=torch.int32)
    return logits, torch.arange(0, batch * width, width), output


def test_logprobs_are_read_for_emitted_slots_only_in_bounded_chunks(monkeypatch):
    """Each emitted slot's logprobs are vLLM's for its row (here every slot
    reads its request's first row: no trees), placeholder slots stay zero
    (vLLM drops them), and no chunk reads more than ``MAX_CHUNK_ROWS`` rows."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_adaptive_spec.adapter import verifier

    monkeypatch.setattr(verifier, "MAX_CHUNK_ROWS", 4)
    sampler = Sampler("raw_logprobs")
    chunks = []
    gather = sampler.gather_logprobs
    def counted(values, k, tokens):
        chunks.append(len(tokens))
        return gather(values, k, tokens)

    monkeypatch.setattr(sampler, "gather_logprobs", counted)
    logits, starts, output = _emitted_slots(0, [1, 5, 3])
    width = output.shape[1]
    tree_verifier = verifier.TreeVerifier(sampler, "raw_logprobs", lambda *_: None, lambda indices: [])
    got = tree_verifier._logprobs(logits, starts, output, None, None,
                                  SimpleNamespace(max_num_logprobs=2, logprob_token_ids=None))
    assert chunks == [4, 4, 1]
    slots = (output.flatten() >= 0).nonzero().squeeze(1)
    rows = starts.repeat_interleave(width)[slots]
    expected = gather(Sampler.compute_logprobs(logits[rows]), 2, output.flatten()[slots].long())
    for value, want in zip(got[:3], expected[:3]):
        assert torch.equal(value[slots], want)
        assert not value[(output.flatten() < 0).nonzero().squeeze(1)].any()


@pytest.mark.parametrize("chunk_rows", [4, 64])
def test_logprob_token_ids_are_vllms_for_every_emitted_slot(monkeypatch, chunk_rows):
    """With ``logprob_token_ids`` in the step, every emitted slot gets vLLM's
    specific-token layout over the whole batch (its width the most ids any
    request asks for), chunks or not: what vLLM's sampler gives those rows."""
    from vllm.v1.sample.sampler import Sampler

    from vllm_adaptive_spec.adapter import verifier

    monkeypatch.setattr(verifier, "MAX_CHUNK_ROWS", chunk_rows)
    sampler = Sampler("raw_logprobs")
    logits, starts, output = _emitted_slots(1, [2, 5, 4])
    width = output.shape[1]
    ids = {0: [3, 9, 11], 2: [7]}
    metadata = SimpleNamespace(max_num_logprobs=None, logprob_token_ids=ids)
    got = verifier.TreeVerifier(sampler, "raw_logprobs", lambda *_: None, lambda indices: [])._logprobs(
        logits, starts, output, None, None, metadata)
    slots = (output.flatten() >= 0).nonzero().squeeze(1)
    rows = starts.repeat_interleave(width)[slots]
    by_slot = {k: ids[int(slot) // width] for k, slot in enumerate(slots) if int(slot) // width in ids}
    expected = sampler.gather_specific_token_logprobs(Sampler.compute_logprobs(logits[rows]), by_slot,
                                                      output.flatten()[slots].long())
    assert got.logprob_token_ids.shape[1] == 4
    for value, want in zip(got[:3], expected[:3]):
        assert torch.equal(value[slots], want)
