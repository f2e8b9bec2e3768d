"""fusion.fuse_gqa.standard: which masks ONNX's Attention takes, and the facts about ONNX
Runtime's CPU kernel of Attention (opset 23) that the choice rests on, checked on the
installed version."""

import numpy as np
import pytest
from onnx import TensorProto

from fusion.fuse_gqa import standard
from tests.support.graphs import make_model, run

LOWEST = np.finfo(np.float32).min
BATCH, HEADS, KV_HEADS, LENGTH, PAST, SIZE = 2, 4, 2, 3, 5, 8
TOTAL = PAST + LENGTH


def _mask_of(values, producer="Where"):
    """The output of ``producer`` over a boolean and two constants ``values``."""
    consts = {f"v{i}": np.array(v, np.float32) for i, v in enumerate(values)}
    model = make_model(
        [(producer, ["c", *consts] if producer == "Where" else list(consts), ["mask"], {})],
        {"c": (TensorProto.BOOL, [1, 1, LENGTH, TOTAL])},
        {"mask": (TensorProto.FLOAT, None)},
        consts,
    )
    return model.graph.outputs[0]


@pytest.mark.parametrize(
    "values, nan_guard, how",
    [
        ((0.0, LOWEST), False, "raised"),  # transformers' finfo.min
        ((LOWEST, 0.0), True, "raised"),
        ((0.0, -1e9), False, "as is"),
        ((0.0, -np.inf), True, "as is"),  # the model maps its NaN rows to 0, as the kernel
        ((0.0, -np.inf), False, None),  # the model's rows all masked are NaN, the kernel's 0
        ((-np.inf, -np.inf), True, None),
        ((0.0, np.nan), True, None),
    ],
)
def test_the_masks_attention_takes(values, nan_guard, how):
    assert standard.bias(_mask_of(values), nan_guard) == how


def test_a_mask_of_another_form_and_no_mask():
    assert standard.bias(_mask_of((0.0, LOWEST), "Add"), True) is None
    assert standard.bias(None, False) == "as is"


def _attention(mask: np.ndarray, rng) -> tuple[np.ndarray, np.ndarray]:
    """ONNX Runtime's Attention (opset 23) and numpy's softmax attention over a past, with
    ``mask`` ``(B, 1, S, T)`` added to the scores; a batch of chunks after a past."""
    shapes = {
        "q": (BATCH, LENGTH, HEADS * SIZE),
        "k": (BATCH, LENGTH, KV_HEADS * SIZE),
        "v": (BATCH, LENGTH, KV_HEADS * SIZE),
        "mask": mask.shape,
        "past_k": (BATCH, KV_HEADS, PAST, SIZE),
        "past_v": (BATCH, KV_HEADS, PAST, SIZE),
    }
    feeds = {n: rng.standard_normal(s).astype(np.float32) for n, s in shapes.items()}
    feeds["mask"] = mask
    heads = {"q_num_heads": HEADS, "kv_num_heads": KV_HEADS}
    model = make_model(
        [("Attention", list(shapes), ["y", "present_k", "present_v"], heads)],
        {n: (TensorProto.FLOAT, s) for n, s in shapes.items()},
        {n: (TensorProto.FLOAT, None) for n in ("y", "present_k", "present_v")},
        opset=standard.OPSET,
    )
    (got, _, _) = run(model, feeds)

    def split(x, n):  # (B, L, n*H) -> (B, n, L, H)
        return x.reshape(BATCH, -1, n, SIZE).transpose(0, 2, 1, 3)

    keys = np.concatenate([feeds["past_k"], split(feeds["k"], KV_HEADS)], 2)
    values = np.concatenate([feeds["past_v"], split(feeds["v"], KV_HEADS)], 2)
    keys, values = (np.repeat(t, HEADS // KV_HEADS, 1) for t in (keys, values))
    scores = split(feeds["q"], HEADS) @ keys.transpose(0, 1, 3, 2) / np.sqrt(SIZE) + mask
    weights = np.exp(scores - scores.max(-1, keepdims=True))
    weights /= weights.sum(-1, keepdims=True)
    expected = (weights @ values).transpose(0, 2, 1, 3).reshape(BATCH, LENGTH, HEADS * SIZE)
    return got, expected


def test_the_kernel_computes_rows_masked_everywhere_as_the_docs_say():
    rng = np.random.default_rng(0)
    mask = np.where(rng.random((BATCH, 1, LENGTH, TOTAL)) < 0.3, LOWEST, 0).astype(np.float32)
    mask[:, :, :, 0] = 0  # every row keeps a key
    got, expected = _attention(mask, rng)
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for masked, zero in ((-np.inf, True), (LOWEST, True), (standard.ABOVE_LOWEST, False)):
        mask[1, 0, 2, :] = masked
        with np.errstate(invalid="ignore"):
            got, expected = _attention(mask, rng)
        row = got[1, 2]
        if zero:  # the dynamo export's guard gives 0 for -inf; transformers' finfo.min: the mean
            np.testing.assert_array_equal(row, 0)
        else:  # every score plus the mask rounds to the mask: the mean of the values
            np.testing.assert_allclose(row, expected[1, 2], rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(got[0], expected[0], rtol=1e-5, atol=1e-6)
