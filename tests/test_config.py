"""The ``adaptive_tree`` speculative config: every error names the key and the choices."""

from __future__ import annotations

import json

import pytest

from vllm_adaptive_spec.config import TreeConfig, TreeConfigError, parse_tree_config
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter
from vllm_adaptive_spec.policies import ChainPolicy, RetrievalPolicy

TREE_KEYS = ("'drafter', 'evidence_prior', 'grammar_forcing', 'l_max', 'l_min', 'load_budget', 'matcher', 'max_depth', 'max_matches', "
             "'policy'")


def spec(max_nodes=4, **tree):
    return {"method": "adaptive_tree", "num_speculative_tokens": max_nodes, "tree": {"drafter": "retrieval", **tree}}


def test_defaults_and_round_trip():
    config = parse_tree_config(spec())
    assert config == TreeConfig(
        "retrieval", "retrieval", 4,
        {"l_max": 8, "l_min": 1, "max_matches": 32, "max_depth": 16, "evidence_prior": 4.0,
         "datastore": "off", "datastore_tokens": 100_000, "corpus": "", "matcher": "auto"},
        {"min_p": 0.05},
    )
    custom = parse_tree_config(
        spec(128, policy="chain", l_max=4, l_min=2, max_matches=3, max_depth=5, datastore="shared", datastore_tokens=50)
    )
    assert custom.policy == "chain" and custom.max_nodes == 128
    assert custom.drafter_params == {"l_max": 4, "l_min": 2, "max_matches": 3, "max_depth": 5, "evidence_prior": 4.0,
                                     "datastore": "shared", "datastore_tokens": 50, "corpus": "",
                                     "matcher": "auto"}
    assert TreeConfig.from_dict(json.loads(json.dumps(custom.to_dict()))) == custom
    drafter, policy = custom.make_drafter(), custom.make_policy()
    assert isinstance(drafter, RetrievalDrafter) and isinstance(policy, ChainPolicy)
    assert (drafter.l_max, drafter.l_min, drafter.max_matches, drafter.max_depth) == (4, 2, 3, 5)
    assert drafter.shared is not None and drafter.shared.max_tokens == 50
    assert isinstance(config.make_policy(), RetrievalPolicy)


@pytest.mark.parametrize("max_nodes", [None, 0, 129, -1, True, "4", 4.0])
def test_bad_max_nodes(max_nodes):
    bad = spec(max_nodes)
    if max_nodes is None:
        del bad["num_speculative_tokens"]
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(bad)
    message = str(error.value)
    assert "speculative_config['num_speculative_tokens']" in message
    assert "from 1 to 128" in message and repr(max_nodes) in message


@pytest.mark.parametrize("tree", [None, "retrieval", ["retrieval"]])
def test_tree_missing_or_not_a_dict(tree):
    bad = {"num_speculative_tokens": 4, "tree": tree}
    with pytest.raises(TreeConfigError, match=r"speculative_config\['tree'\] must be a dict .*'retrieval'"):
        parse_tree_config(bad if tree is not None else {"num_speculative_tokens": 4})


@pytest.mark.parametrize(
    "drafter",
    [None, "eagle", ["retrieval"]],
)
def test_unknown_drafter(drafter):
    tree = {} if drafter is None else {"drafter": drafter}
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config({"num_speculative_tokens": 4, "tree": tree})
    assert "speculative_config['tree']['drafter'] must be one of 'draft_model', 'eagle3', 'hybrid', 'retrieval'" in str(error.value)


def test_unknown_policy_for_drafter():
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(spec(policy="eagle2"))
    message = str(error.value)
    assert "speculative_config['tree']['policy']" in message
    assert "'chain', 'retrieval'" in message and "'eagle2'" in message


def test_unknown_tree_key_lists_valid_keys():
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(spec(lmax=4, policy="chain"))
    message = str(error.value)
    assert "speculative_config['tree'] has unknown key(s) ['lmax']" in message
    assert TREE_KEYS in message


@pytest.mark.parametrize(
    "key, value, rule",
    [
        ("l_max", 0, "an integer >= 1"),
        ("load_budget", "auto", "one of 'adaptive', 'fixed'"),
        ("grammar_forcing", "yes", "true or false"),
        ("l_max", "8", "an integer >= 1"),
        ("l_max", 8.0, "an integer >= 1"),
        ("max_matches", True, "an integer >= 1"),
        ("max_depth", -3, "an integer >= 1"),
        ("l_min", 0, "an integer >= 1 and <= l_max"),
    ],
)
def test_bad_parameter(key, value, rule):
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(spec(**{key: value}))
    assert str(error.value) == f"speculative_config['tree'][{key!r}] must be {rule}, got {value!r}"


def test_l_min_above_l_max():
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(spec(l_max=3, l_min=5))
    message = str(error.value)
    assert message.startswith("speculative_config['tree']") and "l_min (5)" in message and "l_max (3)" in message


def test_model_not_used_by_retrieval():
    with pytest.raises(TreeConfigError, match=r"speculative_config\['model'\] is not used by tree drafter 'retrieval'"):
        parse_tree_config({**spec(), "model": "/models/draft"})


@pytest.mark.parametrize("drafter", ["eagle3", "draft_model", "hybrid"])
def test_model_drafters_need_a_model(drafter):
    with pytest.raises(TreeConfigError, match=rf"speculative_config\['model'\] is required with tree drafter '{drafter}'"):
        parse_tree_config({"num_speculative_tokens": 8, "tree": {"drafter": drafter}})


def test_eagle2_defaults_and_scratch():
    config = parse_tree_config({"num_speculative_tokens": 60, "model": "/m", "tree": {"drafter": "eagle3"}})
    assert (config.policy, config.policy_params) == ("eagle2", {"top_k": 10, "depth": 8, "entropy_top_m": 0})
    assert config.draft_slots() == 70  # K * (D - 1) nodes are run through the drafter
    chain = parse_tree_config({"num_speculative_tokens": 6, "model": "/m", "tree": {"drafter": "eagle3", "policy": "chain"}})
    assert chain.draft_slots() == 6


def test_eagle2_bad_values_and_scratch_limit():
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config({"num_speculative_tokens": 8, "model": "/m", "tree": {"drafter": "eagle3", "top_k": 0}})
    assert str(error.value) == "speculative_config['tree']['top_k'] must be an integer from 1 to 64, got 0"
    with pytest.raises(TreeConfigError, match="at most 512 .*lower 'top_k' or 'depth'"):
        parse_tree_config({"num_speculative_tokens": 8, "model": "/m", "tree": {"drafter": "eagle3", "top_k": 64, "depth": 64}})


def test_hybrid_settings_reach_both_sides():
    from vllm_adaptive_spec.drafters.hybrid import HybridDrafter

    config = parse_tree_config({
        "num_speculative_tokens": 20, "model": "head",
        "tree": {"drafter": "hybrid", "policy": "talon", "max_depth": 12, "retrieval_depth": 5, "l_max": 4,
                 "datastore": "shared", "base": "draft_model"},
    })
    assert config.model_kind == "draft_model" and config.policy_params["max_depth"] == 12
    drafter = config.make_drafter()
    assert isinstance(drafter, HybridDrafter) and drafter.base == "draft_model"
    assert (drafter.retrieval.max_depth, drafter.retrieval.l_max, drafter.shared is not None) == (5, 4, True)
    with pytest.raises(TreeConfigError, match=r"\['tree'\]\['base'\] must be one of 'draft_model', 'eagle3', got 'medusa'"):
        parse_tree_config({"num_speculative_tokens": 8, "model": "head", "tree": {"drafter": "hybrid", "base": "medusa"}})


@pytest.mark.parametrize("old, shape", [
    ({"uniform_steps": "on"}, "uniform"), ({"uniform_steps": "off"}, "ragged"), ({"uniform_steps": "auto"}, "auto"),
    ({"draft_loop": "fixed"}, "uniform"), ({"draft_loop": "ragged"}, "ragged"),
    ({"uniform_steps": "on", "draft_loop": "auto"}, "uniform"), ({"uniform_steps": "off", "draft_loop": "ragged"}, "ragged"),
])
def test_the_two_settings_step_shape_replaced_read_as_it_with_a_warning(caplog, old, shape):
    """``uniform_steps`` and ``draft_loop`` both decided whether a step takes
    the shape CUDA graphs replay; ``step_shape`` decides it alone, and a
    config written with the old keys still runs, warned once per key."""
    with caplog.at_level("WARNING", logger="vllm.adaptive_spec"):
        config = parse_tree_config(spec(**old))
    assert config.step_shape == shape
    warned = [r.getMessage() for r in caplog.records if "is replaced by 'step_shape'" in r.getMessage()]
    assert len(warned) == len(old) and all(f"[{key!r}]" in line for key, line in zip(old, warned))
    assert "uniform_steps" not in config.to_dict() and "draft_loop" not in config.to_dict()
