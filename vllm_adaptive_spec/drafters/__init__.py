"""Drafters: where candidate tokens come from (retrieval here; model drafters later)."""

from vllm_adaptive_spec.drafters.retrieval import RetrievalDrafter

DRAFTERS = {cls.name: cls for cls in (RetrievalDrafter,)}
# Which policies each drafter supports.
DRAFTER_POLICIES = {"retrieval": ("retrieval", "chain")}
