"""Do the retrieval drafter's node probabilities predict acceptance?

Greedy decoding is deterministic, so a retrieval tree's fate can be replayed
without the engine: the target's greedy answers to the prompt set are
generated once with vLLM (no speculation; cached in ``--out``), then decoding
is replayed as the engine runs it: after each step's committed tokens the
drafter drafts a tree from the context, the tree's accepted path is its
longest path equal to the answer's next tokens, and the replay moves on by
the accepted nodes plus the bonus token. Every drafted node is recorded with
its path probability ``p``.

Reports, per drafter setting: tau (tokens per step), nodes drafted per step,
and accepted fraction against predicted ``p`` in buckets; a calibrated
drafter has the accepted fraction of each bucket inside it.

The oracle settings bound what any choice among the retrieved continuations
can reach: ``oracle`` drafts, from the whole trie, exactly the path the
answer takes (its nodes are the accepted ones), ``oracle-last-token`` the
same from the continuations of every earlier occurrence of the context's
last token (the widest evidence a suffix match can give). ``load-budget``
replays the engine's default configuration (the load budget cuts each tree,
its step-cost fit fed the replayed steps' costed times); ``ngram`` and
``suffix`` replay vLLM's own drafters (its n-gram matching function, and
Arctic Inference's Suffix Decoding, built by ``benchmarks/throughput.py``'s
script when missing), so all are compared on the same answers and costs.

The speedup each setting can reach at batch 1 follows from the cost of a
step: ``--step-ms`` without speculation, ``--row-ms`` per verified node (the
target's rows and their logits: ``benchmarks/row_cost.py``) and
``--tree-ms`` for the plugin's own work in a step that verifies a tree
(``benchmarks/step_profile.py``, ``tree-adaptive-16`` against ``tree-0``) and
``--branch-ms`` for a branching tree beyond a chain of its nodes (the CPU
tree path; the load budget's fit at batch 1);
``est. b1`` is the answers' tokens over their steps' time so costed, against
one token per ``--step-ms``.

Reproduce (about 3 minutes on 2 CPU cores, the first run generates the answers)::

    .venv/bin/vllm-adaptive-spec bench retrieval-calibration --max-tokens 64
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import engine_worker, engines
from benchmarks.chain_drafters import JumpForwardChains, NgramChains, SuffixChains
from benchmarks.options import add_output, add_sampling, add_workload
from benchmarks.report import write_report

from vllm_adaptive_spec.budget.load_budget import LoadBudget
from vllm_adaptive_spec.drafters.contexts import Contexts
from vllm_adaptive_spec.drafters.retrieval_trie import RetrievalDrafter
from vllm_adaptive_spec.policies import ChainPolicy, RetrievalPolicy
from vllm_adaptive_spec.step.growth import grow
from vllm_adaptive_spec.trees.tree import ROOT, DraftTree

# The trie's drafting time a step at batch 1 (step profile, `grow`), the load budget's drafting cost.
TRIE_MS = 0.6
BUCKETS = (0.0, 0.05, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 1.0001)


def greedy_answers(prompts_path: Path | None, max_tokens: int, path: Path, sampling: dict | None = None) -> list[dict]:
    """``[{"prompt": ids, "answer": ids, "category": ...}]``, generated once
    (the demo model's answers to the prompt set, greedy with ``sampling``'s
    parameters added: a penalty, or structured output, whose answers the
    drafters then replay) and kept at ``path``."""
    if path.is_file():
        return json.loads(path.read_text(encoding="utf-8"))
    from vllm import SamplingParams

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts

    prompts = load_prompts(prompts_path)
    llm = engine_worker.open_engine({"model": str(ensure_demo_model()), "dtype": "float32", "max_model_len": 1024,
                               "max_num_seqs": 16})
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, **engine_worker.sampling_options(sampling or {}))
    outputs = llm.chat([p.messages for p in prompts], params, use_tqdm=False)
    answers = [{"id": p.id, "category": p.category, "prompt": list(o.prompt_token_ids),
                "answer": list(o.outputs[0].token_ids)} for p, o in zip(prompts, outputs)]
    path.write_text(json.dumps(answers), encoding="utf-8")
    return answers


@dataclass
class StepCost:
    """Milliseconds: a step without speculation, each verified node, the
    plugin's own work in a step that verifies a tree, and what a branching
    tree costs beyond a chain of its nodes (the CPU tree path)."""

    step: float
    row: float
    tree: float
    branch: float = 0.0

    def of(self, nodes: int, branching: bool = False) -> float:
        return self.step + (self.tree + self.row * nodes if nodes else 0.0) + (self.branch if branching else 0.0)


@dataclass
class Tally:
    """A replay's running sums: every drafted node's predicted ``p`` and
    whether it was accepted, the steps, the committed tokens and the costed time."""

    cost: StepCost
    answers: int = 0
    steps: int = 0
    tokens: int = 0
    nodes: int = 0
    elapsed: float = 0.0
    predicted: list[float] = field(default_factory=list)
    accepted_flags: list[bool] = field(default_factory=list)

    def start_answer(self) -> None:
        """An answer's first token, from its prefill step (before any draft)."""
        self.answers += 1
        self.elapsed += self.cost.step

    def step(self, predicted: list[float], accepted_flags: list[bool], commit: int, branching: bool = False) -> float:
        """One drafting step; returns its costed milliseconds."""
        self.predicted += predicted
        self.accepted_flags += accepted_flags
        self.steps += 1
        self.nodes += len(accepted_flags)
        ms = self.cost.of(len(accepted_flags), branching)
        self.elapsed += ms
        self.tokens += commit
        return ms

    def summary(self) -> dict:
        predicted, accepted_flags, steps = self.predicted, self.accepted_flags, self.steps
        table = []
        for low, high in zip(BUCKETS, BUCKETS[1:]):
            inside = [a for q, a in zip(predicted, accepted_flags) if low <= q < high]
            table.append({"low": low, "high": min(high, 1.0), "nodes": len(inside),
                          "accepted": sum(inside) / len(inside) if inside else None})
        return {"tau": self.tokens / steps, "nodes_per_step": self.nodes / steps, "steps": steps,
                "est_speedup_b1": (self.tokens + self.answers) * self.cost.step / self.elapsed,
                "accepted_nodes_share": sum(accepted_flags) / max(len(accepted_flags), 1),
                "expected_accepted_per_step": sum(predicted) / steps,
                "accepted_per_step": sum(accepted_flags) / steps, "buckets": table}


def accepted_nodes(tree: DraftTree, answer: list[int], t: int) -> tuple[list[bool], int]:
    """Greedy verification replayed: whether each node of ``tree``, drafted
    after the answer's first ``t`` tokens, lies on the answer's path, and the
    accepted depth."""
    ok: list[bool] = []
    depths = tree.depths()
    for token, parent, depth in zip(tree.tokens, tree.parents, depths):
        on_path = parent == ROOT or ok[parent]
        ok.append(on_path and t + depth - 1 < len(answer) and answer[t + depth - 1] == token)
    return ok, max((d for d, good in zip(depths, ok) if good), default=0)


def replay(answers: list[dict], drafter_params: dict, policy_params: dict, nodes: int, cost: StepCost) -> dict:
    """Replay greedy decoding of every answer with retrieval trees. With
    ``policy_params["load_budget"]`` the trees are cut by the engine's default
    :class:`LoadBudget`, its step-cost fit fed each replayed step's costed
    time as the engine feeds it measured ones (and the trie's drafting time,
    ``TRIE_MS``, as its drafting cost)."""
    params = dict(policy_params)
    oracle = params.pop("oracle", False)
    chain = params.pop("chain", False)
    load_budget = LoadBudget(nodes) if params.pop("load_budget", False) else None
    drafter = RetrievalDrafter(**drafter_params)
    policy = ChainPolicy() if chain or oracle else RetrievalPolicy(**params)
    tally = Tally(cost)
    for k, record in enumerate(answers):
        prompt, answer = record["prompt"], record["answer"]
        tally.start_answer()
        t = 1
        while t < len(answer):
            context = prompt + answer[:t]
            drafter.prepare([f"r{k}"], Contexts.of([context]))
            if oracle:
                tree = drafter.candidate_trees()[0]
            elif load_budget is not None and not load_budget.begin_step().drafts:
                tree = DraftTree()
            else:
                trees, _ = grow(drafter, policy, torch.tensor([nodes]), drafter.max_depth)
                tree = trees[0]
                if load_budget is not None:
                    load_budget.observe_drafting(1, TRIE_MS / 1e3)
                    tree = load_budget.choose([tree], [f"r{k}"]).trees[0]
            p = tree.path_probabilities()
            ok, accepted = accepted_nodes(tree, answer, t)
            if oracle:  # only the answer's path is drafted
                p = [q for q, good in zip(p, ok) if good]
                ok = [True] * len(p)
            commit = min(accepted + 1, len(answer) - t)
            branching = not oracle and tree.branches()
            ms = tally.step(p, ok, commit, branching)
            if load_budget is not None:
                load_budget.observe_tree(tree, [i for i, good in enumerate(ok) if good], f"r{k}")
                load_budget.fit.observe(1 + len(tree), ms / 1e3, 0, int(len(tree) > 0), int(branching))
            t += commit
        drafter.forget(f"r{k}", finished=True)  # joins a shared datastore, where one is on
        if load_budget is not None:
            load_budget.forget(f"r{k}")
    return tally.summary()


def replay_chains(answers: list[dict], cost: StepCost, drafter) -> dict:
    """The same replay with one of vLLM's chain drafters (:class:`SuffixChains`, :class:`NgramChains`)."""
    tally = Tally(cost)
    for k, record in enumerate(answers):
        prompt, answer = record["prompt"], record["answer"]
        drafter.start(k, prompt, answer[:1])
        tally.start_answer()
        t = 1
        while t < len(answer):
            tokens, probs = drafter.draft(k, prompt + answer[:t])
            ok, accepted = accepted_nodes(DraftTree.chain(tokens), answer, t)
            commit = min(accepted + 1, len(answer) - t)
            tally.step(probs, ok, commit)
            drafter.commit(k, answer[t:t + commit])
            t += commit
        drafter.stop(k)
    return tally.summary()


def markdown(name: str, result: dict) -> str:
    lines = [f"### {name}", "",
             f"tau {result['tau']:.2f}, nodes per step {result['nodes_per_step']:.1f}, accepted per step "
             f"{result['accepted_per_step']:.2f} (predicted {result['expected_accepted_per_step']:.2f}), "
             f"{100 * result['accepted_nodes_share']:.1f}% of nodes accepted, est. b1 "
             f"{result['est_speedup_b1']:.2f}x", "",
             "| predicted p | nodes | accepted fraction |", "|---|---:|---:|"]
    for row in result["buckets"]:
        if row["nodes"]:
            lines.append(f"| {row['low']:.2f}-{row['high']:.2f} | {row['nodes']} | {row['accepted']:.3f} |")
    return "\n".join(lines)


SETTINGS = {
    "share": ({"evidence_prior": 0.0}, {}),
    "evidence-prior2": ({"evidence_prior": 2.0}, {}),
    "evidence": ({}, {}),
    "evidence-p0.1": ({}, {"min_p": 0.1}),
    "evidence-p0.2": ({}, {"min_p": 0.2}),
    "evidence-p0.3": ({}, {"min_p": 0.3}),
    "evidence-p0.5": ({}, {"min_p": 0.5}),
    "evidence-chain": ({}, {"chain": True}),
    "oracle": ({}, {"oracle": True}),
    "oracle-last-token": ({"l_max": 1, "max_matches": 1 << 20}, {"oracle": True}),
    "evidence-shared": ({"datastore": "shared"}, {}),
    "evidence-shared-p0.2": ({"datastore": "shared"}, {"min_p": 0.2}),
    "evidence-shared-p0.3": ({"datastore": "shared"}, {"min_p": 0.3}),
    "oracle-shared": ({"datastore": "shared"}, {"oracle": True}),
    "load-budget": ({}, {"load_budget": True}),
    "load-budget-prior2": ({"evidence_prior": 2.0}, {"load_budget": True}),
    "load-budget-shared": ({"datastore": "shared"}, {"load_budget": True}),
}
# vLLM's own chain drafters: name -> (drafter class, its options).
CHAIN_SETTINGS = {
    "ngram": (NgramChains, {}),
    "suffix": (SuffixChains, {}),
    "suffix-own-text": (SuffixChains, {"cached_requests": 0}),
    "jump-forward": (JumpForwardChains, {}),
    "jump-forward-whole": (JumpForwardChains, {"whole": True}),
}


def _import_suffix_decoding() -> str | None:
    """Make ``arctic_inference.suffix_decoding`` importable (built by
    ``scripts/build_suffix_decoding.sh`` if needed); returns why not, or None."""
    try:
        import arctic_inference.suffix_decoding  # noqa: F401
        return None
    except ImportError:
        pass
    directory, why = engines.suffix_decoding_dir()
    if directory is None:
        return why
    spec = importlib.machinery.PathFinder.find_spec("arctic_inference", [directory])
    if spec is None:
        return f"no arctic_inference package in {directory}"
    package = importlib.util.module_from_spec(spec)
    sys.modules["arctic_inference"] = package  # its submodules resolve through the package's own path
    spec.loader.exec_module(package)
    return None


def costs_from_row_cost(report: dict) -> tuple[float, float]:
    """(step ms, ms per verified node) from ``row_cost.py``'s report: its
    one-row step, and the slopes of the step and of the rows' logits."""
    step = report["best_ms"]["step"]
    one_row = step["1"] if "1" in step else step[1]
    return float(one_row), float(report["ms_per_row"]["step"] + report["ms_per_row"]["logits"])


def replay_chain_setting(name: str, answers: list[dict], cost: StepCost, sampling: dict,
                         suffix_missing: str | None) -> tuple[dict, str] | None:
    """One of :data:`CHAIN_SETTINGS` replayed, and its title; None (said why) where it cannot run."""
    drafter_class, options = CHAIN_SETTINGS[name]
    if name.startswith("suffix") and suffix_missing:
        print(f"{name}: skipped, {suffix_missing}", flush=True)
        return None
    if drafter_class is JumpForwardChains:
        schema = (sampling.get("structured_outputs") or {}).get("json")
        if not isinstance(schema, dict):
            print(f"{name}: skipped, it replays a JSON schema's answers (--sampling)", flush=True)
            return None
        part = "whole" if options.get("whole") else "less its last token"
        return (replay_chains(answers, cost, drafter_class(schema, **options)),
                f"{name}: grammar_forcing's drafts, the jump-forward string {part}")
    return (replay_chains(answers, cost, drafter_class(**options)),
            f"{name}: vLLM's own {name.split('-')[0]} drafter, {options or 'its defaults'}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nodes", "--budget", type=int, default=16)
    add_workload(parser, max_tokens=128, prompts=None)
    add_sampling(parser)
    parser.add_argument("--settings", default=",".join([*SETTINGS, *CHAIN_SETTINGS]),
                        help=f"of {', '.join([*SETTINGS, *CHAIN_SETTINGS])}")
    parser.add_argument("--step-ms", type=float, default=46.6,
                        help="a step without speculation at batch 1 (step_profile: none)")
    parser.add_argument("--row-ms", type=float, default=2.35,
                        help="a verified node: a row's forward and its logits (row_cost.py)")
    parser.add_argument("--tree-ms", type=float, default=1.6,
                        help="the plugin's own work in a step with a tree (step_profile)")
    parser.add_argument("--branch-ms", type=float, default=7.8,
                        help="a branching tree beyond a chain of its nodes (the load budget's fit, batch 1)")
    parser.add_argument("--row-cost", type=Path,
                        help="row_cost.py's JSON (e.g. an 8B-shaped model on a GPU): its one-row step and its "
                             "ms per added row (forward and logits) replace --step-ms and --row-ms")
    add_output(parser)
    args = parser.parse_args(argv)
    if args.row_cost is not None:
        args.step_ms, args.row_ms = costs_from_row_cost(json.loads(args.row_cost.read_text(encoding="utf-8")))
    cost = StepCost(args.step_ms, args.row_ms, args.tree_ms, args.branch_ms)

    args.out.mkdir(parents=True, exist_ok=True)
    prompt_set = args.prompts.stem if args.prompts else "prompts"
    tag = f"_{hashlib.sha1(json.dumps(args.sampling, sort_keys=True).encode()).hexdigest()[:8]}" if args.sampling else ""
    answers = greedy_answers(args.prompts, args.max_tokens,
                             args.out / f"greedy_answers_{prompt_set}_{args.max_tokens}{tag}.json", args.sampling)
    report = {"cost_ms": vars(cost), "max_tokens": args.max_tokens, "sampling": args.sampling}
    text = [f"Greedy answers of {args.max_tokens} tokens to the {len(answers)} prompts; est. b1 with a step of "
            f"{cost.step} ms, {cost.row} ms a verified node, {cost.tree} ms of the plugin's work a tree, "
            f"{cost.branch} ms more for a branching tree."]
    names = args.settings.split(",")
    suffix_missing = _import_suffix_decoding() if any(n.startswith("suffix") for n in names) else None
    for name in names:
        if name in CHAIN_SETTINGS:
            result = replay_chain_setting(name, answers, cost, args.sampling, suffix_missing)
            if result is None:
                continue
            report[name], title = result
        else:
            drafter_params, policy_params = SETTINGS[name]
            report[name] = replay(answers, drafter_params, policy_params, args.nodes, cost)
            title = f"{name}: drafter {drafter_params}, policy {policy_params}, N={args.nodes}"
        text.append(markdown(title, report[name]))
        print(text[-1] + "\n", flush=True)
    write_report(args.out, "retrieval_calibration", report, "\n\n".join(text))


if __name__ == "__main__":
    main()
