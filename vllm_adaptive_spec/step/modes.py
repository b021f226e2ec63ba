"""How the engine's drafting steps are shaped, decided once with the config.

* :class:`RaggedSteps`: a request's rows are its tree's; the load budget
  prices a row (``cost_models.LinearCost``); the tree layout is built on the
  host (``tree_step.build_step``); a model drafter's layers run ragged, the fed
  rows only (``draft_layers.RaggedLayers``). Where every row costs (the CPU)
  a padded row would be a row paid for nothing.
* :class:`UniformSteps` (``trees.uniform_widths``): every decoding request of a
  drafting step has ``1 + W`` rows, ``W`` one of a few widths; the
  load budget chooses the width by the measured cost of each step shape
  (``cost_models.ShapeCost``); the layout comes from persistent tree buffers
  on the device (``tree_step.build_uniform_step``); a model drafter's layers run
  at fixed capacity with every forward in the draft model's persistent
  buffers (``draft_layers.FixedLayers``). That is the step a CUDA graph
  replays; where no graph replays it (the CPU) it runs the same, the
  forwards padded as a graph's capture sizes would pad them.

The adapter's ``ragged_or_uniform.resolve`` picks one from the config and
the engine (``step_shape``), once; each mode's :meth:`RaggedSteps.layout`
gives the step's layout builder (:class:`RaggedLayout` or :class:`UniformLayout`).
"""

from __future__ import annotations

import torch

from vllm_adaptive_spec.budget.cost_fit import StepCostFit
from vllm_adaptive_spec.budget.cost_models import LinearCost, ShapeCost
from vllm_adaptive_spec.budget.cost_table import StepCostTable
from vllm_adaptive_spec.step import tree_step
from vllm_adaptive_spec.step.draft_layers import FixedLayers, RaggedLayers
from vllm_adaptive_spec.trees.tree_buffers import TreeBuffers
from vllm_adaptive_spec.trees.uniform_widths import step_widths, uniform_drafts


class RaggedSteps:
    """A request's rows are its tree's (see the module)."""

    uniform = False
    widths: tuple[int, ...] | None = None
    graph_tree_rows: frozenset[int] = frozenset()  # the rows a request of a tree step a FULL graph replays

    def __init__(self, config) -> None:
        self.config = config

    def cost_model(self, fit: StepCostFit) -> LinearCost:
        return LinearCost(fit)

    def scheduled(self, drafts: list[list[int]], decoding: list[bool], max_tokens: int) -> list[list[int]]:
        """The step's drafts as vLLM schedules them (each tree's tokens)."""
        return drafts

    def draft_layers(self, device) -> FixedLayers | RaggedLayers:
        """A model drafter's tree layers: the fed rows only."""
        return RaggedLayers()

    def layout(self, max_reqs: int, device) -> "RaggedLayout":
        return RaggedLayout()


class UniformSteps(RaggedSteps):
    """Every decoding request of a drafting step has ``1 + W`` rows (see the
    module). ``batch_sizes``: what a step's batch pads to (the captured
    graphs' sizes; none without graphs); ``graphs``: whether graphs replay
    steps (else the draft forwards are padded here as a graph's would be)."""

    uniform = True

    def __init__(self, config, num_speculative_tokens: int, batch_sizes: tuple[int, ...], graphs: bool) -> None:
        super().__init__(config)
        self.widths = step_widths(config.max_nodes)
        self.capacity = max(*self.widths, num_speculative_tokens)  # the widest step: vLLM's own rows too
        self.batch_sizes, self.graphs = batch_sizes, graphs
        # The rows a request of a uniform step can have: a captured graph's key each, where graphs replay.
        self.tree_rows = frozenset({1 + width for width in self.widths} | {1 + num_speculative_tokens})
        self.graph_tree_rows = self.tree_rows if graphs else frozenset()

    def cost_model(self, fit: StepCostFit) -> ShapeCost:
        return ShapeCost(self.widths, StepCostTable(self.batch_sizes), LinearCost(fit))

    def scheduled(self, drafts: list[list[int]], decoding: list[bool], max_tokens: int) -> list[list[int]]:
        """Each decoding request's drafts padded to the step's width (``uniform_widths.uniform_drafts``)."""
        return uniform_drafts(drafts, decoding, self.widths, max_tokens)

    def draft_layers(self, device) -> FixedLayers | RaggedLayers:
        """The fixed loop where the drafter can grow at fixed capacity;
        without graphs every draft forward is padded to the plugin's batch
        sizes and staged in the draft model's persistent buffers, the path a
        graph's replay takes."""
        if not self.config.fixed_loop_capable:
            return RaggedLayers()
        return FixedLayers(torch.device(device), padded=not self.graphs)

    def layout(self, max_reqs: int, device) -> "UniformLayout":
        return UniformLayout(TreeBuffers(max_reqs, self.capacity, torch.device(device)))


class RaggedLayout:
    """Trees laid out on the host, at their own sizes."""

    steps = 0  # steps laid out from persistent buffers (none here)

    def uniform_rows(self, num_scheduled_tokens, num_reqs: int) -> int | None:
        return None

    def lay_out(self, batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens, num_reqs, device):
        return tree_step.build_step(batch_indices, trees, starts, lengths, device, paddings)


class UniformLayout(RaggedLayout):
    """A uniform step laid out on the device from persistent tree buffers;
    a step whose requests do not all have the same rows (a prompt chunk
    beside them) is laid out ragged."""

    def __init__(self, buffers: TreeBuffers) -> None:
        self.buffers = buffers
        self.steps = 0  # steps laid out from the buffers

    def uniform_rows(self, num_scheduled_tokens, num_reqs: int) -> int | None:
        """Every request's rows, where they are the same and fit the buffers."""
        rows = int(num_scheduled_tokens[0]) if num_reqs else 0
        if not 1 < rows <= 1 + self.buffers.capacity or not (num_scheduled_tokens[:num_reqs] == rows).all():
            return None
        return rows

    def lay_out(self, batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens, num_reqs, device):
        rows = self.uniform_rows(num_scheduled_tokens, num_reqs)
        if rows is None:
            return super().lay_out(batch_indices, trees, starts, lengths, paddings, num_scheduled_tokens, num_reqs,
                                   device)
        self.steps += 1
        return tree_step.build_uniform_step(batch_indices, trees, rows, self.buffers, device)
