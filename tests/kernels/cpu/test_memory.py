"""kernels/cpu/memory.py: the weights' buffers on 2 MiB pages."""

import torch

from kernels.cpu.memory import HUGE_PAGE, empty_on_huge_pages, on_huge_pages


def test_large_buffers_start_on_a_huge_page_boundary_and_keep_their_values():
    t = torch.randint(-128, 128, (3, 5, HUGE_PAGE // 7), dtype=torch.int8)
    h = on_huge_pages(t)
    assert h.data_ptr() % HUGE_PAGE == 0 and h.is_contiguous() and h.dtype == t.dtype and h.shape == t.shape
    assert torch.equal(h, t) and h.data_ptr() != t.data_ptr()
    want = t.to(torch.int16) + 1
    del t
    h += 1  # the mapping outlives the call that made it: written and read back after it returned
    assert torch.equal(h.to(torch.int16), torch.where(want == 128, -128, want))
    e = empty_on_huge_pages((HUGE_PAGE // 4 + 3,), torch.float32)
    e.fill_(2.5)
    assert e.data_ptr() % HUGE_PAGE == 0 and float(e.sum()) == 2.5 * e.numel()


def test_small_buffers_stay_where_they_are():
    t = torch.arange(1000, dtype=torch.float32)
    assert on_huge_pages(t) is t
    assert empty_on_huge_pages((10, 10), torch.float32).shape == (10, 10)


def test_a_native_steps_layer_tiles_and_their_tails_move_to_huge_pages():
    from kernels.cpu import TILES_Q4, TILES_Q8G6, LayerTiles, tiles_on_huge_pages

    tail = LayerTiles(torch.randint(0, 256, (2, 8, 608), dtype=torch.uint8), (32, 256), TILES_Q8G6)
    big = LayerTiles(torch.randint(0, 256, (HUGE_PAGE // 320 // 8 + 1, 8, 320), dtype=torch.uint8), (0, 256),
                     TILES_Q4, tail)
    moved = tiles_on_huge_pages(big)
    assert moved.blocks.data_ptr() % HUGE_PAGE == 0 and torch.equal(moved.blocks, big.blocks)
    assert moved.tail is not None and moved.tail.blocks is tail.blocks  # (small: where it was)
    assert tiles_on_huge_pages(moved).blocks is moved.blocks  # (placed already: not copied again)
    assert (moved.shape, moved.format, moved.tail.format) == (big.shape, TILES_Q4, TILES_Q8G6)
