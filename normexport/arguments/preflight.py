"""What is checked before any work, and before PyTorch or the pipeline is imported: the
options' values, the paths the run writes, and that the model file is a model
(:func:`preflight`). A mistake answers in about a second, not after the imports (seconds) and
the export (minutes)."""

from __future__ import annotations

from pathlib import Path

from normexport.arguments.options import Options, check_options
from normexport.errors import UsageError
from normexport.io import files
from normexport.io.kinds import detect_kind


def preflight(opts: Options, *, writes: bool = True) -> None:
    """Check ``opts`` (:func:`~normexport.arguments.options.check_options`), where ``writes``
    the paths the run writes (:func:`plan_outputs`), and the model file's kind
    (:func:`normexport.io.kinds.detect_kind`).

    Raises:
        UsageError: a bad option value or output path; InputFileError: no model file.
    """
    check_options(opts)
    if writes:
        plan_outputs(opts)
    if opts.module is None:
        detect_kind(Path(opts.model))


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
