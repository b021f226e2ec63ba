"""The tree proposer as vLLM's drafter object for ``adaptive_tree``.

vLLM builds it as the ``custom_class`` proposer (``TreeProposer(vllm_config)``);
it is the step's :class:`~vllm_adaptive_spec.step.propose.Proposer` built from
vLLM's config. The tree runner calls ``propose_trees`` with what the stock
proposer call lacks (request ids, sampling parameters).
"""

from __future__ import annotations

from vllm_adaptive_spec.adapter import ragged_or_uniform
from vllm_adaptive_spec.adapter.config_hook import tree_config_of
from vllm_adaptive_spec.step.propose import Proposer


class TreeProposer(Proposer):
    def __init__(self, vllm_config) -> None:
        config = tree_config_of(vllm_config)
        if config is None:
            raise ValueError("TreeProposer is only used with method='adaptive_tree'")
        model_config = vllm_config.model_config
        super().__init__(config, ragged_or_uniform.resolve(config, vllm_config),
                         vllm_config.device_config.device_type, model_config.max_model_len,
                         vllm_config.scheduler_config.max_num_batched_tokens)
        if getattr(self.drafter, "corpus_path", ""):
            from transformers import AutoTokenizer

            tokenizer = AutoTokenizer.from_pretrained(model_config.tokenizer, revision=model_config.tokenizer_revision)
            self.drafter.load_corpus(lambda text: tokenizer.encode(text, add_special_tokens=False))

    def load_model(self, *args, **kwargs) -> None:
        """Only the retrieval drafter runs as vLLM's drafter object, and it has no
        weights (model drafters' weights are loaded by vLLM's own proposer)."""

    def propose(self, *args, **kwargs):
        raise RuntimeError("TreeProposer is driven by the adaptive_tree model runner (propose_trees)")
