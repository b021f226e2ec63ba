"""The tree hooks of vLLM's V1 model runner, as a mixin over the platform's runner.

Per engine step:

1. ``_prepare_inputs``: after vLLM lays out the batch (sequential positions,
   hence sequential KV slots ``p0 + i``), each request's scheduled drafts are
   matched to its tree (a breadth-first prefix, as the scheduler may cut the
   list) and node positions become ``p0 + depth``. The runner holds the
   step's layout (:class:`~vllm_adaptive_spec.step.tree_step.TreeStep`) until
   its verification and publishes it while vLLM picks the step's graph, runs
   its forward and samples it (:meth:`TreeRunnerMixin._step_published`).
2. the forward: tree rows attend to the prefix, their ancestors and themselves.
3. ``rejection_sampler`` is the :class:`TreeVerifier`; right after acceptance
   the accepted nodes' KV moves to slots ``p0 + 1 .. p0 + a`` in every layer,
   so vLLM's "first ``a`` drafts were accepted" bookkeeping holds.
4. ``propose_draft_token_ids``: a model drafter first runs on the committed
   tokens (``draft_backend``), then the proposer grows the next
   trees, cut by the load budget (``load_budget: adaptive``) to the nodes
   worth verifying at the measured costs. A probe of a paused model drafter
   drafts only for the requests whose draft state is least behind.

With ``retrieval`` vLLM's drafter object is the plugin's proposer; with
``eagle3`` / ``draft_model`` it is vLLM's own (which loads the weights and
owns the draft layers), and the runner keeps a proposer beside it.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import contextmanager

import numpy as np
import torch
from vllm.utils.torch_utils import PIN_MEMORY

from kernels.kv_compaction import compact_kv
from vllm_adaptive_spec.adapter.cudagraphs import TreeCudagraphDispatcher
from vllm_adaptive_spec.adapter.draft_first_pass import StepFirstPass
from vllm_adaptive_spec.adapter.draft_head import HeadDraftBackend
from vllm_adaptive_spec.adapter.draft_lm import LMDraftBackend
from vllm_adaptive_spec.adapter.drafted_share import DraftedShare
from vllm_adaptive_spec.adapter.proposer import TreeProposer
from vllm_adaptive_spec.adapter.request_options import can_draft
from vllm_adaptive_spec.adapter.sampling_controls import builtin_logits_processors
from vllm_adaptive_spec.adapter.tree_impl import check_tree_backends
from vllm_adaptive_spec.adapter.tree_scheduler import TreeDraftTokenIds
from vllm_adaptive_spec.adapter.verifier import TreeVerifier
from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.step.pending import PendingAcceptance
from vllm_adaptive_spec.trees.tree import DraftTree
from vllm_adaptive_spec.trees.uniform_widths import drafted_nodes, uniform_rows
from vllm_adaptive_spec.trees.verify import Acceptance, path_moves

SUPPORTED_LOGPROBS_MODES = ("raw_logprobs", "raw_logits")


def placeholder_drafts(drafts: list[int]) -> bool:
    """Whether a request's scheduled drafts are vLLM's padding, not ours.
    vLLM 0.32's scheduler gives a request it admits or resumes with one
    token left to compute (the rest in the prefix cache, as after a
    preemption) ``num_speculative_tokens`` drafts of -1, so that the step's
    rows stay uniform for CUDA graphs; they are never accepted. Verifying
    them as a tree would take the request's token from its first row
    without vLLM's penalties, bad words or logits processors."""
    return drafts[0] < 0


def rank0_reading(seconds: float) -> float:
    """Tensor-parallel rank 0's clock reading, on every rank. Decision: the
    load budget's pauses, probes and tree sizes follow measured times; ranks
    that measured differently would verify different trees (wrong tokens)
    and run different draft passes (whose collectives would then hang), so
    every rank acts on one reading."""
    from vllm.distributed import get_tp_group

    return get_tp_group().broadcast_object(seconds, src=0)


class TreeRunnerMixin:
    """Mixed in before ``GPUModelRunner`` or ``CPUModelRunner``; ``kv_views``
    maps one layer's KV cache to ``[num_blocks, block_size, H, D]`` K and V
    views; ``tree_backends``: the platform's attention backends with a tree path."""

    kv_views = None
    tree_backends: tuple[str, ...] = ()

    def __init__(self, vllm_config, device) -> None:
        super().__init__(vllm_config, device)
        # Before any request: min_p and logit_bias apply as without speculation (``sampling_controls``).
        self.input_batch.logitsprocs = builtin_logits_processors(vllm_config, device, PIN_MEMORY)
        self.cudagraph_dispatcher = TreeCudagraphDispatcher(vllm_config)
        mode = vllm_config.model_config.logprobs_mode
        if mode not in SUPPORTED_LOGPROBS_MODES:
            raise ValueError(
                f"adaptive_tree supports logprobs_mode {SUPPORTED_LOGPROBS_MODES}, got {mode!r}"
            )
        if self.uses_mrope:
            raise ValueError("adaptive_tree does not support M-RoPE models yet")
        self.rejection_sampler = TreeVerifier(self.sampler, mode, self._after_acceptance,
                                              lambda indices: [self.input_batch.req_ids[i] for i in indices], device)
        self._step_started = time.perf_counter()
        self._discarded_generators: dict[int, torch.Tensor] = {}
        self._branching_trees = 0  # this step's requests whose tree branches
        self._tree_step: tree_step.TreeStep | None = None  # the step in flight, from layout to verification
        self._accepted_rows: dict[int, list[int]] = {}
        self._pending_acceptance: PendingAcceptance | None = None
        self._kv_views: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # ``initialize_kv_cache``
        self._drafted_share = DraftedShare()
        self._draft_backend = None
        if isinstance(self.drafter, TreeProposer):
            self._tree_proposer = self.drafter
        else:
            self._tree_proposer = TreeProposer(vllm_config)
            config = self._tree_proposer.config
            variant = HeadDraftBackend if self.drafter.method == "eagle3" else LMDraftBackend
            self._draft_backend = variant(self, self.drafter, config.draft_slots(),
                                          self._tree_proposer.mode.draft_layers(device))
            policy = self._tree_proposer.policy
            self._tree_proposer.drafter.bind(self._draft_backend, policy.fanout, policy.entropy_top_m)
        if vllm_config.parallel_config.tensor_parallel_size > 1:
            self._tree_proposer.agree = rank0_reading
        # The step mode's layout builder (``ragged_or_uniform``): the persistent tree buffers of uniform steps.
        self._layout = self._tree_proposer.mode.layout(vllm_config.scheduler_config.max_num_seqs, device)

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        """vLLM's, then every layer's K and V views (``kv_views``), which the
        compaction after each verification reads: made once per allocation,
        not every step (two operations a layer, 60 a step on the demo model)."""
        super().initialize_kv_cache(*args, **kwargs)
        views = [type(self).kv_views(kv_cache) for kv_cache in self.kv_caches]
        self._kv_views = ([key for key, _ in views], [value for _, value in views])

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        check_tree_backends(self.vllm_config, self.tree_backends)

    @property
    def tree_proposer(self) -> TreeProposer:
        return self._tree_proposer

    def _update_states(self, scheduler_output):
        self._settle_acceptance()  # a step whose drafting vLLM skipped
        for req_id in scheduler_output.finished_req_ids:
            if (state := self.requests.get(req_id)) is not None:
                self._drafted_share.finished(req_id, state.sampling_params, len(state.output_token_ids))
        result = super()._update_states(scheduler_output)
        gone = set(scheduler_output.finished_req_ids) | set(scheduler_output.preempted_req_ids or ())
        self.tree_proposer.forget(gone, set(scheduler_output.finished_req_ids))
        if self._draft_backend is not None:
            self._draft_backend.forget(gone)
        return result

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):
        self._step_started = time.perf_counter()
        self._accepted_rows = {}
        if scheduler_output.scheduled_spec_decode_tokens:
            result = super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        else:
            result = self._prepare_without_drafts(scheduler_output, num_scheduled_tokens)
        self._discarded_generators = self._discarded_cpu_generators()
        step = self._layout_trees(scheduler_output, num_scheduled_tokens)
        self._branching_trees = 0 if step is None or step.attention is None else len(step.attention.batch_indices)
        self._tree_step = step
        return result

    @contextmanager
    def _step_published(self):
        """The step in flight published for one of vLLM's phases (nothing is
        published when none is: a dummy run's phases, or a step without trees)."""
        if self._tree_step is None:
            yield
            return
        with tree_step.published(self._tree_step):
            yield

    def _determine_batch_execution_and_padding(self, *args, **kwargs):
        with self._step_published():  # a branching step may not replay a FULL graph (``cudagraphs``)
            return super()._determine_batch_execution_and_padding(*args, **kwargs)

    def _model_forward(self, *args, **kwargs):
        with self._step_published():
            return super()._model_forward(*args, **kwargs)

    def _sample(self, *args, **kwargs):
        """vLLM's sampling, whose verifier is the :class:`TreeVerifier`; the
        step's last phase, after which the runner lets it go."""
        try:
            with self._step_published():
                return super()._sample(*args, **kwargs)
        finally:
            self._tree_step = None

    def _prepare_without_drafts(self, scheduler_output, num_scheduled_tokens):
        """A step in which no request has drafts (every step of a paused
        drafter, and steps of prompts only) is laid out as vLLM lays out a
        step without speculation: vLLM 0.32 builds spec-decode metadata for
        zero drafts too (0.2 ms a step at batch 8 on the CPU) and then
        verifies the step; without it vLLM's sampler samples the step
        directly, as with no speculation. ``_prepare_inputs`` reads
        ``speculative_config`` for that choice only (the adapter pins the
        vLLM version)."""
        config, self.speculative_config = self.speculative_config, None
        try:
            return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)
        finally:
            self.speculative_config = config

    def _discarded_cpu_generators(self) -> dict[int, torch.Tensor]:
        """The state, before sampling, of each seeded CPU generator whose
        request's sample this step is discarded (a partial prefill)."""
        generators = self.input_batch.generators
        if not generators:
            return {}
        discarded = np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0].tolist()
        return {i: generators[i].get_state() for i in discarded
                if i in generators and generators[i].device.type == "cpu"}

    def _bookkeeping_sync(self, *args, **kwargs):
        """vLLM undoes a discarded sample's draws with ``Generator.set_offset``,
        which CPU generators lack (vLLM 0.32 on the CPU raises "CPU Generator
        does not use offset" for a seeded request whose prompt is chunked).
        Decision: restore those generators' states from before sampling and
        keep them out of vLLM's rewind; the effect is the one vLLM intends
        (the discarded sample draws nothing), and speculation, whose drafts
        take scheduler budget and so chunk prompts more often, never fails
        on it."""
        generators = self.input_batch.generators
        restored = {i: generators.pop(i) for i in self._discarded_generators if i in generators}
        for i, generator in restored.items():
            generator.set_state(self._discarded_generators[i])
        try:
            return super()._bookkeeping_sync(*args, **kwargs)
        finally:
            generators.update(restored)

    def _layout_trees(self, scheduler_output, num_scheduled_tokens) -> tree_step.TreeStep | None:
        """The step's trees, one per request with real drafts. A request with
        vLLM's placeholder drafts (:func:`placeholder_drafts`) gets none: its
        committed row is its first, which the verifier samples as vLLM's
        sampler would without speculation."""
        scheduled = scheduler_output.scheduled_spec_decode_tokens
        if not scheduled:
            return None
        batch_indices, trees, starts, lengths, paddings, forced = [], [], [], [], [], []
        query_start = self.query_start_loc.np
        grammar_kept = getattr(scheduler_output, "tree_kept", {})  # ``tree_scheduler``: trees a grammar cut
        grammar_forced = getattr(scheduler_output, "tree_forced", ())  # and requests it gave forced tokens
        for req_id, drafts in scheduled.items():
            if not drafts:
                continue
            index = self.input_batch.req_id_to_index[req_id]
            if placeholder_drafts(drafts):
                first = int(query_start[index])
                self._accepted_rows[index] = list(range(first, first + int(num_scheduled_tokens[index]) - len(drafts)))
                continue
            nodes = drafted_nodes(drafts)  # the rest: a uniform step's padding (``uniform_widths``)
            tree = None if req_id in grammar_forced else self._scheduled_tree(req_id, nodes, grammar_kept.get(req_id))
            if tree is None or tree.tokens != list(drafts[:nodes]):
                tree = DraftTree.chain(list(drafts[:nodes]))
            forced.append(req_id in grammar_forced)
            batch_indices.append(index)
            trees.append(tree)
            starts.append(int(query_start[index]))
            lengths.append(int(num_scheduled_tokens[index]))
            paddings.append(len(drafts) - nodes)
        if not trees:
            return None
        order = sorted(range(len(trees)), key=lambda k: batch_indices[k])
        step = self._lay_out(
            [batch_indices[k] for k in order],
            [trees[k] for k in order],
            [starts[k] for k in order],
            [lengths[k] for k in order],
            [paddings[k] for k in order],
            num_scheduled_tokens,
        )
        return dataclasses.replace(step, forced=tuple(forced[k] for k in order)) if any(forced) else step

    def _scheduled_tree(self, req_id: str, nodes: int, kept: list[int] | None) -> DraftTree | None:
        """The request's tree as scheduled: its first ``nodes`` nodes, or of
        the nodes its grammar ``kept`` (the scheduler's), the first ``nodes``."""
        stored = self.tree_proposer.trees.get(req_id)
        if stored is None:
            return None
        if kept is None:
            return stored.prefix(nodes)
        self.tree_proposer.stats.grammar_cut_nodes += len(stored) - len(kept)
        return stored.subset(kept[:nodes])

    def _lay_out(self, batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens) -> tree_step.TreeStep:
        """The step's trees laid out over its rows by the step mode's layout
        (``ragged_or_uniform``; ``cudagraphs.DecodeGraphsMixin`` adds what a replayed
        graph reads), node rows at ``p0 + depth``."""
        step = self._layout.lay_out(batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens,
                                    self.input_batch.num_reqs, self.device)
        self._set_depth_positions(step)
        return step

    def _set_depth_positions(self, step: tree_step.TreeStep) -> None:
        """Node rows get position ``p0 + depth`` (the root row keeps ``p0``).
        A step whose trees are all chains (no rows for the tree attention)
        has every node at ``p0 + depth`` already."""
        if step.causal:
            return
        device = self.positions.device
        self.positions[step.node_rows.to(device)] += step.node_offsets.to(device, self.positions.dtype)

    def _after_acceptance(self, step: tree_step.TreeStep, acceptance: Acceptance) -> None:
        """Move each accepted path's KV into consecutive slots after the root
        (on the device: moves that are not needed point at -1 and copy
        nothing), and send the acceptance to the host without waiting for it."""
        src_rows, dst_rows = path_moves(acceptance, step.root_rows + 1)
        live = src_rows >= 0
        slot_mapping = self.input_batch.block_table[0].slot_mapping.gpu
        src = torch.where(live, slot_mapping[src_rows.clamp(min=0)], -1).to(torch.int64)
        dst = torch.where(live, slot_mapping[dst_rows.clamp(min=0)], -1).to(torch.int64)
        compact_kv(*self._kv_views, src, dst)
        request_ids = [self.input_batch.req_ids[i] for i in step.host_batch_indices]
        self._pending_acceptance = PendingAcceptance.send(step, request_ids, acceptance)

    def _settle_acceptance(self) -> None:
        """Read the last verified step's acceptance (its copy has finished by
        the time vLLM's own per-step synchronisation returned) and let the
        proposer and the draft backend learn from it; the proposer learns
        from its drafter's trees only, not from grammar-forced tokens."""
        pending, self._pending_acceptance = self._pending_acceptance, None
        if pending is None:
            return
        step, paths, counts = pending.step, *pending.receive()
        forced = step.forced or (False,) * len(step.trees)
        mine, grammars = [k for k, f in enumerate(forced) if not f], [k for k, f in enumerate(forced) if f]
        ids, proposer = pending.request_ids, self.tree_proposer
        if grammars:
            proposer.stats.record_forced(sum(len(step.trees[k]) for k in grammars), sum(counts[k] for k in grammars))
        if mine:
            proposer.stats.record_step(len(mine), sum(len(step.trees[k]) for k in mine), sum(counts[k] for k in mine))
            proposer.observe([ids[k] for k in mine], [step.trees[k] for k in mine],
                             [paths[k][:counts[k]] for k in mine])
        self._drafted_share.verified([ids[k] for k in mine], [ids[k] for k in grammars])
        if self._draft_backend is not None:
            self._record_chains(step, paths, counts)

    def _record_chains(self, step: tree_step.TreeStep, paths: list[list[int]], counts: list[int]) -> None:
        """Each tree request's committed query rows in chain order: rows
        before the root, the root, then the accepted path's nodes (``paths``,
        ``counts``: the acceptance, on the host)."""
        for k, index in enumerate(step.host_batch_indices):
            first, root = step.host_first_rows[k], step.host_root_rows[k]
            chain = list(range(first, root + 1))
            chain += [root + 1 + node for node in paths[k][: counts[k]]]
            self._accepted_rows[index] = chain

    def propose_draft_token_ids(
        self, scheduler_output, sampled_token_ids, sampling_metadata=None, hidden_states=None,
        sample_hidden_states=None, aux_hidden_states=None, spec_decode_metadata=None,
        common_attn_metadata=None, *args, **kwargs
    ):
        self._settle_acceptance()
        batch = self.input_batch
        req_ids = batch.req_ids
        num_tokens = batch.num_tokens_no_spec
        sampled_pending = torch.is_tensor(sampled_token_ids)
        if sampled_pending:
            # Model drafters run before vLLM's bookkeeping: the step's tokens
            # are a padded tensor, and partial prefills' samples are discarded.
            discarded = self.discard_request_mask.np[: len(req_ids)]
            sampled_token_ids = [
                [] if discarded[i] else [t for t in row if t >= 0] for i, row in enumerate(sampled_token_ids.tolist())
            ]
            num_tokens = num_tokens[: len(req_ids)] + [len(s) for s in sampled_token_ids]
        step_tokens = scheduler_output.total_num_scheduled_tokens
        # Tokens beyond one row per request and its drafts: prefill chunks.
        drafts = scheduler_output.scheduled_spec_decode_tokens.values()
        spec_tokens = sum(len(d) for d in drafts)
        other_tokens = max(step_tokens - len(scheduler_output.num_scheduled_tokens) - spec_tokens, 0)
        counts = list(scheduler_output.num_scheduled_tokens.values())
        uniform = uniform_rows(max(counts, default=0), sum(counts), len(counts)) if other_tokens == 0 else None
        self.tree_proposer.observe_step(step_tokens, self.tree_proposer.agree(time.perf_counter() - self._step_started),
                                        other_tokens,
                                        sum(1 for d in drafts if d and not placeholder_drafts(d)), self._branching_trees,
                                        uniform)
        decision = self.tree_proposer.begin_step()
        first = None if self._draft_backend is None else StepFirstPass(
            self._draft_backend, aux_hidden_states, common_attn_metadata.block_table_tensor, self._accepted_rows,
            sampled_token_ids, req_ids)
        # A paused step of a drafter that fills runs its first pass when the fill knows its rows.
        fills = first is not None and self.tree_proposer.may_fill(decision)
        probe_rows = None if first is None or fills else first.now(decision.drafts, decision.limit)
        drafts = self.tree_proposer.propose_trees(
            req_ids, sampled_token_ids, num_tokens, batch.token_ids_cpu,
            self._eligible(req_ids, decision.drafts, probe_rows), decision, batch.num_prompt_tokens,
            sampled_pending, 0.0 if first is None else first.seconds, first.fill if fills else None,
        )
        if first is not None:
            first.finish()
        return drafts

    def _eligible(self, req_ids: list[str], drafting: bool, probe_rows: set[int] | None) -> list[bool]:
        """Which requests may get a tree this step: their sampling allows one,
        a probe's rows only, and on a drafting step those the draft model can draft for."""
        backend = self._draft_backend
        return [
            can_draft(self.requests[r].sampling_params)
            and (probe_rows is None or i in probe_rows)
            and (not drafting or backend is None or backend.can_draft(r))
            for i, r in enumerate(req_ids)
        ]

    def take_draft_token_ids(self) -> TreeDraftTokenIds | None:
        """vLLM's drafts with each request's tree parents, for the scheduler's
        grammar (``tree_scheduler``)."""
        drafts = super().take_draft_token_ids()
        if drafts is None:
            return None
        trees = self.tree_proposer.trees
        parents = [trees[req_id].parents if req_id in trees else None for req_id in drafts.req_ids]
        return TreeDraftTokenIds(drafts.req_ids, drafts.draft_token_ids, parents)

    def adaptive_tree_stats(self) -> dict[str, float]:
        """The proposer's counters, the shared datastore's size,
        ``requests_held``: per part, the requests it keeps state for (all
        zero when the engine is idle; anything else is a leak), and
        ``drafted_by_kind``: per kind of sampling, finished requests and
        those that had a tree verified (``drafted_share``)."""
        shared = getattr(self.tree_proposer.drafter, "shared", None)
        held = self.tree_proposer.requests_held()
        held["draft_kv"] = 0 if self._draft_backend is None else self._draft_backend.requests_held()
        held["drafted_share"] = self._drafted_share.requests_held()
        return self.tree_proposer.stats.as_dict() | self._step_mode_counters() | {
            "datastore_tokens": 0 if shared is None else shared.num_tokens,
            "requests_held": held,
            "drafted_by_kind": self._drafted_share.as_dict(),
            "depth_choices": self.tree_proposer.depth_choices(),
        }

    def _step_mode_counters(self) -> dict[str, int]:
        """What ran of the step mode's parts: steps laid out from the persistent
        tree buffers, steps whose width the measured shapes chose, and draft
        forwards padded as graphs would pad them."""
        cost, backend = self.tree_proposer.cost, self._draft_backend
        return {
            "uniform_layouts": self._layout.steps,
            "width_choices": 0 if cost is None else cost.width_choices,
            "padded_draft_passes": 0 if backend is None else backend.layers.padded_passes,
        }

    def adaptive_tree_clear_datastore(self) -> int:
        """Empty the retrieval drafter's shared datastore (``LLM.collective_rpc``); the tokens dropped."""
        return self.tree_proposer.clear_shared_datastore()
