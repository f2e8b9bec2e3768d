"""What is checked before any work, and before PyTorch or the pipeline is imported: the
options' values, the paths the run writes, that the model file is a model, and that one ONNX
Runtime package is installed (:func:`preflight`). A mistake answers in a fraction of a second,
not after the imports (seconds) and the export (minutes)."""

from __future__ import annotations

import importlib.metadata
import sys
from pathlib import Path

from normexport.arguments.options import Options, check_options
from normexport.errors import EnvironmentProblem, UsageError
from normexport.io import files
from normexport.io.kinds import detect_kind


def preflight(opts: Options, *, writes: bool = True) -> list[str]:
    """Check ``opts`` (:func:`~normexport.arguments.options.check_options`), where ``writes``
    the paths the run writes (:func:`plan_outputs`), the model file's kind
    (:func:`normexport.io.kinds.detect_kind`) and the ONNX Runtime packages
    (:func:`check_onnxruntime`).

    Returns:
        The warnings to show before the run, one line each.

    Raises:
        UsageError: a bad option value or output path; InputFileError: no model file;
            EnvironmentProblem: see :func:`check_onnxruntime`.
    """
    check_options(opts)
    if writes:
        plan_outputs(opts)
    if opts.module is None:
        detect_kind(Path(opts.model))
    conflict = check_onnxruntime()
    return [conflict] if conflict else []


#: The distributions on PyPI that install the ``onnxruntime`` import package; the first two are
#: normexport's extras (``normexport[cpu]``, ``normexport[gpu]``: pyproject.toml).
ONNXRUNTIME_DISTRIBUTIONS = (
    "onnxruntime",
    "onnxruntime-gpu",
    "onnxruntime-directml",
    "onnxruntime-openvino",
    "onnxruntime-qnn",
    "onnxruntime-rocm",
    "onnxruntime-migraphx",
    "onnxruntime-training",
    "ort-nightly",
    "ort-nightly-gpu",
)


#: How to install ONNX Runtime with normexport, per machine (README: Install).
INSTALL_LINE = (
    "pip install 'normexport[cpu]' (onnxruntime: any machine, macOS and Linux aarch64 "
    "included) or 'normexport[gpu]' (onnxruntime-gpu: the CUDA provider, Linux or Windows x86-64)"
)


def check_onnxruntime() -> str | None:
    """That one ONNX Runtime distribution is installed. Where two are (say
    ``onnxruntime`` beside ``onnxruntime-gpu``; ONNX Runtime's install guide: install one), the
    warning line that says so with the fix; None where there is one. They write the same
    package folder, so the one installed last overwrote the other's files: ``onnxruntime``
    installed after ``onnxruntime-gpu`` leaves no CUDA provider, and uninstalling either one
    removes files the other needs. Reads the installed distributions' metadata (milliseconds);
    ONNX Runtime is imported only where two are found.

    Returns:
        the warning where two are installed, else None.

    Raises:
        EnvironmentProblem: none is installed (the message gives :data:`INSTALL_LINE`), or two
            are and ``import onnxruntime`` fails or gives no ``InferenceSession`` (a package
            left half removed).
    """
    found = []
    for name in ONNXRUNTIME_DISTRIBUTIONS:
        try:
            found.append(f"{name} {importlib.metadata.version(name)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    if not found:
        raise EnvironmentProblem(
            f"ONNX Runtime is not installed in this environment ({sys.executable}): {INSTALL_LINE}"
        )
    if len(found) < 2:
        return None
    names = " ".join(entry.split()[0] for entry in found)
    line = (
        f"{' and '.join(found)} are installed in one environment: they overwrite each other's "
        f"files (ONNX Runtime's install guide: keep one); fix: pip uninstall -y {names} && "
        "pip install onnxruntime (CPU) or onnxruntime-gpu (CUDA)"
    )
    try:
        import onnxruntime

        onnxruntime.InferenceSession  # noqa: B018 - a package left half removed has none
    except (ImportError, AttributeError) as err:
        raise EnvironmentProblem(f"{line} (now `import onnxruntime` fails: {err})") from err
    return line


def plan_outputs(opts: Options) -> tuple[Path, dict[str, list[Path]]]:
    """The output path, and every file the run writes by the option that names it, checked
    before any work: each writable, none on the input, none written twice.

    Raises:
        UsageError: see :func:`normexport.io.files.check_writable` and
            :func:`normexport.io.files.refuse_overwriting`.
    """
    if opts.output is None and opts.module is not None:
        raise UsageError("an in-memory module has no file to write beside: give output=PATH")
    output = Path(opts.output) if opts.output else files.default_output(Path(opts.model))
    writes = {"-o": [output, files.data_path(output)]}
    if opts.report is not None:
        writes["--report"] = [Path(opts.report), Path(opts.report).with_suffix(".png")]
    for flag, paths in writes.items():
        for path in paths:
            given = flag != "-o" or opts.output is not None
            files.check_writable(path, flag, given=given, make_dirs=opts.make_dirs)
    if opts.module is None:
        files.refuse_overwriting([Path(opts.model)], writes)  # before the export (minutes)
    return output, writes
