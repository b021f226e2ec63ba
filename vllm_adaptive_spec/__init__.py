"""vllm-adaptive-spec: adaptive token-tree speculative decoding inside vLLM.

The package splits in two:

* an engine-agnostic core (plain torch over batched tensors), tested without vLLM;
* ``vllm_adaptive_spec.adapter``, the one module tree that touches vLLM internals.

vLLM loads the plugin through the ``vllm.general_plugins`` entry point
(:func:`vllm_adaptive_spec.plugin.register`).
"""

__version__ = "0.1.0"
