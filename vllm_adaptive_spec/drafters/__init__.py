"""Drafters: where candidate tokens come from (retrieval, EAGLE-3 heads, draft
LMs, and the hybrid of a model and retrieval)."""

from vllm_adaptive_spec.drafters.hybrid import HybridDrafter
from vllm_adaptive_spec.drafters.model import DraftModelDrafter, Eagle3Drafter
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter

DRAFTERS = {cls.name: cls for cls in (RetrievalDrafter, Eagle3Drafter, DraftModelDrafter, HybridDrafter)}
# Which policies each drafter supports; the first is the default.
DRAFTER_POLICIES = {
    "retrieval": ("retrieval", "chain"),
    "eagle3": ("eagle2", "chain", "talon", "deagle", "dynatree", "c2t"),
    "draft_model": ("eagle2", "chain", "talon", "deagle", "dynatree", "c2t"),
    "hybrid": ("eagle2", "chain", "talon", "deagle", "dynatree", "c2t"),
}
