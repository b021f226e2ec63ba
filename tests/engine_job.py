"""Run one real vLLM engine job in its own process and write the results as JSON.

Usage: python tests/engine_job.py JOB.json OUT.json

JOB keys: model, dtype, prompt_token_ids (list of lists), max_tokens,
optional speculative_config, temperature, seed, max_num_seqs.
OUT: {"token_ids": [[...], ...], "texts": [...]}

Each engine runs in a fresh process: vLLM's CPU engine spawns its workers, and
one engine per process keeps the tests' memory and state apart.
"""

import json
import sys


def main(job_path: str, out_path: str) -> None:
    with open(job_path, encoding="utf-8") as handle:
        job = json.load(handle)

    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=job["model"],
        dtype=job.get("dtype", "float32"),
        max_model_len=job.get("max_model_len", 2048),
        max_num_seqs=job.get("max_num_seqs", 16),
        enforce_eager=True,
        gpu_memory_utilization=0.4,
        seed=job.get("seed", 0),
        speculative_config=job.get("speculative_config"),
    )
    params = SamplingParams(
        temperature=job.get("temperature", 0.0),
        max_tokens=job["max_tokens"],
        seed=job.get("seed"),
    )
    prompts = [TokensPrompt(prompt_token_ids=ids) for ids in job["prompt_token_ids"]]
    outputs = llm.generate(prompts, params, use_tqdm=False)
    result = {
        "token_ids": [list(o.outputs[0].token_ids) for o in outputs],
        "texts": [o.outputs[0].text for o in outputs],
    }
    with open(out_path, "w", encoding="utf-8") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
