"""C2T (docs/algorithms.md section 4): the policy grows the tree its definition
describes (checked against a brute-force re-implementation on a fake model
drafter), records each node's parent entropy, and its trees are valid and
within ``N``; the classifier file is checked when the config is parsed."""

from __future__ import annotations

import json
import math

import pytest
import torch

from test_model_drafter import TableBackend, grow_with, paths
from test_policies import table_model
from vllm_adaptive_spec.classifier import FILE_NAME, C2TClassifier
from vllm_adaptive_spec.config import TreeConfigError, parse_tree_config
from vllm_adaptive_spec.policies import C2TPolicy


def random_classifier(seed: int, top_m: int = 1000, bias: float = 0.0) -> C2TClassifier:
    gen = torch.Generator().manual_seed(seed)
    w1, b1, w2 = torch.randn(48, 3, generator=gen), torch.randn(48, generator=gen), torch.randn(48, generator=gen)
    return C2TClassifier(w1, b1, w2, torch.tensor(bias), top_m)


def policy_with(tmp_path, classifier: C2TClassifier, **settings) -> C2TPolicy:
    path = tmp_path / "c2t.json"
    classifier.save(path)
    return C2TPolicy(classifier=str(path), **settings)


def confidence(c: C2TClassifier, p: float, h: float, d: int) -> float:
    hidden = torch.relu(c.w1 @ torch.tensor([p, h, float(d)]) + c.b1)
    return float(torch.sigmoid(hidden @ c.w2 + c.b2))


def entropy_top_m(dist: torch.Tensor, m: int) -> float:
    top = dist.sort(descending=True).values[:m]
    return float(-(top * top.log()).sum())


def c2t_reference(root, table, n, top_k, max_depth, beta, c: C2TClassifier):
    """Nodes as (path, p, rank): rank = smallest confidence on the path."""
    tree, frontier, depth = [], [((), 1.0, 1.0)], 0
    while frontier and depth < max_depth:
        depth += 1
        candidates = []
        for path, p, rank in frontier:
            dist = root if not path else table[path[-1]]
            h = entropy_top_m(dist, c.top_m)
            q, tokens = dist.topk(top_k)
            for token, qi in zip(tokens.tolist(), q.tolist()):
                conf = confidence(c, p * qi, h, depth)
                if conf >= beta:
                    candidates.append((path + (token,), p * qi, min(rank, conf), conf))
        best = sorted(range(len(candidates)), key=lambda i: (-candidates[i][3], i))[:top_k]
        frontier = [candidates[i][:3] for i in sorted(best)]  # in (frontier node, candidate) order
        tree += frontier
    if len(tree) > n:
        tree = sorted(tree, key=lambda x: -x[2])[:n]
    return {path for path, _, _ in tree}


@pytest.mark.parametrize("seed", range(4))
def test_c2t_matches_its_definition(tmp_path, seed):
    classifier = random_classifier(seed, top_m=5, bias=1.0)
    roots, table = table_model(seed, batch=3, sharpness=1.0 + seed)
    for max_nodes in (4, 30):
        policy = policy_with(tmp_path, classifier, top_k=3, max_depth=4, beta=0.5)
        backend = TableBackend(roots, table)
        trees = grow_with(backend, policy, max_nodes, batch=3)
        for b, tree in enumerate(trees):
            tree.validate()
            want = c2t_reference(roots[b], table, max_nodes, 3, 4, 0.5, classifier)
            assert set(paths(tree)) == want
            assert len(tree) <= max_nodes
        assert sum(len(t) for t in trees) > 0


def test_nodes_carry_their_parents_entropy(tmp_path):
    classifier = random_classifier(0, top_m=4, bias=3.0)
    roots, table = table_model(1, batch=2)
    trees = grow_with(TableBackend(roots, table), policy_with(tmp_path, classifier, top_k=2, max_depth=3), 20, batch=2)
    for b, tree in enumerate(trees):
        assert len(tree.parent_entropy) == len(tree) > 0
        for token, parent, h in zip(tree.tokens, tree.parents, tree.parent_entropy):
            dist = roots[b] if parent < 0 else table[tree.tokens[parent]]
            assert h == pytest.approx(entropy_top_m(dist, 4), abs=1e-5)


def test_a_confident_classifier_grows_to_max_depth_and_a_doubtful_one_stops(tmp_path):
    roots, table = table_model(2, batch=2)
    sure = C2TClassifier(torch.zeros(48, 3), torch.zeros(48), torch.zeros(48), torch.tensor(5.0), 8)
    doubt = C2TClassifier(torch.zeros(48, 3), torch.zeros(48), torch.zeros(48), torch.tensor(-5.0), 8)
    deep = grow_with(TableBackend(roots, table), policy_with(tmp_path, sure, top_k=2, max_depth=5), 100, batch=2)
    assert all(max(t.depths()) == 5 and len(t) == 10 for t in deep)
    none = grow_with(TableBackend(roots, table), policy_with(tmp_path, doubt, top_k=2, max_depth=5), 100, batch=2)
    assert all(len(t) == 0 for t in none)


def test_classifier_file_round_trip_and_241_parameters(tmp_path):
    classifier = random_classifier(3)
    classifier.trained = {"command": "x"}
    classifier.save(tmp_path / "c.json")
    loaded = C2TClassifier.load(tmp_path / "c.json")
    assert loaded.num_parameters == 241 and loaded.trained == {"command": "x"}
    assert torch.equal(loaded.w1, classifier.w1) and float(loaded.b2) == float(classifier.b2)


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "cannot read the C2T classifier file"),
        ("not json", "is not a C2T classifier file (not JSON)"),
        ('{"format": "other"}', "its 'format' is not"),
        ("shapes", "expected a 3-48-1 network"),
    ],
)
def test_a_wrong_classifier_file_fails_at_startup_naming_the_key(tmp_path, content, message):
    path = tmp_path / "c2t.json"
    if content == "shapes":
        random_classifier(0).save(path)
        data = json.loads(path.read_text())
        data["w1"] = data["w1"][:10]
        path.write_text(json.dumps(data))
    elif content is not None:
        path.write_text(content)
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 16, "model": str(tmp_path),
            "tree": {"drafter": "eagle3", "policy": "c2t", "classifier": str(path)}}
    with pytest.raises(TreeConfigError) as error:
        parse_tree_config(spec)
    assert "'classifier'" in str(error.value) and message in str(error.value)


def test_the_default_classifier_is_the_draft_models_own(tmp_path):
    spec = {"method": "adaptive_tree", "num_speculative_tokens": 16, "model": str(tmp_path),
            "tree": {"drafter": "eagle3", "policy": "c2t"}}
    with pytest.raises(TreeConfigError, match=f"'classifier'] must be given: the draft model has no {FILE_NAME}"):
        parse_tree_config(spec)
    random_classifier(0, top_m=64).save(tmp_path / FILE_NAME)
    config = parse_tree_config(spec)
    assert config.policy_params["classifier"] == str(tmp_path / FILE_NAME)
    assert config.make_policy().entropy_top_m == 64
    assert math.isclose(config.make_policy().beta, 0.5)


def test_rows_of_a_verified_tree():
    from vllm_adaptive_spec.training.train_c2t import tree_rows
    from vllm_adaptive_spec.trees.tree import DraftTree

    tree = DraftTree([5, 6, 7], [-1, -1, 0], [0.5, 0.25, 0.5], [1.0, 1.0, 2.0])
    assert tree_rows(tree, [0, 2]).tolist() == [[0.5, 1.0, 1, 1.0], [0.25, 1.0, 1, 0.0], [0.25, 2.0, 2, 1.0]]


def test_training_finds_the_accepted_nodes_and_writes_a_loadable_classifier(tmp_path):
    """Synthetic rows whose acceptance follows P: the trained classifier
    recalls most accepted nodes while calling only part of the nodes positive."""
    from types import SimpleNamespace

    from vllm_adaptive_spec.training.train_c2t import train

    gen = torch.Generator().manual_seed(0)
    p = torch.rand(8_000, generator=gen) ** 2
    rows = torch.stack([p, 5 * torch.rand(8_000, generator=gen), torch.randint(1, 11, (8_000,), generator=gen).float(),
                        (torch.rand(8_000, generator=gen) < p ** 2).float()], 1)
    torch.save(rows, tmp_path / "rows-0.pt")
    (tmp_path / "collect.json").write_text(json.dumps({"speculative_config": {"tree": {"entropy_top_m": 100}}}))
    out = tmp_path / FILE_NAME
    args = SimpleNamespace(rows=str(tmp_path), out=str(out), negatives=1, epochs=20, batch=256, lr=1e-3, beta=0.5,
                           seed=0)
    train(args)
    loaded = C2TClassifier.load(out)
    assert loaded.top_m == 100 and loaded.trained["held_out_recall"] >= 0.8
    assert loaded.trained["held_out_positive_rate"] <= 0.6
    assert len((tmp_path / "c2t_train_log.jsonl").read_text().splitlines()) == 20
