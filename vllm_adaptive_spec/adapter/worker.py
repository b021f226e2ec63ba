"""What the plugin's workers of every platform share: the RPCs that read and
reset the tree runner's state (``LLM.collective_rpc``)."""

from __future__ import annotations


class TreeWorkerMixin:
    def adaptive_tree_stats(self) -> dict[str, float]:
        return self.model_runner.adaptive_tree_stats()

    def adaptive_tree_clear_datastore(self) -> int:
        return self.model_runner.adaptive_tree_clear_datastore()
