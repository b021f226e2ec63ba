"""The chain drafters ``retrieval_calibration`` replays beside the retrieval
trees: vLLM's own (``suffix``, ``ngram``) and ``grammar_forcing``'s. Each
is driven as its proposer drives it: ``start`` a request, ``draft`` after
the tokens so far, ``commit`` what the step emitted, ``stop``."""

from __future__ import annotations

import json

import numpy as np

from vllm_adaptive_spec.adapter.tree_scheduler import jump_forward_tokens


class SuffixChains:
    """vLLM's ``suffix`` method's drafter (Arctic Inference's Suffix Decoding,
    vLLM's defaults as ``benchmarks/throughput.py`` runs it), driven as vLLM's
    proposer drives it: a chain from the request's prompt tree and the cache of
    earlier answers (``cached_requests``; 0: the request's own text only);
    its nodes' probabilities are the drafter's own estimates."""

    def __init__(self, depth: int = 24, max_spec_factor: float = 1.0, min_token_prob: float = 0.1,
                 cached_requests: int = 10000) -> None:
        from arctic_inference.suffix_decoding import SuffixDecodingCache

        self.cache = SuffixDecodingCache(max_tree_depth=depth, max_cached_requests=cached_requests)
        self.depth, self.max_spec_factor, self.min_token_prob = depth, max_spec_factor, min_token_prob

    def start(self, k: int, prompt: list[int], first: list[int]) -> None:
        self.cache.start_request(k, prompt)
        self.cache.add_active_response(k, first)

    def draft(self, k: int, context: list[int]) -> tuple[list[int], list[float]]:
        draft = self.cache.speculate(k, context[-self.depth:], max_spec_tokens=self.depth,
                                     max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
        return list(draft.token_ids), list(draft.probs)

    def commit(self, k: int, tokens: list[int]) -> None:
        self.cache.add_active_response(k, tokens)

    def stop(self, k: int) -> None:
        self.cache.stop_request(k)


class NgramChains:
    """vLLM's ``ngram`` method's drafter (its own matching function; K=4,
    n-grams of 1 to 4 tokens, as ``benchmarks/throughput.py`` runs it). It
    gives no probabilities: its nodes are recorded as predicted 1."""

    def __init__(self, k: int = 4, min_n: int = 1, max_n: int = 4) -> None:
        from vllm.v1.spec_decode.ngram_proposer import _find_longest_matched_ngram_and_propose_tokens

        self.propose = _find_longest_matched_ngram_and_propose_tokens
        self.k, self.min_n, self.max_n = k, min_n, max_n

    def start(self, k: int, prompt: list[int], first: list[int]) -> None:
        pass

    def draft(self, k: int, context: list[int]) -> tuple[list[int], list[float]]:
        tokens = self.propose(np.asarray(context, dtype=np.int32), self.min_n, self.max_n, 1 << 30, self.k).tolist()
        return tokens, [1.0] * len(tokens)

    def commit(self, k: int, tokens: list[int]) -> None:
        pass

    def stop(self, k: int) -> None:
        pass


class JumpForwardChains:
    """``grammar_forcing``'s drafts (``adapter/tree_scheduler``): the string
    a JSON schema forces (xgrammar's jump-forward string) in the tokenizer's
    tokens less the last (``whole``: all), after the answer so far."""

    def __init__(self, schema: dict, whole: bool = False) -> None:
        import xgrammar as xgr
        from transformers import AutoTokenizer

        from vllm_adaptive_spec.demo_model import ensure_demo_model

        self.tokenizer, self.xgr, self.whole = AutoTokenizer.from_pretrained(str(ensure_demo_model())), xgr, whole
        info = xgr.TokenizerInfo.from_huggingface(self.tokenizer)
        self.grammar = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(schema))

    def start(self, k: int, prompt: list[int], first: list[int]) -> None:
        self.matcher = self.xgr.GrammarMatcher(self.grammar)
        self.commit(k, first)

    def validate_tokens(self, tokens: list[int]) -> list[int]:
        valid = self.commit(0, tokens)
        self.matcher.rollback(len(valid))
        return valid

    def draft(self, k: int, context: list[int]) -> tuple[list[int], list[float]]:
        def encode(text: str) -> list[int]:  # ``whole``: a token past the string, which the function drops
            return self.tokenizer.encode(text, add_special_tokens=False) + [-1] * self.whole

        tokens = jump_forward_tokens(self, encode, 16)
        return tokens, [1.0] * len(tokens)

    def commit(self, k: int, tokens: list[int]) -> list[int]:
        """The tokens the matcher took, until it ended or refused one."""
        taken = []
        for token in tokens:
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                break
            taken.append(token)
        return taken

    def stop(self, k: int) -> None:
        pass
