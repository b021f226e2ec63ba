"""GPU timings of the policy kernels against their torch references.

* ``kernels.draft_distribution`` at V = 128,256 (Llama 3's vocabulary) and
  49,152 (the demo model's), 640 rows (a draft pass over 64 requests' frontiers
  of 10 nodes), bf16 and fp32 logits, top-16, without and with C2T's top-1000
  entropy; the fraction of the GPU's copy bandwidth is the logits' bytes
  (read once) over the time, divided by what ``y.copy_(x)`` reaches on the
  same GPU in the same run (counting bytes read and written).
* ``kernels.tree_gating``: TALON's deeper-layer gate (K_c = 16 candidates of
  10 frontier nodes) and DynaTree's (3 candidates of 60 frontier nodes) for
  256 requests.

Medians of ``triton.testing.do_bench``. Needs a CUDA GPU (it says so and exits
otherwise); writes ``policy_kernels.json`` and ``policy_kernels.md`` in ``--out``.

Reproduce on a GPU machine (only torch and triton needed, no vLLM)::

    python3 -m benchmarks.policy_kernels --out /tmp/policy_kernels   # from the repository root
    .venv/bin/vllm-adaptive-spec bench policy-kernels --out /tmp/policy_kernels   # where the package is installed
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.gpu_timing import bench, copy_bandwidth, require_cuda
from benchmarks.options import add_output
from benchmarks.report import write_report
from kernels.draft_distribution import draft_distribution_reference, draft_distribution_triton
from kernels.tree_gating import (
    dynatree_gate_reference,
    dynatree_gate_triton,
    talon_gate_reference,
    talon_gate_triton,
)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=640)
    add_output(parser)
    args = parser.parse_args(argv)
    require_cuda("benchmarks/policy_kernels.py")
    bandwidth = copy_bandwidth()
    rows = []
    for vocab in (128256, 49152):
        for dtype in (torch.bfloat16, torch.float32):
            logits = (3 * torch.randn(args.rows, vocab, device="cuda")).to(dtype)
            for k, m in ((16, 0), (16, 1000)):
                kernel_ms = bench(lambda: draft_distribution_triton(logits, k, m))
                reference_ms = bench(lambda: draft_distribution_reference(logits, k, m))
                read = logits.numel() * logits.element_size()
                rows.append({
                    "kernel": "draft_distribution", "shape": f"{args.rows} x {vocab} {str(dtype)[6:]}, k={k}, m={m}",
                    "kernel_us": 1e3 * kernel_ms, "reference_us": 1e3 * reference_ms,
                    "copy_fraction": read / (kernel_ms / 1e3) / bandwidth,
                })
    requests = 256
    gen = torch.Generator(device="cuda").manual_seed(0)
    for name, width_f, width_c in (("talon_gate", 10, 16), ("dynatree_gate", 60, 3)):
        q = torch.rand(requests, width_f, width_c, device="cuda", generator=gen).sort(-1, descending=True).values
        parent_p = torch.rand(requests, width_f, device="cuda", generator=gen)
        p = parent_p.unsqueeze(-1) * q
        exists = q > 0
        remaining = torch.full((requests,), 30, device="cuda")
        if name == "talon_gate":
            call = (talon_gate_triton, talon_gate_reference, (p, exists, remaining, False, 10, 0.03, 16))
        else:
            d0 = torch.full((requests,), 5, device="cuda")
            tau_h = torch.full((requests,), 0.9, device="cuda")
            call = (dynatree_gate_triton, dynatree_gate_reference,
                    (p, exists, parent_p, q[..., 0], remaining, d0, tau_h, 2, 8, (1, 2, 3), 0.4, 0.03, 0.01, 0.1))
        kernel, reference, inputs = call
        rows.append({
            "kernel": name, "shape": f"{requests} requests x {width_f} nodes x {width_c} candidates",
            "kernel_us": 1e3 * bench(lambda: kernel(*inputs)), "reference_us": 1e3 * bench(lambda: reference(*inputs)),
            "copy_fraction": None,
        })
    report = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth_tb_s": bandwidth / 1e12, "rows": rows}
    lines = [f"GPU: {report['gpu']}; copy bandwidth {report['copy_bandwidth_tb_s']:.2f} TB/s (read + written)", "",
             "| kernel | shape | kernel (us) | torch reference (us) | % copy |", "|---|---|---:|---:|---:|"]
    for row in rows:
        share = "" if row["copy_fraction"] is None else f"{100 * row['copy_fraction']:.1f}"
        lines.append(f"| {row['kernel']} | {row['shape']} | {row['kernel_us']:.1f} | {row['reference_us']:.1f} | {share} |")
    write_report(args.out, "policy_kernels", report, "\n".join(lines))


if __name__ == "__main__":
    main()
