"""A small CIFAR-sized ResNet whose BatchNorms carry statistics gathered from data.

The architecture follows He, Zhang, Ren and Sun, "Deep Residual Learning for Image
Recognition" (CVPR 2016), at CIFAR scale: a conv3x3-BN-ReLU stem, basic blocks
(conv-BN-ReLU-conv-BN plus shortcut, then ReLU), one downsampling block whose shortcut is a
strided 1x1 conv + BN, global average pooling and a linear classifier. Every BN follows a conv,
so every one can be folded; the 1x1 shortcut's BN tests folding on a branch.

No trained weights ship with it: :func:`trained_resnet` runs the network in training mode over
structured random images so that each BN's running mean and variance are the real statistics
of its input (a default-initialized BN, mean 0 and variance 1, hides folding bugs), and
randomizes every BN's affine weight and bias.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from models import ZooModel

NUM_CLASSES = 10


def _conv_bn(c_in: int, c_out: int, kernel: int, stride: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class BasicBlock(nn.Module):
    """ResNet basic block: ReLU(BN(conv3x3(ReLU(BN(conv3x3(x))))) + shortcut(x)).

    Args:
        c_in: input channels.
        c_out: output channels.
        stride: stride of the first conv; when it is not 1 or ``c_in != c_out`` the shortcut
            is a strided 1x1 conv + BN, otherwise the identity.
    """

    def __init__(self, c_in: int, c_out: int, stride: int = 1):
        super().__init__()
        self.body1 = _conv_bn(c_in, c_out, 3, stride)
        self.body2 = _conv_bn(c_out, c_out, 3, 1)
        needs_projection = stride != 1 or c_in != c_out
        self.shortcut = _conv_bn(c_in, c_out, 1, stride) if needs_projection else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """(batch, c_in, H, W) float32 -> (batch, c_out, H / stride, W / stride) float32."""
        y = self.body2(F.relu(self.body1(x)))
        return F.relu(y + self.shortcut(x))


class ResNetSmall(nn.Module):
    """CIFAR-sized ResNet: stem, 2 blocks at 16 channels, 2 at 32 (the first downsampling).

    10 BatchNorm2d layers (1 stem, 2 per block, 1 on the projection shortcut); 10 classes.
    Constructible with no arguments, so ``--model-class models.resnet:ResNetSmall`` works;
    its weights are then PyTorch's default initialization (see :func:`trained_resnet`).
    """

    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(_conv_bn(3, 16, 3, 1), nn.ReLU())
        self.blocks = nn.Sequential(
            BasicBlock(16, 16), BasicBlock(16, 16), BasicBlock(16, 32, 2), BasicBlock(32, 32)
        )
        self.head = nn.Linear(32, NUM_CLASSES)

    def forward(self, image: torch.Tensor) -> torch.Tensor:
        """Class logits.

        Args:
            image: (batch, 3, H, W) float32, H and W even (32 x 32 in the zoo).

        Returns:
            (batch, 10) float32 logits.
        """
        x = self.blocks(self.stem(image))
        return self.head(x.mean(dim=(2, 3)))


def structured_images(batch: int, generator: torch.Generator, size: int = 32) -> torch.Tensor:
    """Random images with spatial structure and per-channel colour statistics.

    Each image is smooth noise (8 x 8 upsampled bilinearly) plus fine noise, with a random
    per-image, per-channel offset and contrast, so conv outputs have non-zero means and
    channel-dependent variances, as on natural images.

    Returns:
        (batch, 3, size, size) float32.
    """
    coarse = torch.randn(batch, 3, 8, 8, generator=generator)
    smooth = F.interpolate(coarse, size=(size, size), mode="bilinear", align_corners=False)
    fine = 0.3 * torch.randn(batch, 3, size, size, generator=generator)
    offset = 0.5 * torch.randn(batch, 3, 1, 1, generator=generator) + 0.2
    contrast = torch.rand(batch, 3, 1, 1, generator=generator) + 0.5
    return offset + contrast * (smooth + fine)


def trained_resnet(seed: int = 0, batches: int = 30, batch_size: int = 16) -> ResNetSmall:
    """:class:`ResNetSmall` with random affine BN parameters and BN statistics from data.

    Conv and linear weights keep PyTorch's (seeded) default initialization. Every BN's weight
    is drawn from U(0.5, 1.5) and its bias from N(0, 0.2^2); then the running statistics are
    reset and re-estimated as the cumulative average (``momentum=None``) over ``batches``
    training-mode passes of :func:`structured_images`. No gradient step is taken.

    Returns:
        The model in eval mode, BN momentum restored to its default.
    """
    generator = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = ResNetSmall()
    norms = [m for m in model.modules() if isinstance(m, nn.BatchNorm2d)]
    with torch.no_grad():
        for bn in norms:
            bn.weight.copy_(0.5 + torch.rand(bn.num_features, generator=generator))
            bn.bias.copy_(0.2 * torch.randn(bn.num_features, generator=generator))
            bn.reset_running_stats()
            bn.momentum = None
        model.train()
        for _ in range(batches):
            model(structured_images(batch_size, generator))
    for bn in norms:
        bn.momentum = 0.1
    return model.eval()


def resnet_small() -> ZooModel:
    """Zoo entry ``resnet-small``: input ``image`` (2, 3, 32, 32) float32."""
    image = structured_images(2, torch.Generator().manual_seed(1234))
    return ZooModel(
        name="resnet-small",
        module=trained_resnet(),
        inputs={"image": image.numpy()},
        dynamic_axes={"image": {0: "batch"}},
    )
