"""Writing output files atomically: a reader never sees a half-written model or report."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary path in ``path``'s folder; when the block succeeds, rename it onto
    ``path`` (``os.replace``, atomic on POSIX). On an error the temporary file is removed and
    ``path`` is untouched. Creates the folder if needed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)


def save_figure(fig, path: Path) -> None:
    """Write a matplotlib figure to ``path`` as PNG (120 dpi), atomically, and close it."""
    import matplotlib.pyplot as plt

    try:
        with atomic_path(path) as tmp:
            fig.savefig(tmp, dpi=120, format="png")
    finally:
        plt.close(fig)
