"""What is particular to the Pallas backend: its tile and split heuristics and its
configuration checks. The kernels themselves run the shared suite of ``test_kernels.py``
(interpret mode on the CPU, compiled on a GPU)."""

from __future__ import annotations

import pytest
from helpers import call_extend, make_extend

from jaxattn import pallas as P


def test_extend_tile_heuristic():
    cfg = P.extend._default_config
    long = cfg(128, 2, 4, tokens_per_request=512.0)
    assert (long.block_q, long.block_n, long.heads_per_tile, long.num_warps) == (256, 64, 2, 8)
    short = cfg(128, 2, 4, tokens_per_request=24.0)
    assert (short.block_q, short.heads_per_tile) == (128, None)
    assert P.extend._pick_heads_per_tile(short, 4) == 4  # 32 tokens x 4 heads
    assert cfg(128, 2, 1, tokens_per_request=512.0).block_n == 128  # MHA: unpacked
    assert cfg(128, 4, 4, tokens_per_request=512.0).num_stages == 2  # float32


def test_decode_partition_heuristic():
    cfg = P.DecodeConfig(min_programs=264)
    common = dict(num_kv_heads=8, max_context=4096, partition_size=None, config=cfg)
    assert P.choose_partition_size(batch=64, group=4, **common) == 512
    assert P.choose_partition_size(batch=64, group=16, **common) == 256
    assert P.choose_partition_size(batch=64, group=4, **{**common, "partition_size": 96}) == 96
    # One sequence of 32768: 8 KV heads x 64 partitions of 512 = 512 programs, enough.
    long_ctx = {**common, "max_context": 32768}
    assert P.choose_partition_size(batch=1, group=4, **long_ctx) == 512
    # One sequence of 4096: 64 programs of 512 are too few for 264; split down to the
    # smallest partition (128 tokens, 256 programs).
    assert P.choose_partition_size(batch=1, group=4, **common) == 128
    assert P.choose_partition_size(batch=4, group=4, **common) == 256


def test_extend_rejects_bad_heads_per_tile(rng):
    c = make_extend(rng, [4], [4], num_q_heads=8, num_kv_heads=2, head_dim=32)
    with pytest.raises(ValueError, match="heads_per_tile"):
        call_extend(
            P.extend_attention,
            c,
            scale=0.2,
            interpret=True,
            config=P.ExtendConfig(heads_per_tile=3),
        )


def test_config_checks():
    with pytest.raises(ValueError, match="block_n"):
        P.DecodeConfig(block_n=24)
    with pytest.raises(ValueError, match="block_q"):
        P.ExtendConfig(block_q=48)
