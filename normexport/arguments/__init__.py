"""The main job's options, and the command-line flags that fill them, in one place.

:class:`Options` is what :func:`normexport.pipeline.run` (and :func:`normexport.optimize`)
take, typed: shapes as :class:`~normexport.io.specs.InputSpec`, ``--dim`` a mapping,
``--dynamic`` parsed (:class:`DynamicAxes`), constructor arguments a dict, paths
:class:`~pathlib.Path`. :func:`make_options` builds it from what a user typed or passed, and is
where every such value is parsed and refused; nothing downstream parses a user's string. Each
field declares its flag (:class:`Flag`: group, help, argparse keywords), so that the flags are
made from the fields (:func:`add_flags`): a flag's ``dest`` is the name of the field it fills
(the API's keyword of the same name), and its default is that field's default (a command may
give ``--budget`` its own), so :func:`options_from_args` is :func:`make_options` of the parsed
flags. The groups of flags are shared: the main command adds them all, ``explain`` the model,
provider and threads groups, ``bench`` the model, provider, timing and make_dirs groups and flags
of its own (:mod:`normexport.bench.command`). This module imports no PyTorch or ONNX Runtime
package.
"""

from __future__ import annotations

from normexport.arguments.flags import add_flags, add_model_arguments, options_from_args
from normexport.arguments.options import (
    DynamicAxes,
    Flag,
    Options,
    check_options,
    make_options,
    parse_dynamic,
)
from normexport.arguments.preflight import check_onnxruntime, plan_outputs, preflight

__all__ = [
    "DynamicAxes",
    "Flag",
    "Options",
    "add_flags",
    "add_model_arguments",
    "check_options",
    "make_options",
    "options_from_args",
    "parse_dynamic",
    "plan_outputs",
    "check_onnxruntime",
    "preflight",
]
