"""The graph helpers of the fusion passes that a caller may use too, on onnx_ir models: the
public face of the passes' private machinery (the modules whose names start with ``_``, which
no code outside :mod:`fusion` imports).

- :func:`opset_version`: the model's opset version for a domain;
- :func:`const_array`: the constant behind a value (an initializer or a Constant node's output);
- :func:`label`: the name a report gives a node (its name, else its first output's, else its
  op type): what :attr:`fusion.Fused.node` and :attr:`fusion.Refused.node` hold;
- :func:`replace_output`: point every reader of a value at another (a graph output keeps its
  name);
- :func:`remove_nodes`: remove nodes and the constants only they read;
- :class:`KnownShapes`: the static shapes of a model's values, from what the values carry,
  else ONNX's shape inference, else ONNX Runtime's symbolic one (:func:`symbolic_shapes`);
- :func:`symbolic_shapes`: the shapes ONNX Runtime's symbolic shape inference gives.

Each is documented where it is defined.
"""

from __future__ import annotations

from fusion._ir import KnownShapes, const_array, label, opset_version, remove_nodes, replace_output
from fusion._symbolic import symbolic_shapes

__all__ = [
    "KnownShapes",
    "const_array",
    "label",
    "opset_version",
    "remove_nodes",
    "replace_output",
    "symbolic_shapes",
]
