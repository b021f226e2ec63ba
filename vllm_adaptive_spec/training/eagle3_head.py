"""An EAGLE-3 draft head in plain torch, in the checkpoint format vLLM's
``eagle3`` method loads (``LlamaForCausalLMEagle3``: ``fc``, ``midlayer.*``,
``norm``, ``lm_head`` over a reduced draft vocabulary, ``d2t``/``t2d``; the
token embedding is the target's, not stored).

The math is vLLM's ``llama_eagle3`` (EAGLE-3, Li et al. 2025, section 3):
the first draft pass reads ``fc`` of the target's low/mid/high hidden states
``h_p`` with the embedding of the next token ``x_{p+1}`` at position ``p``;
every later pass reads the head's own pre-norm output instead of ``fc(h)``.
The decoder layer normalises both inputs (``input_layernorm``,
``hidden_norm``), concatenates them for q/k/v and keeps the pre-norm hidden
as the residual.

``training_forward`` implements training-time test (EAGLE-3 section 3.3):
step ``j`` unrolls the head on its own outputs; row ``p`` of step ``j`` sits
at position ``p + j`` and attends to step 0's keys at positions ``<= p`` and
to its own chain (steps ``1..j`` of row ``p``), exactly what a depth-``j``
draft node sees at inference.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass
class HeadConfig:
    hidden_size: int
    intermediate_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    vocab_size: int
    draft_vocab_size: int
    aux_layer_ids: tuple[int, ...]

    @classmethod
    def for_target(cls, target_config, draft_vocab_size: int) -> "HeadConfig":
        layers = target_config.num_hidden_layers
        rope = getattr(target_config, "rope_parameters", None) or {}
        return cls(
            hidden_size=target_config.hidden_size,
            intermediate_size=target_config.intermediate_size,
            num_attention_heads=target_config.num_attention_heads,
            num_key_value_heads=target_config.num_key_value_heads,
            head_dim=getattr(target_config, "head_dim", None)
            or target_config.hidden_size // target_config.num_attention_heads,
            rms_norm_eps=target_config.rms_norm_eps,
            rope_theta=float(rope.get("rope_theta", getattr(target_config, "rope_theta", 10000.0))),
            max_position_embeddings=target_config.max_position_embeddings,
            vocab_size=target_config.vocab_size,
            draft_vocab_size=draft_vocab_size,
            # vLLM's default for Llama targets: after layers 2, L/2 and L-3.
            aux_layer_ids=(2, layers // 2, layers - 3),
        )

    def to_hf(self) -> dict:
        """The ``config.json`` vLLM reads."""
        return {
            "architectures": [ARCHITECTURE],
            "model_type": "llama",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "num_hidden_layers": 1,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "vocab_size": self.vocab_size,
            "draft_vocab_size": self.draft_vocab_size,
            "target_hidden_size": self.hidden_size,
            "tie_word_embeddings": False,
            "hidden_act": "silu",
            "torch_dtype": "bfloat16",
            "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(self.aux_layer_ids), "use_aux_hidden_state": True},
        }


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    x32 = x.float()
    return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype) * weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox-style rotary embedding; ``x`` [..., T, heads, D], ``positions`` [..., T]."""
    half = x.shape[-1] // 2
    inv = 1.0 / (theta ** (torch.arange(half, dtype=torch.float32, device=x.device) / half))
    angles = positions.float().unsqueeze(-1) * inv
    cos, sin = angles.cos().unsqueeze(-2), angles.sin().unsqueeze(-2)
    x1, x2 = x[..., :half].float(), x[..., half:].float()
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


class Eagle3Head(nn.Module):
    def __init__(self, config: HeadConfig, embed_tokens: torch.Tensor) -> None:
        super().__init__()
        c = config
        self.config = c
        h, heads, kv = c.hidden_size, c.num_attention_heads, c.num_key_value_heads
        self.register_buffer("embed_tokens", embed_tokens.detach().clone(), persistent=False)
        self.fc = nn.Linear(len(c.aux_layer_ids) * h, h, bias=False)
        self.input_layernorm = nn.Parameter(torch.ones(h))
        self.hidden_norm = nn.Parameter(torch.ones(h))
        self.post_attention_layernorm = nn.Parameter(torch.ones(h))
        self.q_proj = nn.Linear(2 * h, heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, kv * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, kv * c.head_dim, bias=False)
        self.o_proj = nn.Linear(heads * c.head_dim, h, bias=False)
        self.gate_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.up_proj = nn.Linear(h, c.intermediate_size, bias=False)
        self.down_proj = nn.Linear(c.intermediate_size, h, bias=False)
        self.norm = nn.Parameter(torch.ones(h))
        self.lm_head = nn.Linear(h, c.draft_vocab_size, bias=False)
        self.register_buffer("draft_to_target", torch.arange(c.draft_vocab_size))

    # -- pieces ---------------------------------------------------------------
    def project(self, tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor):
        """q, k, v [..., T, heads, D] and the residual, for the inputs of one pass."""
        c = self.config
        embeds = rms_norm(self.embed_tokens[tokens], self.input_layernorm, c.rms_norm_eps)
        x = torch.cat([embeds, rms_norm(hidden, self.hidden_norm, c.rms_norm_eps)], dim=-1)
        shape = x.shape[:-1]
        q = self.q_proj(x).view(*shape, c.num_attention_heads, c.head_dim)
        k = self.k_proj(x).view(*shape, c.num_key_value_heads, c.head_dim)
        v = self.v_proj(x).view(*shape, c.num_key_value_heads, c.head_dim)
        return rotate(q, positions, c.rope_theta), rotate(k, positions, c.rope_theta), v, hidden

    def finish(self, attn: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Draft-vocabulary logits and the pre-norm output (the next pass's hidden)."""
        eps = self.config.rms_norm_eps
        residual = self.o_proj(attn.flatten(-2)) + residual
        x = rms_norm(residual, self.post_attention_layernorm, eps)
        out = self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x)) + residual
        return self.lm_head(rms_norm(out, self.norm, eps)), out

    def target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return self.draft_to_target[draft_ids]

    def target_to_draft(self) -> torch.Tensor:
        """[vocab_size]: each target token's draft id, -1 outside the draft vocabulary."""
        out = torch.full((self.config.vocab_size,), -1, dtype=torch.long)
        out[self.draft_to_target] = torch.arange(self.config.draft_vocab_size)
        return out

    # -- training-time test -----------------------------------------------------
    def training_forward(self, tokens: torch.Tensor, aux_hidden: torch.Tensor, steps: int) -> list[torch.Tensor]:
        """Logits of every unrolled step for sequences ``tokens`` [B, T] with
        target hidden states ``aux_hidden`` [B, T, 3H]. Row ``p`` of step ``j``
        reads token ``x_{p+j+1}`` and predicts ``x_{p+j+2}``; rows that run past
        the sequence read token 0 and must be masked out of the loss."""
        batch, length = tokens.shape
        c = self.config
        group = c.num_attention_heads // c.num_key_value_heads
        scale = c.head_dim ** -0.5
        base = torch.arange(length, device=tokens.device).expand(batch, length)
        causal = torch.ones(length, length, dtype=torch.bool, device=tokens.device).tril()
        hidden = self.fc(aux_hidden)
        keys, values, logits = [], [], []
        for j in range(steps):
            shifted = F.pad(tokens[:, j + 1:], (0, j + 1))
            q, k, v, residual = self.project(shifted, hidden, base + j)
            q = q.transpose(1, 2)  # [B, heads, T, D]
            k = k.repeat_interleave(group, dim=2).transpose(1, 2)
            v = v.repeat_interleave(group, dim=2).transpose(1, 2)
            if j == 0:
                attn = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                ctx = (q @ keys[0].transpose(-1, -2) * scale).masked_fill(~causal, float("-inf"))
                diag = [(q * key).sum(-1, keepdim=True) * scale for key in keys[1:]]
                diag.append((q * k).sum(-1, keepdim=True) * scale)
                weights = torch.cat([ctx, *diag], dim=-1).float().softmax(-1).to(q.dtype)
                attn = weights[..., :length] @ values[0]
                for i, value in enumerate([*values[1:], v]):
                    attn = attn + weights[..., length + i:length + i + 1] * value
            keys.append(k)
            values.append(v)
            step_logits, hidden = self.finish(attn.transpose(1, 2), residual)
            logits.append(step_logits)
        return logits

    # -- checkpoint -------------------------------------------------------------
    def state_for_checkpoint(self, dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
        """Tensors named as in standard EAGLE-3 checkpoints."""
        state = {name: t.detach().to(dtype).contiguous() for name, t in self._checkpoint_params()}
        ids = self.draft_to_target
        state["d2t"] = (ids - torch.arange(ids.shape[0])).to(torch.int64)
        t2d = torch.zeros(self.config.vocab_size, dtype=torch.bool)
        t2d[ids] = True
        state["t2d"] = t2d
        return state

    def save(self, directory: Path) -> None:
        from safetensors.torch import save_file

        directory.mkdir(parents=True, exist_ok=True)
        save_file(self.state_for_checkpoint(), str(directory / "model.safetensors"))
        (directory / "config.json").write_text(json.dumps(self.config.to_hf(), indent=2) + "\n")

    @classmethod
    def load(cls, directory: Path, embed_tokens: torch.Tensor) -> "Eagle3Head":
        from safetensors.torch import load_file

        hf = json.loads((Path(directory) / "config.json").read_text())
        config = HeadConfig(
            **{k: hf[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
                                  "head_dim", "rms_norm_eps", "rope_theta", "max_position_embeddings", "vocab_size",
                                  "draft_vocab_size")},
            aux_layer_ids=tuple(hf["eagle_config"]["eagle_aux_hidden_state_layer_ids"]),
        )
        head = cls(config, embed_tokens)
        state = load_file(str(Path(directory) / "model.safetensors"))
        head.draft_to_target.copy_(state.pop("d2t") + torch.arange(config.draft_vocab_size))
        state.pop("t2d")
        params = dict(head._checkpoint_params())
        with torch.no_grad():
            for name, tensor in state.items():
                params[name].copy_(tensor.float())
        return head

    def _checkpoint_params(self):
        yield from (
            ("fc.weight", self.fc.weight),
            ("midlayer.input_layernorm.weight", self.input_layernorm),
            ("midlayer.hidden_norm.weight", self.hidden_norm),
            ("midlayer.post_attention_layernorm.weight", self.post_attention_layernorm),
            ("midlayer.self_attn.q_proj.weight", self.q_proj.weight),
            ("midlayer.self_attn.k_proj.weight", self.k_proj.weight),
            ("midlayer.self_attn.v_proj.weight", self.v_proj.weight),
            ("midlayer.self_attn.o_proj.weight", self.o_proj.weight),
            ("midlayer.mlp.gate_proj.weight", self.gate_proj.weight),
            ("midlayer.mlp.up_proj.weight", self.up_proj.weight),
            ("midlayer.mlp.down_proj.weight", self.down_proj.weight),
            ("norm.weight", self.norm),
            ("lm_head.weight", self.lm_head.weight),
        )
