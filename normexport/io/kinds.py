""":func:`detect_kind`: what kind of model file a path holds, from its contents, read without
PyTorch or ONNX Runtime (the CLI asks it before importing them: a wrong file answers in a
second)."""

from __future__ import annotations

import functools
import zipfile
from pathlib import Path
from typing import TYPE_CHECKING

from normexport.errors import InputFileError, one_line

if TYPE_CHECKING:
    import onnx


def detect_kind(path: Path) -> str:
    """The kind of model file at ``path`` (see :mod:`normexport.io.load`), from its contents;
    where they are not what its extension says (:data:`EXTENSIONS`), the error says so.

    Raises:
        InputFileError: the file is missing, or is none of the known kinds.
    """
    if path.is_dir():
        raise InputFileError(f"{path} is a folder, not a model file: give the model file in it")
    if not path.exists():
        raise InputFileError(f"{path}: no such file")
    if not path.is_file():
        raise InputFileError(f"{path} is not a regular file (a device, a pipe?): give a model file")
    stat = path.stat()
    if stat.st_size == 0:
        raise InputFileError(f"{path} is empty (0 bytes): was it written completely?")
    return _kind(path.resolve(), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _kind(path: Path, size: int, mtime_ns: int) -> str:
    """:func:`detect_kind` of a regular, non-empty file, once per file as it is (its size and
    modification time in the key): the CLI asks before the pipeline, the pipeline's load again,
    and an ONNX protobuf is parsed whole to tell (exceptions are not cached)."""
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as archive:
            names = archive.namelist()
        if any(n.endswith("/archive_format") for n in names):
            return "exported_program"
        if any("/code/" in n for n in names) and any(n.endswith("constants.pkl") for n in names):
            return "torchscript"
        if any(n.endswith("data.pkl") for n in names):
            return "torch_save"
        raise InputFileError(f"{path}: a zip archive that is not a PyTorch or ONNX model file")
    with path.open("rb") as f:
        head = f.read(2)
    if head[:1] == b"\x80":  # a pickle protocol marker: legacy (non-zip) torch.save
        return "torch_save"
    proto, problem = _onnx(path)
    if proto is not None and proto.graph.node:
        return "onnx"
    if proto is not None and proto.HasField("graph") and proto.opset_import:
        raise InputFileError(
            f"{path}: an ONNX model with no nodes (graph {proto.graph.name!r} computes "
            "nothing): nothing to optimize; export the model again"
        )
    raise InputFileError(_not_a_model(path, problem))


#: What a file of each extension should be, for the message when its contents are not.
EXTENSIONS = {
    ".onnx": "an ONNX model",
    ".pt2": "a torch.export archive (a zip file)",
    ".pt": "a torch.save file (a zip file or a pickle)",
    ".pth": "a torch.save file (a zip file or a pickle)",
    ".bin": "a torch.save file (a zip file or a pickle)",
}


def _onnx(path: Path) -> tuple[onnx.ModelProto | None, str | None]:
    """The file as an ONNX protobuf (its external data not read), or None and why not."""
    import onnx  # here: a missing file or a bad option is answered without onnx (0.7 s)

    try:
        return onnx.load_model(str(path), load_external_data=False), None
    except Exception as err:  # protobuf raises DecodeError or RuntimeError; any means "not ONNX"
        return None, one_line(err)


def _not_a_model(path: Path, problem: str | None) -> str:
    """The message for a file that is no model normexport reads: named for what its extension
    promised, with the parse error where it was to be ONNX."""
    promised = EXTENSIONS.get(path.suffix.lower())
    if path.suffix.lower() == ".onnx":
        return (
            f"{path}: not an ONNX model: it does not parse as an ONNX protobuf ({problem}); "
            "is it the file the exporter wrote, complete?"
        )
    if promised is not None:
        return (
            f"{path}: not {promised}, as its extension says, nor any other model file "
            "normexport reads: is it the file that was saved, complete?"
        )
    return (
        f"{path}: not a model file normexport can read (expected a torch.save'd nn.Module or "
        "state_dict, a TorchScript archive, a torch.export .pt2 program, or an .onnx model)"
    )
