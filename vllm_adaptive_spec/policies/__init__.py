"""Tree policies, one per module; the shared interface and helpers in :mod:`.base`."""

from vllm_adaptive_spec.policies.base import TreePolicy, top_by_path_probability
from vllm_adaptive_spec.policies.c2t import C2TPolicy
from vllm_adaptive_spec.policies.chain import ChainPolicy
from vllm_adaptive_spec.policies.deagle import DeaglePolicy
from vllm_adaptive_spec.policies.dynatree import DynaTreePolicy
from vllm_adaptive_spec.policies.eagle2 import Eagle2Policy
from vllm_adaptive_spec.policies.retrieval import RetrievalPolicy
from vllm_adaptive_spec.policies.talon import TalonPolicy

POLICIES = {
    cls.name: cls
    for cls in (ChainPolicy, Eagle2Policy, RetrievalPolicy, TalonPolicy, DeaglePolicy, DynaTreePolicy, C2TPolicy)
}

__all__ = [
    "POLICIES",
    "C2TPolicy",
    "ChainPolicy",
    "DeaglePolicy",
    "DynaTreePolicy",
    "Eagle2Policy",
    "RetrievalPolicy",
    "TalonPolicy",
    "TreePolicy",
    "top_by_path_probability",
]
