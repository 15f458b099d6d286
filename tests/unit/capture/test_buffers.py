"""A trace's large arrays come from a pool that the next trace reuses once nothing refers to them (issue #35,
item 1: a trace in a loop no longer has the system fault in and zero its whole Dataset again). What must hold: two
live arrays never share memory, a view keeps its memory out of the pool, the pool stays within its bound, and a
trace written into reused memory equals one written into fresh memory bitwise."""

from __future__ import annotations

import gc

import numpy as np
import pytest
import timm
import torch

import vitcam_nb as vc
from vitcam_nb.capture import buffers

pytestmark = pytest.mark.skipif(not buffers._USABLE, reason="no anonymous private mappings on this platform")
BIG = (9 << 20,)  # 36 MiB of float32, above MIN_BYTES


@pytest.fixture(autouse=True)
def empty_pool():
    buffers.release_free_buffers()
    yield
    gc.collect()
    buffers.release_free_buffers()


def test_the_memory_of_an_array_nothing_refers_to_goes_to_the_next_one_of_its_size():
    a = buffers.reusable_empty(BIG, np.float32)
    address = a.ctypes.data
    del a
    assert buffers.free_bytes() == BIG[0] * 4
    b = buffers.reusable_empty(BIG, np.float32)
    assert b.ctypes.data == address and buffers.free_bytes() == 0
    b[:] = 7  # the reused memory is the new array's own: writable, C-contiguous, its shape
    assert b.flags.c_contiguous and b.flags.writeable and b.shape == BIG and b.dtype == np.float32
    c = buffers.reusable_empty((3, 3 << 20), np.float32)  # 36 MiB too, but b is alive: fresh memory
    assert not np.shares_memory(b, c)
    c[:] = 1
    assert (b == 7).all()


def test_a_view_keeps_its_memory_out_of_the_pool():
    a = buffers.reusable_empty(BIG, np.float32)
    a[:] = np.arange(BIG[0], dtype=np.float32)
    view = a[::1000]
    del a
    gc.collect()
    assert buffers.free_bytes() == 0
    b = buffers.reusable_empty(BIG, np.float32)
    b[:] = -1
    assert not np.shares_memory(view, b)
    np.testing.assert_array_equal(view, np.arange(0, BIG[0], 1000, dtype=np.float32))
    del view, b
    assert buffers.free_bytes() == 2 * BIG[0] * 4


def test_a_buffer_is_reused_only_for_an_array_of_at_least_half_its_size():
    a = buffers.reusable_empty((40 << 20,), np.float32)  # 160 MiB
    del a
    small = buffers.reusable_empty(BIG, np.float32)  # 36 MiB: less than half, fresh memory
    assert buffers.free_bytes() == (40 << 20) * 4
    big = buffers.reusable_empty((20 << 20,), np.float32)  # 80 MiB: exactly half, reused
    assert buffers.free_bytes() == 0
    assert not np.shares_memory(small, big)


def test_the_pool_keeps_at_most_its_share_of_the_machine_and_the_oldest_goes_first(monkeypatch):
    room = 2.5 * BIG[0] * 4  # a machine whose KEEP_FREE_FRACTION is room for two and a half of these buffers
    monkeypatch.setattr(buffers, "_physical_bytes", lambda: int(room / buffers.KEEP_FREE_FRACTION))
    arrays = [buffers.reusable_empty(BIG, np.float32) for _ in range(4)]
    maps = [a.base.base.obj for a in arrays]  # array -> flat array -> memoryview -> the mapping
    while arrays:
        del arrays[0]  # freed in order, oldest first
    assert buffers.free_bytes() == 2 * BIG[0] * 4
    assert [id(b) for b in buffers._FREE] == [id(b) for b in maps[2:]]
    assert maps[0].closed and maps[1].closed and not maps[2].closed


def test_small_arrays_are_plain_numpy_arrays():
    a = buffers.reusable_empty((4, 5), np.float16)
    assert a.base is None and a.shape == (4, 5) and a.dtype == np.float16
    del a
    assert buffers.free_bytes() == 0


def test_a_trace_into_reused_memory_equals_one_into_fresh_memory(monkeypatch):
    monkeypatch.setattr(buffers, "MIN_BYTES", 0)  # the tiny model's arrays come from the pool too
    torch.manual_seed(0)
    model = timm.create_model("vit_tiny_patch16_224", pretrained=False, img_size=32, patch_size=8, depth=2,
                              num_classes=10).eval()
    image = np.random.default_rng(0).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    first = vc.trace(model, image, "top3")
    want = {name: first[name].values.copy() for name in ("act", "grad", "attn", "attn_grad")}
    addresses = {first[name].values.ctypes.data for name in want}
    del first
    gc.collect()
    assert buffers.free_bytes() > 0
    second = vc.trace(model, image, "top3")
    assert {second[name].values.ctypes.data for name in want} & addresses  # it did reuse the first's memory
    for name, values in want.items():
        np.testing.assert_array_equal(second[name].values, values, err_msg=name)
