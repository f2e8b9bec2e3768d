"""The calibration samples of ``--calibration`` for ``--precision int8``: a folder of ``.npz``
files or one ``.npz`` with a leading sample axis, checked against the model's inputs."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np

from normexport.errors import UsageError

#: Calibration samples used at most (the ``--calibration`` folder's first, or the .npz's).
MAX_CALIBRATION = 64


def load_calibration(path: Path, feed_names: Sequence[str], example: Mapping[str, np.ndarray]):
    """The calibration samples of ``--calibration``: a folder of ``.npz`` files (one sample
    each, arrays by input name, sorted by file name) or one ``.npz`` whose arrays carry a
    leading sample axis; at most :data:`MAX_CALIBRATION` samples, each cast to the example's
    dtypes and checked against its shapes.

    Returns:
        A list of feeds, input name -> array.

    Raises:
        UsageError: the path is missing or unreadable, an input is missing, or a sample's shape
            differs from the example's (the model's inputs).
    """
    if path.is_dir():
        paths = sorted(path.glob("*.npz"))[:MAX_CALIBRATION]
        if not paths:
            raise UsageError(f"--calibration {path}: the folder holds no .npz file")
        samples = [_read(p) for p in paths]
    elif path.is_file():
        whole = _read(path)
        counts = {len(a) for a in whole.values() if a.ndim}
        if len(counts) != 1:
            raise UsageError(
                f"--calibration {path}: one .npz holds samples on a leading axis of one length "
                f"for every input; its arrays have leading sizes {sorted(counts)}"
            )
        n = min(counts.pop(), MAX_CALIBRATION)
        samples = [{k: a[i] for k, a in whole.items()} for i in range(n)]
    else:
        raise UsageError(f"--calibration {path}: no such file or folder")
    feeds = []
    for sample in samples:
        missing = [n for n in feed_names if n not in sample]
        if missing:
            raise UsageError(
                f"--calibration {path}: a sample has no array for input(s) {missing}; "
                f"its arrays: {sorted(sample)}"
            )
        feed = {}
        for name in feed_names:
            array = np.asarray(sample[name])
            want = example[name]
            if array.shape != want.shape and array.shape == want.shape[1:]:
                array = array[None]  # one sample without its batch axis
            if array.shape != want.shape:
                raise UsageError(
                    f"--calibration {path}: input {name!r} has shape {array.shape}, and the "
                    f"model runs on {want.shape} (give samples of that shape, or the "
                    "--input-shape they have)"
                )
            feed[name] = array.astype(want.dtype, copy=False)
        feeds.append(feed)
    return feeds


def _read(path: Path) -> dict[str, np.ndarray]:
    """The arrays of an ``.npz`` file.

    Raises:
        UsageError: it cannot be read as one.
    """
    try:
        with np.load(path, allow_pickle=False) as data:
            return {k: data[k] for k in data.files}
    except (OSError, ValueError) as err:
        raise UsageError(f"--calibration {path}: cannot read it as .npz ({err})") from None
