"""``engine/mm_inputs.py``: M-RoPE positions, the prefix-cache key of image tokens, and the
checks of the wire form (``engine.io_struct.ImageData``)."""

from __future__ import annotations

import msgspec
import pytest
import torch

from engine.io_struct import ImageData, TokenizedGenerateReq
from engine.mm_inputs import PAD_BASE, build_mm_inputs, key_ids, key_limits, pad_value
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


def test_bidirectional_images_are_cut_whole():
    """A chunk ``[start, end)`` of a bidirectional request never ends inside an image: it
    ends before it, or (starting at or inside it) runs to its end; a causal request's
    chunks are not moved."""
    mm = build_mm_inputs([_image(3), _image(12)], 20)      # images [3, 9) and [12, 18)
    assert mm.image_cut(0, 5) == 5                          # not bidirectional
    mm.bidirectional = True
    assert [mm.image_cut(0, e) for e in (3, 5, 9, 10, 13)] == [3, 3, 9, 10, 12]
    assert mm.image_cut(3, 5) == 9 and mm.image_cut(5, 7) == 9   # from its start / inside
    assert mm.image_cut(9, 14) == 12 and mm.image_cut(12, 13) == 18


def test_key_limits_open_each_image_span():
    """Per extend row: i + 1 (causal), the image's end within the step for its tokens;
    None without a bidirectional image in the step."""
    mm = build_mm_inputs([_image(3)], 12)                   # image [3, 9)
    assert key_limits([(mm, 0, 12, 0)], [0], [12]) is None
    mm.bidirectional = True
    # a text request of 4 rows first, then this one from prefix 2 (rows 4..13)
    lim = key_limits([(mm, 2, 10, 4)], [0, 4], [4, 10])
    assert lim[:4] == [1, 2, 3, 4]
    assert lim[4:] == [1, 7, 7, 7, 7, 7, 7, 8, 9, 10]
    # a cached prefix that ends inside the image: its rest opens to the image's end
    assert key_limits([(mm, 5, 7, 0)], [0], [7]) == [4, 4, 4, 4, 5, 6, 7]
