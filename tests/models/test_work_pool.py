"""The kernels' work pool (work_pool.h): a thread the OS stops holds at most the chunk it was running,
and the split between threads never changes a result."""
from __future__ import annotations

import pytest
import torch

from chatloom.models.kernels import load_kernels
from chatloom.models.packed_linear import QuantizedLinear, QuantizedWeight, pack_quantized

import tiny_checkpoints as tc

kernels = load_kernels()
pytestmark = pytest.mark.skipif(kernels is None or not hasattr(kernels, "work_pool_probe"),
                                reason="no C++ kernels")


@pytest.fixture
def two_threads():
    """Two intra-op threads, even on a machine with one core."""
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(before)


def test_a_stopped_worker_leaves_its_share_to_the_caller(two_threads):
    # 16 items, one per chunk: the worker sleeps 50 ms in the first chunk it gets, as if its core
    # were taken away; the caller runs every other chunk meanwhile. (An even split in advance, as
    # at::parallel_for makes, would leave the worker 8 items.)
    owners = kernels.work_pool_probe(16, 50_000_000)
    assert len(owners) == 16 and set(owners) <= {0, 1}
    assert sum(owners) <= 1
    # Without a stall both threads may take items; each item still runs exactly once (checked inside).
    for _ in range(20):
        assert len(kernels.work_pool_probe(64)) == 64


def test_loops_inside_a_chunk_and_single_items_run_on_the_caller(two_threads):
    assert kernels.work_pool_probe(1) == [0]


@pytest.mark.parametrize("kinds", [["Q4_K"], ["Q4_K", "Q6_K"], ["Q8_0"]])
def test_matmuls_give_the_same_bits_on_one_thread_and_two(kinds, two_threads):
    """Every row count the decode and prefill paths use: the pool only moves whole panels between threads."""
    rows = 256 * len(kinds)
    blocks = lambda k, seed: (tc.random_kquant_blocks if k.endswith("_K") else tc.random_blocks)(k, 256, 512, seed)  # noqa: E731
    parts = [QuantizedWeight(k, blocks(k, 7 + i), 256, 512) for i, k in enumerate(kinds)]
    codes, scales = pack_quantized(parts)
    layer = QuantizedLinear(codes, scales, rows, None, kernels)
    gen = torch.Generator().manual_seed(0)
    for m in (1, 3, 12, 40):
        x = torch.randn(m, 512, generator=gen)
        torch.set_num_threads(2)
        two = layer(x)
        torch.set_num_threads(1)
        one = layer(x)
        torch.set_num_threads(2)
        assert torch.equal(one, two), (kinds, m)
