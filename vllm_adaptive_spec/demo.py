"""The demo: offline ``LLM.chat`` on the demo model over a handful of the
project's prompts (one per category), printing each answer and tokens/s."""

from __future__ import annotations

import argparse
import time


def engine_kwargs(model: str, dtype: str, max_model_len: int) -> dict:
    """Settings for a small offline engine on this project's machines."""
    return dict(
        model=model,
        dtype=dtype,
        max_model_len=max_model_len,
        enforce_eager=True,
        gpu_memory_utilization=0.4,
        seed=0,
    )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--model", help="model directory (default: the demo model, converted if needed)")
    parser.add_argument("--prompts", help="prompt set JSONL (default: benchmarks/prompts.jsonl)")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args(argv)

    from vllm_adaptive_spec.demo_model import ensure_demo_model
    from vllm_adaptive_spec.prompts import load_prompts, one_per_category

    model = args.model or str(ensure_demo_model())
    prompts = one_per_category(load_prompts(args.prompts))

    from vllm import LLM, SamplingParams

    llm = LLM(**engine_kwargs(model, args.dtype, max_model_len=2048))
    params = SamplingParams(temperature=0.0, max_tokens=args.max_tokens)
    start = time.perf_counter()
    outputs = llm.chat([p.messages for p in prompts], params, use_tqdm=False)
    elapsed = time.perf_counter() - start

    generated = 0
    for prompt, output in zip(prompts, outputs):
        completion = output.outputs[0]
        generated += len(completion.token_ids)
        print(f"\n=== {prompt.id} ({prompt.category}) ===")
        print(f"Q: {prompt.messages[-1]['content'][:200]}")
        print(f"A: {completion.text.strip()}")
    print(f"\n{len(prompts)} prompts, {generated} tokens in {elapsed:.1f} s: {generated / elapsed:.1f} tok/s")


if __name__ == "__main__":
    main()
