"""The ``adaptive_tree`` speculative config: parsing and validation.

User contract::

    {"method": "adaptive_tree", "num_speculative_tokens": N,
     "model": "<draft model dir, when the drafter needs one>",
     "tree": {"drafter": "...", "policy": "...", "<parameter>": value, ...}}

``num_speculative_tokens`` is ``N``, the most draft nodes per request per step. Every
error names the offending key and the valid choices.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from vllm_adaptive_spec.classifier import FILE_NAME
from vllm_adaptive_spec.config_schema import Param
from vllm_adaptive_spec.drafters import DRAFTER_POLICIES, DRAFTERS
from vllm_adaptive_spec.drafters.retrieval_tensors import make_retrieval
from vllm_adaptive_spec.drafters.retrieval_trie import matcher_of
from vllm_adaptive_spec.policies import POLICIES

logger = logging.getLogger("vllm.adaptive_spec")
METHOD = "adaptive_tree"
MAX_NODES = 128  # vLLM's rejection-sampler layout caps drafts per request at 128.
MAX_DRAFT_SLOTS = 512  # KV scratch a model drafter may use per request while growing
# Settings of the tree engine itself, beside the drafter's and the policy's.
ENGINE_PARAMS = {
    "load_budget": Param(
        str, "adaptive", "one of 'adaptive', 'fixed'", lambda v: v in ("adaptive", "fixed")
    ),
    # How drafting steps are shaped (``step/modes``): ``ragged``, a request's rows
    # are its tree's and a model drafter's layers take the fed rows only; ``uniform``,
    # every decoding request gets one of a few widths (``uniform_widths``) and a model
    # drafter's layers run at fixed capacity (``step/draft_layers``), one shape a CUDA
    # graph replays; ``auto``: uniform where CUDA graphs replay steps (a padded row
    # costs almost nothing there), ragged elsewhere (the CPU, where every row costs).
    "step_shape": Param(
        str, "auto", "one of 'auto', 'ragged', 'uniform'", lambda v: v in ("auto", "ragged", "uniform")
    ),
    # Structured requests that get no tree draft the tokens their grammar
    # forces (``tree_scheduler.forced_tokens``: jump-forward), verified as a chain.
    "grammar_forcing": Param(bool, True, "true or false", lambda v: True),
}
DRAFTERS_NEEDING_MODEL = frozenset({"eagle3", "draft_model", "hybrid"})
FIXED_LOOP_DRAFTERS = frozenset({"eagle3", "draft_model"})  # grow at fixed capacity in uniform steps
# The two settings ``step_shape`` replaced, still read (with a warning): each value's shape.
REPLACED_SETTINGS = {
    "uniform_steps": {"auto": "auto", "on": "uniform", "off": "ragged"},
    "draft_loop": {"auto": "auto", "ragged": "ragged", "fixed": "uniform"},
}


class TreeConfigError(ValueError):
    """A bad ``adaptive_tree`` speculative config."""


@dataclass(frozen=True)
class TreeConfig:
    drafter: str
    policy: str
    max_nodes: int
    drafter_params: dict[str, Any] = field(default_factory=dict)
    policy_params: dict[str, Any] = field(default_factory=dict)
    load_budget: str = "adaptive"
    step_shape: str = "auto"
    grammar_forcing: bool = True

    def to_dict(self) -> dict[str, Any]:
        """A JSON-able dict (it travels in ``VllmConfig.additional_config``)."""
        return {
            "drafter": self.drafter,
            "policy": self.policy,
            "max_nodes": self.max_nodes,
            "drafter_params": dict(self.drafter_params),
            "policy_params": dict(self.policy_params),
            "load_budget": self.load_budget,
            "step_shape": self.step_shape,
            "grammar_forcing": self.grammar_forcing,
        }

    @staticmethod
    def from_dict(data: dict[str, Any]) -> "TreeConfig":
        return TreeConfig(**data)

    def make_drafter(self, device_type: str = "cpu"):
        """The drafter, for an engine on ``device_type`` (which picks the
        tensor matcher's device, ``retrieval_tensors.make_retrieval``)."""
        if self.drafter == "retrieval":
            return make_retrieval(device_type, **self.drafter_params)
        if self.drafter == "hybrid":
            return DRAFTERS["hybrid"](device_type=device_type, **self.drafter_params)
        return DRAFTERS[self.drafter](**self.drafter_params)

    @property
    def fixed_loop_capable(self) -> bool:
        """Whether the drafter grows at fixed capacity in uniform steps: a
        model drafter, or the hybrid over the tensor matcher."""
        return self.drafter in FIXED_LOOP_DRAFTERS or (
            self.drafter == "hybrid" and matcher_of(self.drafter_params) == "tensors")

    @property
    def model_kind(self) -> str | None:
        """The kind of draft model the drafter runs: 'eagle3', 'draft_model' or None (retrieval)."""
        if self.drafter == "hybrid":
            return self.drafter_params["base"]
        return self.drafter if self.drafter in DRAFTERS_NEEDING_MODEL else None

    def make_policy(self):
        return POLICIES[self.policy](**self.policy_params)

    def draft_slots(self) -> int:
        """Draft tokens vLLM must reserve KV for per request: ``max_nodes``, or
        the scratch of a model drafter's growth when that is larger."""
        return max(self.max_nodes, self.make_policy().max_fed_nodes(self.max_nodes))


def _choices(values) -> str:
    return ", ".join(repr(v) for v in sorted(values))


def parse_tree_config(spec: dict[str, Any]) -> TreeConfig:
    """Validate a user's speculative config with ``method == "adaptive_tree"``."""
    max_nodes = _max_nodes(spec)
    tree = spec.get("tree")
    if not isinstance(tree, dict):
        raise TreeConfigError(
            "speculative_config['tree'] must be a dict with at least 'drafter' "
            f"(one of {_choices(DRAFTERS)}), got {tree!r}"
        )
    drafter, policy = _drafter_and_policy(spec, tree)
    drafter_params, policy_params, engine = _params(_with_step_shape(tree), drafter, policy)
    if policy == "c2t" and not policy_params["classifier"]:
        policy_params["classifier"] = _default_classifier(spec["model"])
    config = TreeConfig(drafter, policy, max_nodes, drafter_params, policy_params, engine["load_budget"],
                        engine["step_shape"], engine["grammar_forcing"])
    _check_buildable(config)
    return config


def _max_nodes(spec: dict[str, Any]) -> int:
    max_nodes = spec.get("num_speculative_tokens")
    if isinstance(max_nodes, bool) or not isinstance(max_nodes, int) or not 1 <= max_nodes <= MAX_NODES:
        raise TreeConfigError(
            f"speculative_config['num_speculative_tokens'] must be an integer from 1 to {MAX_NODES} "
            f"(the most draft nodes per request per step), got {max_nodes!r}"
        )
    return max_nodes


def _drafter_and_policy(spec: dict[str, Any], tree: dict[str, Any]) -> tuple[str, str]:
    """The tree's drafter and policy (its drafter's first by default), and
    whether a draft model is given exactly where the drafter runs one."""
    drafter = tree.get("drafter")
    if not isinstance(drafter, str) or drafter not in DRAFTERS:
        raise TreeConfigError(
            f"speculative_config['tree']['drafter'] must be one of {_choices(DRAFTERS)}, got {drafter!r}"
        )
    allowed_policies = DRAFTER_POLICIES[drafter]
    policy = tree.get("policy", allowed_policies[0])
    if policy not in allowed_policies:
        raise TreeConfigError(
            f"speculative_config['tree']['policy'] must be one of {_choices(allowed_policies)} "
            f"with drafter {drafter!r}, got {policy!r}"
        )
    if drafter in DRAFTERS_NEEDING_MODEL and not spec.get("model"):
        raise TreeConfigError(f"speculative_config['model'] is required with tree drafter {drafter!r}")
    if drafter not in DRAFTERS_NEEDING_MODEL and spec.get("model") is not None:
        raise TreeConfigError(
            f"speculative_config['model'] is not used by tree drafter {drafter!r}; remove it"
        )
    return drafter, policy


def _with_step_shape(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` with the settings ``step_shape`` replaced read as it (a
    warning line each): given with it, or disagreeing, they are refused."""
    replaced = [key for key in REPLACED_SETTINGS if key in tree]
    if not replaced:
        return tree
    if "step_shape" in tree:
        raise TreeConfigError(f"speculative_config['tree'] gives 'step_shape' and {replaced}, which it replaces; "
                              "give 'step_shape' only")
    tree, shapes = dict(tree), set()
    for key in replaced:
        value, shapes_of = tree.pop(key), REPLACED_SETTINGS[key]
        if value not in shapes_of:
            raise TreeConfigError(f"speculative_config['tree'][{key!r}] must be one of {_choices(shapes_of)}, "
                                  f"got {value!r} (it is replaced by 'step_shape')")
        logger.warning("speculative_config['tree'][%r] is replaced by 'step_shape': %r reads as 'step_shape': %r",
                       key, value, shapes_of[value])
        shapes.add(shapes_of[value])
    chosen = shapes - {"auto"}
    if len(chosen) > 1:
        raise TreeConfigError(f"speculative_config['tree'] {replaced} disagree ({sorted(chosen)}); "
                              "give 'step_shape' only")
    return {**tree, "step_shape": chosen.pop() if chosen else "auto"}


def _params(tree: dict[str, Any], drafter: str, policy: str) -> list[dict[str, Any]]:
    """The drafter's, the policy's and the engine's parameters, each checked
    against its schema (defaults filled in, integers taken as floats where
    a float is asked for); unknown keys are refused."""
    schemas = (DRAFTERS[drafter].PARAMS, POLICIES[policy].PARAMS, ENGINE_PARAMS)
    known = {"drafter", "policy", *(name for schema in schemas for name in schema)}
    unknown = sorted(set(tree) - known)
    if unknown:
        raise TreeConfigError(
            f"speculative_config['tree'] has unknown key(s) {unknown}; with drafter {drafter!r} and "
            f"policy {policy!r} the valid keys are {_choices(known)}"
        )
    return [{name: _checked(tree, name, param) for name, param in schema.items()} for schema in schemas]


def _checked(tree: dict[str, Any], name: str, param) -> Any:
    value = tree.get(name, param.default)
    wrong_type = isinstance(value, bool) and param.kind is not bool
    if param.kind is float and isinstance(value, int) and not wrong_type:
        value = float(value)
    if wrong_type or not isinstance(value, param.kind) or not param.check(value):
        raise TreeConfigError(f"speculative_config['tree'][{name!r}] must be {param.rule}, got {value!r}")
    return value


def _default_classifier(model: str) -> str:
    """C2T's classifier shipped beside the draft model, where none is given."""
    default = os.path.join(model, FILE_NAME)
    if not os.path.isfile(default):
        raise TreeConfigError(
            f"speculative_config['tree']['classifier'] must be given: the draft model has no {FILE_NAME} "
            f"({default!r} not found); train one with `vllm-adaptive-spec c2t-train`"
        )
    return default


def _check_buildable(config: TreeConfig) -> None:
    """Settings each valid alone that do not go together: drafter or
    policy parameters their constructors refuse, more draft slots than a
    tree may take."""
    try:
        # On the meta device: the check allocates nothing and builds nothing native (an engine's
        # drafter, made in its worker for its device, may load the native CPU library).
        config.make_drafter("meta")
        config.make_policy()
    except ValueError as exc:
        raise TreeConfigError(f"speculative_config['tree']: {exc}") from exc
    if config.draft_slots() > MAX_DRAFT_SLOTS:
        raise TreeConfigError(
            f"speculative_config['tree']: policy {config.policy!r} with {config.policy_params} runs the drafter "
            f"on {config.draft_slots()} nodes per tree; at most {MAX_DRAFT_SLOTS} (lower 'top_k' or 'depth')"
        )
