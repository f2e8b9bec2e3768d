"""Writing output files: atomically, with the user's normal file mode, models with their own
external data.

A reader never sees a half-written model or report, an output never points at its input's
external data, and no whole model is ever turned into one protobuf (2 GiB is protobuf's limit,
and users' models are bigger).
"""

from __future__ import annotations

import contextlib
import glob
import hashlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import onnx_ir as ir

from normexport.errors import OutputPathError, UsageError

#: Above this many bytes of tensors a model is written with external data even when its input
#: had none: protobuf cannot serialize a message over 2 GiB, and the graph, its Constant nodes
#: and their attributes count too, so the line is drawn well below that.
EXTERNAL_DATA_THRESHOLD_BYTES = 1 << 30

#: Tensors smaller than this stay in the .onnx file itself when writing external data.
_INLINE_BYTES = 1024
#: The longest external data file name written: onnx-ir writes the data into a temporary
#: folder named ``.NAME.`` + 8 random characters beside it first, and file systems take names
#: of at most 255 bytes (ext4, XFS, btrfs, APFS).
DATA_NAME_MAX_BYTES = 255 - 10


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def default_mode() -> int:
    """The mode a new file gets from ``open()`` under the process's umask (``0o666 & ~umask``):
    what the user expects of an output, where ``mkstemp`` would give 0600."""
    return 0o666 & ~_umask()


def _temp_prefix(path: Path) -> str:
    """A hidden temp-name prefix for ``path`` that stays under 255 bytes whatever its name."""
    return f".{path.name.encode()[:80].decode(errors='ignore')}."


def _writable_folder(path: Path) -> Path:
    """``path``'s folder, created if needed.

    Raises:
        OutputPathError: it cannot be made or is not a folder.
    """
    folder = path.parent
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise OutputPathError(f"cannot create the folder for {path}: {err.strerror}") from None
    return folder


def _short(name: str, keep: int = 40) -> str:
    return name if len(name) <= keep + 3 else f"{name[:keep]}..."


def check_writable(path: Path, flag: str, given: bool = True, make_dirs: bool = False) -> None:
    """Refuse, before any work is done, an output path that cannot be written: a folder, a
    name longer than the file system allows, a folder that is a file or cannot be written
    (tried by creating and removing a hidden file in it), and, unless ``make_dirs``, a folder
    that does not exist (a typo would otherwise make folders).

    Args:
        path: the file to be written.
        flag: the option that names it (``-o``, ``--report``), for the message.
        given: whether the user gave ``flag``; else ``path`` is its default, named so.
        make_dirs: the missing folders of ``path`` may be made (``--make-dirs``).

    Raises:
        OutputPathError: naming ``flag``, the path and the fix.
    """
    path = Path(path)
    ancestor = path.parent
    while not os.path.exists(ancestor) and ancestor != ancestor.parent:  # False on any OSError
        ancestor = ancestor.parent
    try:
        limit = os.pathconf(ancestor, "PC_NAME_MAX")
    except (OSError, ValueError):
        limit = 255
    for name in path.relative_to(ancestor).parts:  # the names still to be made
        if len(name.encode()) > limit:
            what = "file name" if name == path.name else f"folder name {_short(name)!r}"
            whose = flag if given else f"the default of {flag},"
            raise OutputPathError(
                f"{whose} {_short(str(path))}: the {what} is {len(name.encode())} bytes, and "
                f"this file system allows {limit}: choose a shorter name with {flag}"
            )
    if os.path.isdir(path):
        raise OutputPathError(
            f"{flag} {path} is a folder: give a file name, e.g. {path / 'model.opt.onnx'}"
        )
    if not ancestor.is_dir():
        raise OutputPathError(f"{flag} {path}: {ancestor} is a file, not a folder")
    if ancestor != path.parent and not make_dirs:
        raise OutputPathError(
            f"{flag} {path}: the folder {path.parent} does not exist: create it (mkdir -p "
            f"{path.parent}), or pass --make-dirs"
        )
    try:  # a real write: permissions, read-only mounts, and root on /sys all tell the truth
        fd, probe = tempfile.mkstemp(dir=ancestor, prefix=".normexport-probe-")
    except OSError as err:
        raise OutputPathError(
            f"{flag} {path}: cannot write in the folder {ancestor} ({err.strerror}): choose a "
            "folder you can write to"
        ) from None
    os.close(fd)
    os.unlink(probe)


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; when the block succeeds, rename it onto
    ``path`` (``os.replace``, atomic on POSIX) with mode :func:`default_mode`. On an error the
    temporary file is removed and ``path`` is untouched. Creates the folder if needed.

    Raises:
        OutputPathError: the folder cannot be created or written to.
    """
    path = Path(path)
    folder = _writable_folder(path)
    try:
        fd, tmp = tempfile.mkstemp(dir=folder, prefix=_temp_prefix(path), suffix=".tmp")
    except OSError as err:
        raise OutputPathError(f"cannot write {path}: {err.strerror}") from None
    os.close(fd)
    try:
        yield Path(tmp)
        os.chmod(tmp, default_mode())
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


@contextlib.contextmanager
def work_folder(near: Path) -> Iterator[Path]:
    """A hidden scratch folder beside ``near`` (same file system, so its files can be renamed
    into place), removed with everything in it when the block ends.

    Intermediate models (the raw export, autotune's candidates, the output before it is
    published) live here rather than in the system temp folder, which may be small or in RAM.

    Raises:
        OutputPathError: the folder cannot be created.
    """
    folder = _writable_folder(Path(near))
    _remove_stale(folder, _temp_prefix(Path(near)))
    try:
        work = Path(tempfile.mkdtemp(dir=folder, prefix=_temp_prefix(Path(near)), suffix=".work"))
        (work / OWNER).write_text(_owner(os.getpid()) or "")
    except OSError as err:
        raise OutputPathError(f"cannot write in {folder}: {err.strerror}") from None
    try:
        yield work
    finally:
        shutil.rmtree(work, ignore_errors=True)


#: The file in a work folder that names the process it belongs to: its PID and start time
#: (``/proc/PID/stat`` field 22, clock ticks since boot), so that a reused PID is told apart.
OWNER = "owner"


def _owner(pid: int) -> str | None:
    """``"PID START"`` of a running process, or None where it is gone (or there is no
    ``/proc``)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return f"{pid} {stat.rsplit(')', 1)[1].split()[19]}"  # fields after the command name


def _remove_stale(folder: Path, prefix: str) -> None:
    """Remove the work folders of earlier runs on the same output whose process is gone (a
    run killed by the kernel or the user leaves its folder, GBs for a large model). Folders
    of running processes, and folders with no owner file, are left alone; without ``/proc``
    nothing is removed."""
    if _owner(os.getpid()) is None:
        return
    for work in folder.glob(f"{glob.escape(prefix)}*.work"):
        try:
            owner = (work / OWNER).read_text().split()
        except OSError:  # no owner file (another tool's, or an older normexport's): not ours
            continue
        if len(owner) == 2 and owner[0].isdigit() and _owner(int(owner[0])) != " ".join(owner):
            shutil.rmtree(work, ignore_errors=True)


def data_path(model_path: Path) -> Path:
    """The external data file written beside ``model_path``: ``out.onnx`` -> ``out.onnx.data``
    (what torch.onnx.export writes too). Where that name would pass
    :data:`DATA_NAME_MAX_BYTES` (a model name of 241 bytes or more), the model's name is cut
    and 8 hex digits of its SHA-1 keep it apart from other names cut alike: the model names
    its data file, so any name that the file system takes serves."""
    name = model_path.name + ".data"
    if len(name.encode()) > DATA_NAME_MAX_BYTES:
        digest = hashlib.sha1(model_path.name.encode()).hexdigest()[:8]
        keep = DATA_NAME_MAX_BYTES - len(f".{digest}.data")
        name = f"{model_path.name.encode()[:keep].decode(errors='ignore')}.{digest}.data"
    return model_path.with_name(name)


def save_model(model: ir.Model, path: Path, *, external_data: bool) -> None:
    """Write ``model`` to ``path`` (not atomically: see :func:`publish_model`).

    With ``external_data``, every initializer of 1 KiB or more goes to
    :func:`data_path` (``path`` + ``.data``) and the .onnx file holds only the graph; large
    Constant nodes are turned into initializers so that they go there too, in a copy of the graph
    (:meth:`onnx_ir.Model.clone`, which shares the tensors): ``model`` itself is not changed
    (its tensors neither: onnx-ir restores them after writing). Without it, every tensor is
    written into the .onnx file, external ones read into memory first. The files are on disk
    when it returns (:func:`write_back`).
    """
    import onnx_ir as ir
    import onnx_ir.passes.common

    if external_data:
        lift = ir.passes.common.LiftConstantsToInitializersPass(
            lift_all_constants=False, size_limit=_INLINE_BYTES
        )
        copy = model.clone()
        lift(copy)
        ir.save(
            copy,
            path,
            external_data=data_path(path).name,
            size_threshold_bytes=_INLINE_BYTES,
        )
    else:
        ir.external_data.load_to_model(model)  # inline means inline: no references left
        ir.save(model, path)
    write_back([path, data_path(path)])


def write_back(paths: list[Path]) -> None:
    """Write what the page cache holds of each existing file of ``paths`` to disk and wait
    (``fsync``; a file opened for reading will do). A file just written is dirty page cache:
    a memory cgroup charges it and the kernel cannot drop it until it is written back, so a
    run under a container's limit with gigabytes of it can be killed where the same pages
    clean would simply be dropped (docs/memory.md); and a file renamed into place must be on
    disk first, or a crash leaves an empty one under the new name."""
    for path in paths:
        try:
            fd = os.open(path, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def wants_external_data(model: ir.Model) -> bool:
    """Whether an output of ``model`` is written with external data: when its tensors come
    from an external data file (as torch.onnx.export writes them by default), or they are over
    :data:`EXTERNAL_DATA_THRESHOLD_BYTES`."""
    from normexport.io.external import has_external_data, tensor_bytes  # onnx-ir: not at the top

    return has_external_data(model) or tensor_bytes(model) > EXTERNAL_DATA_THRESHOLD_BYTES


def publish_model(staged: Path, path: Path) -> list[Path]:
    """Move a model written by :func:`save_model` (and its external data file, if any) from the
    scratch folder onto ``path``: each file by one atomic rename, the data first, with mode
    :func:`default_mode`. An old external data file at ``path`` + ``.data`` that the new model
    does not use is removed, so that no stale weights sit beside it.

    Returns:
        The files written, model first.
    """
    written = [path]
    staged_data = data_path(staged)
    if staged_data.exists():
        os.chmod(staged_data, default_mode())
        os.replace(staged_data, data_path(path))
        written.append(data_path(path))
    os.chmod(staged, default_mode())
    os.replace(staged, path)
    if len(written) == 1:
        data_path(path).unlink(missing_ok=True)
    return written


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure to ``path`` as PNG (120 dpi), atomically, and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)


def default_output(model_path: Path) -> Path:
    """``dir/name.pt`` -> ``dir/name.opt.onnx``: the last suffix is replaced, so
    ``ch_ppocr_mobile_v2.0_cls_infer.onnx`` -> ``ch_ppocr_mobile_v2.0_cls_infer.opt.onnx``."""
    return model_path.with_name(model_path.stem + ".opt.onnx")


def refuse_overwriting(inputs: list[Path], outputs: dict[str, list[Path]]) -> None:
    """Refuse a run whose output files would land on its input files, or on each other.

    Paths are compared after resolving (symbolic links, ``..``, a folder not made yet), so
    ``-o new_dir/../m.onnx`` is caught as ``m.onnx``.

    Args:
        inputs: the files read (the model and its external data files).
        outputs: the option that names them (``-o``, ``--report``) -> the files it writes.

    Raises:
        UsageError: an output is an input file, or two options write the same file.
    """
    read = {Path(os.path.realpath(p)): p for p in inputs}
    seen: dict[Path, str] = {}
    for flag, paths in outputs.items():
        for path in paths:
            real = Path(os.path.realpath(path))
            if real in read:
                raise UsageError(
                    f"{flag} {path} would overwrite the input file {read[real]}; normexport "
                    "never overwrites its input: choose another output path"
                )
            if real in seen and seen[real] != flag:
                raise UsageError(f"{flag} {path} is also written by {seen[real]}: choose another")
            seen[real] = flag
