"""The EAGLE-3 head: training-time test equals step-by-step drafting, and the
checkpoint round-trips in the format vLLM loads."""

import json

import torch
import torch.nn.functional as F

from vllm_adaptive_spec.training.eagle3_head import Eagle3Head, HeadConfig


def small_head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    config = HeadConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                        head_dim=8, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                        vocab_size=60, draft_vocab_size=40, aux_layer_ids=(1, 2, 3))
    head = Eagle3Head(config, torch.randn(60, 32))
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
        head.draft_to_target.copy_(torch.randperm(60)[:40].sort().values)
    return head


def attend(q, keys, values, group):
    """One query row over explicit key/value rows (reference attention)."""
    k = torch.stack(keys).repeat_interleave(group, dim=1)  # [S, heads, D]
    v = torch.stack(values).repeat_interleave(group, dim=1)
    w = torch.einsum("hd,shd->hs", q, k) * q.shape[-1] ** -0.5
    return torch.einsum("hs,shd->hd", w.softmax(-1), v)


def test_training_time_test_equals_sequential_drafting():
    head = small_head()
    c = head.config
    group = c.num_attention_heads // c.num_key_value_heads
    length, steps = 12, 4
    tokens = torch.randint(0, 60, (1, length))
    aux = torch.randn(1, length, 3 * c.hidden_size)
    with torch.no_grad():
        unrolled = head.training_forward(tokens, aux, steps)
        # Step 0 over the committed prefix, then a chain from base p, one row per pass.
        hidden = head.fc(aux[0])
        q0, k0, v0, res0 = head.project(F.pad(tokens[0, 1:], (0, 1)), hidden, torch.arange(length))
        for p in (0, 3, 7):
            out0 = attend(q0[p], list(k0[:p + 1]), list(v0[:p + 1]), group)
            logits, prev = head.finish(out0.unsqueeze(0), res0[p:p + 1])
            assert torch.allclose(logits[0], unrolled[0][0, p], atol=1e-4)
            chain_k, chain_v = [], []
            for j in range(1, steps):
                q, k, v, res = head.project(tokens[0, p + j + 1:p + j + 2], prev, torch.tensor([p + j]))
                chain_k.append(k[0])
                chain_v.append(v[0])
                out = attend(q[0], list(k0[:p + 1]) + chain_k, list(v0[:p + 1]) + chain_v, group)
                logits, prev = head.finish(out.unsqueeze(0), res)
                assert torch.allclose(logits[0], unrolled[j][0, p], atol=1e-4), (p, j)


def test_checkpoint_round_trip(tmp_path):
    head = small_head()
    head.save(tmp_path)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 40 and config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]
    from safetensors.torch import load_file

    state = load_file(str(tmp_path / "model.safetensors"))
    assert torch.equal(state["d2t"] + torch.arange(40), head.draft_to_target)
    assert int(state["t2d"].sum()) == 40 and bool(state["t2d"][head.draft_to_target].all())
    loaded = Eagle3Head.load(tmp_path, head.embed_tokens)
    assert torch.equal(loaded.draft_to_target, head.draft_to_target)
    for (name, mine), (_, theirs) in zip(head._checkpoint_params(), loaded._checkpoint_params()):
        assert torch.equal(mine.to(torch.bfloat16).float(), theirs), name


def test_training_sets_of_a_curve_are_nested_prefixes_by_answer_tokens():
    from vllm_adaptive_spec.training.train_eagle3 import first_answer_tokens

    sequences = [{"tokens": list(range(n)), "prompt_len": 2} for n in (12, 7, 22, 5)]  # 10, 5, 20, 3 answer tokens
    assert first_answer_tokens(sequences, 0) == sequences
    assert first_answer_tokens(sequences, 15) == sequences[:2]
    assert first_answer_tokens(sequences, 35) == sequences[:3]
    assert first_answer_tokens(sequences, 9) == []
    assert first_answer_tokens(sequences, 1000) == sequences
