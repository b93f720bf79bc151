"""``engine/mm_inputs.py``: M-RoPE positions, the prefix-cache key of image tokens, and the
checks of the wire form (``engine.io_struct.ImageData``)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.io_struct import ImageData, TokenizedGenerateReq
from engine.mm_inputs import PAD_BASE, build_mm_inputs, key_ids, pad_value
from engine.sampling.params import SamplingParams


def _image(offset: int, grid=(1, 4, 6), h: int = 7) -> ImageData:
    n = grid[0] * grid[1] * grid[2]
    return ImageData(pixel_values=torch.zeros(n, 3).numpy().tobytes(), pixel_shape=[n, 3],
                     grid_thw=list(grid), merge=2, content_hash=h, offset=offset,
                     length=n // 4)


def test_positions_follow_hf_rule():
    mm = build_mm_inputs([_image(2)], 10)  # 2 text, 6 image tokens (2 x 3), 2 text
    pos = mm.positions
    assert pos[:, :2].tolist() == [[0, 1]] * 3
    assert pos[0, 2:8].tolist() == [2] * 6                    # temporal: the start
    assert pos[1, 2:8].tolist() == [2, 2, 2, 3, 3, 3]        # rows
    assert pos[2, 2:8].tolist() == [2, 3, 4, 2, 3, 4]        # columns
    assert pos[:, 8:].tolist() == [[5, 6]] * 3               # start + max(2, 3)
    assert mm.delta == 7 - 10


def test_key_ids_name_images_by_content():
    def items(h):
        return build_mm_inputs([_image(1, h=h)], 9).items

    ids = [5] * 9
    ka, kb = key_ids(ids, items(11)), key_ids(ids, items(12))
    assert ka[0] == kb[0] == 5 and ka[7:] == kb[7:]
    assert ka[1:7] == [pad_value(11)] * 6 and ka[1] != kb[1] and ka[1] >= PAD_BASE
    assert key_ids(ids, items(11)) == ka


@pytest.mark.parametrize("bad", [
    dict(pixel_shape=[24, 4]),            # bytes for another shape
    dict(grid_thw=[1, 4, 5]),             # patches != grid
    dict(length=5),                       # not the merged grid's tokens
    dict(offset=6),                       # past the prompt's end
])
def test_bad_wire_images_are_refused(bad):
    im = msgspec.structs.replace(_image(1), **bad)
    with pytest.raises(ValueError):
        build_mm_inputs([im], 10)


def test_images_cross_the_wire():
    msg = TokenizedGenerateReq(rid="r", input_ids=[1, 2], sampling_params=SamplingParams(),
                               images=[_image(0)])
    back = msgspec.msgpack.decode(msgspec.msgpack.encode(msg), type=TokenizedGenerateReq)
    assert back.images == msg.images
