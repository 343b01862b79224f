"""KV block groups: how a prompt's blocks are cut into transport frames, so pushes keep pace with chunks."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from actors.kv_connector import GROUP_BYTES, group_blocks


@given(st.integers(1, 64 << 20))
def test_a_group_is_a_power_of_two_that_fits_a_frame(block_bytes: int) -> None:
    g = group_blocks(block_bytes)
    assert g & (g - 1) == 0
    assert g * block_bytes <= GROUP_BYTES or g == 1
    assert (2 * g) * block_bytes > GROUP_BYTES  # the largest such power


@given(st.integers(1, 64 << 20), st.sampled_from([1024, 2048, 4096, 8192, 16384]))
def test_power_of_two_chunks_end_on_group_boundaries(block_bytes: int, chunk_tokens: int) -> None:
    """A chunk's blocks form whole groups (or lie inside one group): none waits for the next chunk."""
    g = group_blocks(block_bytes)
    blocks = chunk_tokens // 16
    assert blocks % g == 0 or g % blocks == 0


def test_the_scenario_case_that_lagged_a_chunk() -> None:
    """lesson-70b-fp8 at payload scale 1/1024: 1,953 real bytes per block. Groups of 536 blocks left an
    8,192-token chunk (512 blocks) without a whole group, so every push waited one chunk."""
    block_bytes = -(-16 * 125_000 // 1024)
    assert group_blocks(block_bytes) == 512
