"""ONNX Runtime's usual errors, said as what they mean for the user's model
(:func:`normexport.runtime.message`), each raised by a real session."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

from normexport import runtime


def _model(node, x_type=TensorProto.FLOAT, shape=(1, 3), inits=()) -> bytes:
    graph = helper.make_graph(
        [node],
        "g",
        [helper.make_tensor_value_info("x", x_type, list(shape))],
        [helper.make_tensor_value_info("y", x_type, None)],
        list(inits),
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return model.SerializeToString()


RELU = helper.make_node("Relu", ["x"], ["y"])


#: Inputs of a Relu model of x (1, 3) float32, and what ONNX Runtime's refusal means.
WRONG = [
    ((2, 3), np.float32, "input x: axis 0 is 2 here, but the model fixes it at 1"),
    ((1, 3, 1), np.float32, "input x has 3 axes here, but the model takes 2"),
    ((1, 3), np.float64, "an input is tensor(double) here, but the model takes tensor(float)"),
]


@pytest.mark.parametrize(("shape", "dtype", "meaning"), WRONG)
def test_a_run_on_the_wrong_inputs_is_said_in_words(shape, dtype, meaning):
    session = ort.InferenceSession(_model(RELU), providers=["CPUExecutionProvider"])
    with pytest.raises(Exception) as caught:
        session.run(None, {"x": np.zeros(shape, dtype)})
    assert "[ONNXRuntimeError]" in str(caught.value)  # what ORT says
    assert runtime.message(caught.value) == meaning


def test_a_missing_kernel_is_said_in_words():
    w = helper.make_tensor("w", TensorProto.DOUBLE, [1, 1, 1, 1], [1.0])
    conv = helper.make_node("Conv", ["x", "w"], ["y"], name="conv1")
    with pytest.raises(Exception) as caught:
        ort.InferenceSession(
            _model(conv, TensorProto.DOUBLE, (1, 1, 3, 3), [w]), providers=["CPUExecutionProvider"]
        )
    assert runtime.message(caught.value) == (
        "ONNX Runtime has no kernel for Conv (opset 11) with these input types on this provider "
        "(node 'conv1')"
    )
