"""KV compaction: the Triton kernel (on CUDA tensors where a GPU is present,
interpreted elsewhere) against the torch reference, and the reference against
hand-computed and independent results."""

from __future__ import annotations

import math

import pytest
import torch

from kernels.cpu_library import library, machine_isa
from kernels.kv_compaction import compact_kv, compact_kv_reference, compact_kv_cpu, compact_kv_triton

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def random_cache(gen, num_blocks, block_size, heads, head_dim, dtype, transposed):
    """A ``[num_blocks, block_size, heads, head_dim]`` cache, as a view of
    ``[num_blocks, heads, head_dim, block_size]`` storage when ``transposed``."""
    if transposed:
        return torch.randn(num_blocks, heads, head_dim, block_size, generator=gen).to(dtype).permute(0, 3, 1, 2)
    return torch.randn(num_blocks, block_size, heads, head_dim, generator=gen).to(dtype)


def make_caches(gen, num_blocks, block_size, heads, head_dim, dtype=torch.float32, transposed=(False, False)):
    """Key and value caches; ``transposed`` says which of the two are strided views."""
    return [random_cache(gen, num_blocks, block_size, heads, head_dim, dtype, t) for t in transposed]


def make_rows(gen, num_requests, tree_size, block_size):
    """Accepted paths of random token trees, with their requests' slots.

    Request ``b`` has context ``P_b`` and tree nodes at logical positions
    ``P_b + 1 .. P_b + tree_size``; it accepts nodes ``r_1 < ... < r_a`` (``a`` may
    be 0), whose KV moves from ``P_b + r_j`` to ``P_b + j``. Blocks are handed out
    in a shuffled order. Returns src/dst slots ``[R, tree_size]`` padded with -1,
    the number of blocks, and per request (slot of a logical position, P, r).
    """
    contexts = torch.randint(0, 3 * block_size, (num_requests,), generator=gen).tolist()
    blocks_per_req = [math.ceil((p + tree_size + 1) / block_size) for p in contexts]
    num_blocks = sum(blocks_per_req) + 2
    physical = torch.randperm(num_blocks, generator=gen).tolist()
    src = torch.full((num_requests, tree_size), -1, dtype=torch.int64)
    dst = torch.full_like(src, -1)
    paths = []
    for b, (context, n) in enumerate(zip(contexts, blocks_per_req)):
        table, physical = physical[:n], physical[n:]

        def slot(pos, table=table):
            return table[pos // block_size] * block_size + pos % block_size

        accepted = int(torch.randint(0, tree_size + 1, (1,), generator=gen))
        r = sorted((torch.randperm(tree_size, generator=gen)[:accepted] + 1).tolist())
        src[b, :accepted] = torch.tensor([slot(context + rj) for rj in r], dtype=torch.int64)
        dst[b, :accepted] = torch.tensor([slot(context + j) for j in range(1, accepted + 1)], dtype=torch.int64)
        paths.append((slot, context, r))
    return src, dst, num_blocks, paths


@pytest.mark.parametrize(
    "config",
    [
        dict(block_size=4, heads=2, head_dim=16),
        dict(block_size=4, heads=2, head_dim=24, transposed=(True, False)),
        dict(block_size=8, heads=3, head_dim=16, dtype=torch.bfloat16, transposed=(True, True)),
    ],
    ids=["plain", "key-transposed-d24", "bf16-transposed"],
)
@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("block_e", [16, 512])
def test_triton_matches_reference(config, seed, block_e):
    """Whole rows in one program (512 elements) and rows cut into chunks of 16."""
    gen = torch.Generator().manual_seed(seed)
    block_size = config["block_size"]
    src, dst, num_blocks, paths = make_rows(gen, num_requests=5, tree_size=7, block_size=block_size)
    other = {k: v for k, v in config.items() if k != "block_size"}
    originals = make_caches(gen, num_blocks, block_size, **other)
    expected = [c.clone() for c in originals]
    actual = [c.clone() for c in originals]
    compact_kv_reference(expected[:1], expected[1:], src, dst)
    on_device = [c.to(DEVICE) for c in actual]
    compact_kv_triton(on_device[:1], on_device[1:], src.to(DEVICE), dst.to(DEVICE), block_e=block_e)
    actual = [c.cpu() for c in on_device]

    written = torch.zeros(num_blocks, block_size, dtype=torch.bool)
    for s in dst[dst >= 0].tolist():
        written[s // block_size, s % block_size] = True
    for orig, ref, out in zip(originals, expected, actual):
        assert torch.equal(out, ref)
        assert torch.equal(out[~written], orig[~written])
        for slot, context, r in paths:
            for j, rj in enumerate(r, start=1):
                moved_to, moved_from = slot(context + j), slot(context + rj)
                assert torch.equal(
                    out[moved_to // block_size, moved_to % block_size],
                    orig[moved_from // block_size, moved_from % block_size],
                )


def slot_id_caches(num_blocks=2, block_size=4, heads=2, head_dim=16):
    """Caches whose every vector holds its own slot number (the value cache negated)."""
    slots = torch.arange(num_blocks * block_size, dtype=torch.float32).view(num_blocks, block_size, 1, 1)
    key = slots.expand(num_blocks, block_size, heads, head_dim).clone()
    return key, -key


def slot_ids(key_cache):
    return key_cache[:, :, 0, 0].flatten().long().tolist()


def compact_kv_native(key_caches, value_caches, src, dst):
    """The native CPU op (``kv_compaction_cpu.cpp``) of this machine's library."""
    library(machine_isa()).compact_kv([*key_caches, *value_caches], src, dst)


# Row 0 overlaps (slot 2 is pair 0's source and pair 1's destination); row 1 has
# a no-op pair (5 -> 5) and a copy; row 2 is all padding.
SRC = torch.tensor([[2, 3, -1], [5, 7, -1], [-1, -1, -1]])
DST = torch.tensor([[1, 2, -1], [5, 6, -1], [-1, -1, -1]])
EXPECTED = [0, 2, 3, 3, 4, 5, 7, 7]


@pytest.mark.parametrize("impl", [compact_kv_reference, compact_kv_triton, compact_kv_cpu, compact_kv,
                                  compact_kv_native], ids=lambda f: f.__name__)
def test_hand_computed_overlap(impl):
    device = "cpu" if impl is compact_kv_native else DEVICE
    key, value = (c.to(device) for c in slot_id_caches())
    impl([key], [value], SRC.to(device), DST.to(device))
    assert slot_ids(key) == EXPECTED
    assert torch.equal(value, -key)


@pytest.mark.parametrize("seed", range(3))
def test_cpu_path_matches_reference(seed):
    """The vectorised path off CUDA on random accepted paths."""
    gen = torch.Generator().manual_seed(seed)
    src, dst, num_blocks, _ = make_rows(gen, num_requests=6, tree_size=7, block_size=4)
    originals = make_caches(gen, num_blocks, 4, 2, 16, transposed=(True, False))
    expected, actual = [c.clone() for c in originals], [c.clone() for c in originals]
    compact_kv_reference(expected[:1], expected[1:], src, dst)
    compact_kv_cpu(actual[:1], actual[1:], src, dst)
    assert all(torch.equal(a, e) for a, e in zip(actual, expected))
    assert not all(torch.equal(a, o) for a, o in zip(actual, originals))


@pytest.mark.parametrize("seed", range(3))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_native_cpu_op_matches_reference(seed, dtype):
    """The native op on random accepted paths, keys a strided view (vLLM's
    ``vec`` layout keeps a page's keys transposed), several layers of two
    head sizes in one call."""
    gen = torch.Generator().manual_seed(seed)
    src, dst, num_blocks, _ = make_rows(gen, num_requests=6, tree_size=7, block_size=4)
    layers = [make_caches(gen, num_blocks, 4, 2, head_dim, dtype, transposed=(True, False)) for head_dim in (16, 16, 24)]
    expected, actual = [[c.clone() for c in layer] for layer in layers], [[c.clone() for c in layer] for layer in layers]
    for key, value in expected:
        compact_kv_reference([key], [value], src, dst)
    compact_kv_native([k for k, _ in actual], [v for _, v in actual], src, dst)
    assert all(torch.equal(a, e) for layer, want in zip(actual, expected) for a, e in zip(layer, want))
    assert not all(torch.equal(a, o) for layer, orig in zip(actual, layers) for a, o in zip(layer, orig))


def test_native_cpu_op_refuses_a_slot_outside_the_cache():
    key, value = slot_id_caches()
    with pytest.raises(RuntimeError, match="outside the cache"):
        compact_kv_native([key], [value], torch.tensor([[key.shape[0] * key.shape[1]]]), torch.tensor([[0]]))


def test_out_of_order_copy_would_differ():
    """Copying row 0's pairs out of order (as unordered parallel copies may)
    overwrites slot 2 before it is read, so the order is observable."""
    key, value = slot_id_caches()
    compact_kv_reference([key], [value], SRC.flip(1), DST.flip(1))
    assert slot_ids(key) != EXPECTED


def test_every_layer_in_one_launch():
    """Three layers' caches, separately allocated, each compacted as the
    reference compacts it on its own; the rows' order is layer-independent."""
    gen = torch.Generator().manual_seed(7)
    src, dst, num_blocks, _ = make_rows(gen, num_requests=6, tree_size=8, block_size=4)
    layers = [make_caches(gen, num_blocks, 4, 2, 16, transposed=(True, False)) for _ in range(3)]
    expected = [[c.clone() for c in layer] for layer in layers]
    originals = [[c.clone() for c in layer] for layer in layers]
    for key, value in expected:
        compact_kv_reference([key], [value], src, dst)
    on_device = [[c.to(DEVICE) for c in layer] for layer in originals]
    compact_kv_triton([k for k, _ in on_device], [v for _, v in on_device], src.to(DEVICE), dst.to(DEVICE))
    for (key, value), (want_key, want_value) in zip(on_device, expected):
        assert torch.equal(key.cpu(), want_key) and torch.equal(value.cpu(), want_value)
    assert not torch.equal(expected[0][0], layers[0][0])  # something moved


def test_layers_of_different_layouts_are_refused():
    key = torch.zeros(2, 4, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="one shape, stride, dtype and device"):
        compact_kv_triton([key, key.double()], [key, key], SRC.to(DEVICE), DST.to(DEVICE))


def test_dispatch_launches_once_per_layout(monkeypatch):
    """The dispatcher compacts layers of two layouts (a target's and a draft
    model's of another head size) as the reference does, one launch per layout."""
    from kernels import kv_compaction

    gen = torch.Generator().manual_seed(3)
    src, dst, num_blocks, _ = make_rows(gen, num_requests=4, tree_size=6, block_size=4)
    layers = [make_caches(gen, num_blocks, 4, 2, 16), make_caches(gen, num_blocks, 4, 2, 32),
              make_caches(gen, num_blocks, 4, 2, 16)]
    expected = [[c.clone() for c in layer] for layer in layers]
    for key, value in expected:
        compact_kv_reference([key], [value], src, dst)
    launches = []
    launch = kv_compaction.compact_kv_triton
    monkeypatch.setattr(kv_compaction, "_on_gpu", lambda tensor: True)
    monkeypatch.setattr(kv_compaction, "compact_kv_triton", lambda k, *a: launches.append(len(k)) or launch(k, *a))
    on_device = [[c.to(DEVICE) for c in layer] for layer in layers]
    compact_kv([k for k, _ in on_device], [v for _, v in on_device], src.to(DEVICE), dst.to(DEVICE))
    assert sorted(launches) == [1, 2]
    for (key, value), (want_key, want_value) in zip(on_device, expected):
        assert torch.equal(key.cpu(), want_key) and torch.equal(value.cpu(), want_value)
