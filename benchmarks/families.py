"""One model per library, exported as a user would, timed against the other tools (issue 41).

Each model is built from its library's own classes at a small but realistic size, batch 1,
random weights, and no parameter left at the constant its library initializes it to
(:func:`randomize`: norm weights of 1, zero biases, SAM's zero relative positions get noise;
every BatchNorm random statistics and affine parameters):

- diffusers: ``UNet2DConditionModel`` (Stable Diffusion's layout at two levels: channels 32
  and 64, 2 and 4 heads, cross-attention over 77 tokens of 32; latent 4x32x32) and
  ``AutoencoderKL``'s encoder (``encode(x).latent_dist.mean``, image 3x128x128) and decoder
  (``decode(z).sample``, latent 4x32x32): channels 32, 64, 64, one attention in the mid block;
- open_clip: a ViT image tower (``VisionTransformer``: 96x96, patches of 16, width 256,
  6 layers, 4 heads) and an RN50-style tower (``ModifiedResNet``: RN50's 3-4-6-3 blocks at
  width 32, 128x128, attention pooling with 16 heads);
- openai-whisper: ``AudioEncoder`` at whisper-tiny's size (80 mels, 3000 frames, 1500
  positions, width 384, 6 heads, 4 layers);
- segment-anything: ``ImageEncoderViT`` (512x512, width 256, 4 heads, depth 4, windows of 14,
  global attention in blocks 1 and 3, relative positions, LayerNorm eps 1e-6 as ``build_sam``);
- ultralytics: YOLOv8n and YOLO11n from their yaml (``DetectionModel``, 640x640; the first
  output, the decoded boxes and class scores);
- transformers: the encoders ``decoders.py`` times (:data:`decoders.ENCODERS`: ViT-Tiny's
  shape, a CLIP vision tower, BERT with a padding mask);
- timm: SwinV2-Tiny (``swinv2_tiny_window8_256``, 256x256: cosine attention scaled by a logit
  scale per head, shifted windows) and EdgeNeXt-XX-Small (``edgenext_xx_small``, 256x256:
  cross-covariance attention scaled by a temperature per head), ``pretrained=False``.

Each is exported with ``torch.onnx.export(model, args, path)``'s defaults (dynamo) and timed
on ONNX Runtime (ORT_ENABLE_ALL; on the CPU provider 2 intra-op threads, spinning off) as:

- ``ort_raw``: the export as is;
- ``ort_transformers``: ``onnxruntime.transformers.optimizer.optimize_model`` with the model
  type it offers for the model (:attr:`Family.ort_type`: ``unet``, ``vae``, ``clip``,
  ``sam2``, ``vit``, ``bart`` for whisper, ``bert``, ``swin``; YOLO and EdgeNeXt have none, so
  its default, ``bert``),
  ``num_heads`` / ``hidden_size`` where all the model's attention has one of each (else 0: it
  reads them from each attention), ``use_gpu`` on CUDA only, and its default ``opt_level``
  for the type, as a user calling it gets;
- ``onnxscript_ort``: ``onnxscript.rewriter.ort_fusions.optimize_for_ort``
  (:func:`normexport.bench.variants.build_variants`);
- ``normexport``: ``normexport.optimize(raw, output=..., inputs=...)``, the main job on the
  export with its example inputs as a user runs it: its latency verdict times the model
  against the raw export for ``--normexport-budget`` seconds (the CLI's default ``--budget``,
  10; 0: ``benchmark=False``, no verdict) and undoes the rewrites it finds slower; its parity
  verdict, fusions, refusals and speed verdict go to the JSON;
- ``normexport_again``: the A/A control, other sessions of normexport's own file.

Each variant is ``--copies`` sessions opened in ABBA order and timed in turn, each round in a
random order (:func:`normexport.latency.measure.counterbalanced`, ``rotating``,
``time_interleaved``); the ratios other / normexport are per-round paired, with 95% bootstrap
intervals (above 1: normexport is faster). A difference no larger than the control's is no
difference. Each variant's outputs are compared with the raw export's (max abs difference,
beside the largest |output|), and each variant's file is counted: nodes, ``Softmax`` nodes
(attention left unfused; YOLO's distribution focal loss is one too, and no attention),
attention ops, norm ops, as written (ONNX Runtime's session may fuse more).

The libraries are imported per model, from ``{sys.prefix}/families`` and timm from
``{sys.prefix}/timm`` (:mod:`outside`; ``make bench`` installs them there): a model whose
library does not import is skipped, said on the terminal and in the JSON.

    python benchmarks/families.py [--models unet,whisper_encoder] [--provider cpu|cuda]
                                  [--budget 20] [--copies 2] [--normexport-budget 10] [--out DIR]

Writes ``families_<provider>.json`` and ``families_<provider>.png`` to ``--out`` (default
``benchmarks/results``) and prints the table.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import functools
import importlib.metadata
import math
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import decoders
import numpy as np
import onnx
import onnxruntime as ort
import outside
import torch
from reparam import export, randomized
from rich.console import Console
from rich.table import Table

import normexport
from normexport import report, runtime
from normexport.bench.render import fmt_ratio
from normexport.bench.results import Machine
from normexport.bench.variants import Variant, build_variants
from normexport.errors import UsageError, one_line
from normexport.io.files import save_figure
from normexport.io.quiet import quiet, swallow_prints
from normexport.latency.measure import (
    counterbalanced,
    paired_ratio,
    rotating,
    runner,
    time_interleaved,
)

#: ONNX Runtime's intra-op threads on the CPU provider (and PyTorch's, for the export).
THREADS = 2
#: The A/A control: other sessions of normexport's own file.
CONTROL = decoders.CONTROL
#: The variants timed, in the order their sessions open (see the module docstring).
VARIANTS = ("ort_raw", "ort_transformers", "onnxscript_ort", "normexport", CONTROL)
DESCRIPTIONS = {
    "ort_transformers": "onnxruntime.transformers.optimizer.optimize_model(model_type=the "
    "model's, num_heads, hidden_size, use_gpu=CUDA; on CPU its CUDA-only fusions off), its "
    "default opt_level, then ORT_ENABLE_ALL",
    "normexport": "normexport.optimize(raw, output=..., inputs=..., budget_s="
    "--normexport-budget; 0: benchmark=False), then ORT_ENABLE_ALL",
    CONTROL: "other sessions of normexport's file",
}


@dataclasses.dataclass(frozen=True)
class Family:
    """One library's model: how to build it and what ONNX Runtime's optimizer calls it.

    Attributes:
        library: the distribution that provides it (its version goes to the JSON).
        build: ``build(**config) -> (module, example tensors)``; imports the library (an
            ImportError skips the model).
        config: ``build``'s keyword arguments (recorded in the JSON).
        ort_type: ``optimize_model``'s ``model_type`` for it.
        heads, hidden: ``optimize_model``'s ``num_heads`` and ``hidden_size``; 0 where the
            model's attention blocks differ (it reads them from each).
    """

    library: str
    build: Callable[..., tuple[torch.nn.Module, tuple[torch.Tensor, ...]]]
    config: dict
    ort_type: str
    heads: int = 0
    hidden: int = 0


class _Call(torch.nn.Module):
    """``call(model, *inputs)``: a library model's method other than ``forward``, or the
    tensor its ``forward`` returns inside the library's own output type."""

    def __init__(self, model: torch.nn.Module, call: Callable[..., torch.Tensor]):
        super().__init__()
        self.model, self.call = model, call

    def forward(self, *inputs: torch.Tensor) -> torch.Tensor:
        return self.call(self.model, *inputs)


def _unet(**config):
    from diffusers import UNet2DConditionModel

    size, text = config["sample_size"], config["cross_attention_dim"]
    args = (torch.randn(1, 4, size, size), torch.tensor([500]), torch.randn(1, 77, text))
    unet = UNet2DConditionModel(**config)
    return _Call(unet, lambda m, x, t, context: m(x, t, context).sample), args


def _vae(part: str, **config):
    from diffusers import AutoencoderKL

    vae = AutoencoderKL(**config)
    size = config["sample_size"]
    if part == "encoder":
        image = torch.randn(1, 3, size, size)
        return _Call(vae, lambda m, x: m.encode(x).latent_dist.mean), (image,)
    latent = size // 2 ** (len(config["block_out_channels"]) - 1)  # each level but the last halves
    z = torch.randn(1, config["latent_channels"], latent, latent)
    return _Call(vae, lambda m, z: m.decode(z).sample), (z,)


def _openclip_vit(**config):
    from open_clip.transformer import VisionTransformer

    size = config["image_size"]
    return VisionTransformer(**config), (torch.randn(1, 3, size, size),)


def _openclip_resnet(**config):
    from open_clip.modified_resnet import ModifiedResNet

    size = config["image_size"]
    return ModifiedResNet(**config), (torch.randn(1, 3, size, size),)


def _whisper(**config):
    from whisper.model import AudioEncoder

    mel = torch.randn(1, config["n_mels"], 2 * config["n_ctx"])  # conv2 halves the frames
    return AudioEncoder(**config), (mel,)


def _sam(**config):
    from segment_anything.modeling import ImageEncoderViT

    size = config["img_size"]
    norm = functools.partial(torch.nn.LayerNorm, eps=1e-6)  # as build_sam's
    return ImageEncoderViT(norm_layer=norm, **config), (torch.randn(1, 3, size, size),)


def _yolo(cfg: str, image_size: int):
    from ultralytics.nn.tasks import DetectionModel

    model = DetectionModel(cfg, verbose=False)
    return _Call(model, lambda m, x: m(x)[0]), (torch.randn(1, 3, image_size, image_size),)


def _timm(name: str, image_size: int):
    import timm

    image = torch.randn(1, 3, image_size, image_size)
    return timm.create_model(name, pretrained=False), (image,)


def _encoder(name: str):
    module, shapes = decoders.ENCODERS[name]()
    feeds = decoders.encoder_inputs(np.random.default_rng(0), shapes, 1)
    return module, tuple(torch.from_numpy(a) for a in feeds.values())


_VAE = {
    "block_out_channels": (32, 64, 64),
    "down_block_types": ("DownEncoderBlock2D",) * 3,
    "up_block_types": ("UpDecoderBlock2D",) * 3,
    "latent_channels": 4,
    "sample_size": 128,
}
_SAM = {"img_size": 512, "embed_dim": 256, "depth": 4, "num_heads": 4, "out_chans": 256}
_SAM |= {"use_rel_pos": True, "window_size": 14, "global_attn_indexes": (1, 3)}

#: The models, by name (``--models``).
FAMILIES = {
    "unet": Family(
        "diffusers", _unet,
        {
            "sample_size": 32, "block_out_channels": (32, 64), "layers_per_block": 2,
            "down_block_types": ("CrossAttnDownBlock2D", "DownBlock2D"),
            "up_block_types": ("UpBlock2D", "CrossAttnUpBlock2D"),
            "cross_attention_dim": 32, "attention_head_dim": (2, 4),
        },
        "unet",
    ),
    "vae_encoder": Family("diffusers", functools.partial(_vae, "encoder"), _VAE, "vae"),
    "vae_decoder": Family("diffusers", functools.partial(_vae, "decoder"), _VAE, "vae"),
    "openclip_vit": Family(
        "open_clip_torch", _openclip_vit,
        {"image_size": 96, "patch_size": 16, "width": 256, "layers": 6, "heads": 4,
         "mlp_ratio": 4.0, "output_dim": 128},
        "clip", 4, 256,
    ),
    "openclip_rn50": Family(
        "open_clip_torch", _openclip_resnet,
        {"layers": (3, 4, 6, 3), "output_dim": 256, "heads": 16, "image_size": 128, "width": 32},
        "clip", 16, 1024,
    ),
    "whisper_encoder": Family(
        "openai-whisper", _whisper,
        {"n_mels": 80, "n_ctx": 1500, "n_state": 384, "n_head": 6, "n_layer": 4},
        "bart", 6, 384,
    ),
    "sam_encoder": Family("segment-anything", _sam, _SAM, "sam2", 4, 256),
    "yolov8n": Family("ultralytics", _yolo, {"cfg": "yolov8n.yaml", "image_size": 640}, "bert"),
    "yolo11n": Family("ultralytics", _yolo, {"cfg": "yolo11n.yaml", "image_size": 640}, "bert"),
    "vit": Family("transformers", _encoder, {"name": "vit"}, "vit", 3, 192),
    "clip": Family("transformers", _encoder, {"name": "clip"}, "clip", 4, 256),
    "bert": Family("transformers", _encoder, {"name": "bert"}, "bert", 4, 256),
    "swinv2": Family(
        "timm", _timm, {"name": "swinv2_tiny_window8_256", "image_size": 256}, "swin"
    ),
    "edgenext": Family("timm", _timm, {"name": "edgenext_xx_small", "image_size": 256}, "bert"),
}  # fmt: skip


def randomize(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """``module`` in eval mode with no parameter at its library's constant initial value: each
    parameter whose elements are all equal (a norm's weight of 1, a zero bias, SAM's zero
    relative positions) gets 0.3 N(0, 1) noise, and every BatchNorm random statistics and
    affine parameters (:func:`reparam.randomized`)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in module.parameters():
            if p.numel() and bool((p == p.flatten()[0]).all()):
                p.add_(0.3 * torch.randn(p.shape, generator=generator))
    return randomized(module, seed)


#: The fusions of ONNX Runtime's transformer optimizer into ops it has on CUDA only (NhwcConv,
#: GroupNorm, SkipGroupNorm, BiasSplitGelu, BiasAdd), on by default for its ``unet``, ``vae``
#: and ``clip`` types: a CPU run turns them off, as a CPU user must (its ``--disable_*``
#: flags), for with them the model does not load on the CPU provider.
CUDA_ONLY_FUSIONS = ("nhwc_conv", "group_norm", "skip_group_norm", "bias_splitgelu", "bias_add")


def _ort_transformers(raw: Path, out: Path, family: Family, provider: str) -> Variant:
    """ONNX Runtime's transformer optimizer on ``raw`` with ``family``'s model type (on CPU,
    :data:`CUDA_ONLY_FUSIONS` off), written to ``out``; a failure is the variant's error."""
    start = time.perf_counter()
    saved = sys.path[:]  # it puts its own folder, with a `models` package, on sys.path
    try:
        with quiet("onnxruntime"), swallow_prints("stdout", "stderr"):
            from onnxruntime.transformers.fusion_options import FusionOptions
            from onnxruntime.transformers.optimizer import optimize_model

            options = FusionOptions(family.ort_type)
            on = [f for f in CUDA_ONLY_FUSIONS if getattr(options, f"enable_{f}", False)]
            off = on if provider == "cpu" else []
            for fusion in off:
                setattr(options, f"enable_{fusion}", False)
            optimized = optimize_model(
                str(raw), model_type=family.ort_type, num_heads=family.heads,
                hidden_size=family.hidden, optimization_options=options,
                use_gpu=provider == "cuda",
            )  # fmt: skip
            optimized.save_model_to_file(str(out), use_external_data_format=True)
    except Exception as err:  # a broken optimizer is a result, not a crash
        return Variant("ort_transformers", None, error=one_line(err))
    finally:
        sys.path[:] = saved
    variant = Variant.extra("ort_transformers", out, DESCRIPTIONS["ort_transformers"])
    variant.build_s = time.perf_counter() - start
    fused = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
    variant.details = {"fused": fused, "fusions_off": off}
    return variant


def _normexport(raw: Path, out: Path, inputs: Path, provider: str, budget_s: float):
    """``normexport.optimize`` on ``raw`` (timing and judging its own speed only with a
    ``budget_s``): its variant and a summary of its report."""
    start = time.perf_counter()
    try:
        with swallow_prints("stdout", "stderr"):
            done = normexport.optimize(
                raw, output=out, inputs=inputs, provider=provider,
                benchmark=budget_s > 0, budget_s=budget_s or None,
            )  # fmt: skip
    except Exception as err:  # a failed run is a result too
        return Variant("normexport", None, error=one_line(err)), {}
    variant = Variant.extra("normexport", out, DESCRIPTIONS["normexport"])
    variant.build_s = time.perf_counter() - start
    variant.details = {k: n for k, n in done.fusions.counts.items() if n}
    refused = collections.Counter(f"{r.family}/{r.code}" for r in done.fusions.refused)
    summary = {
        "parity_passed": done.passed,
        "refused": dict(refused),
        "rollback": done.rollback.to_dict() if done.rollback else None,
        "speed": done.speed.to_dict() if done.speed else None,
    }
    return variant, summary


def ops_of(path: Path, feeds: dict) -> dict:
    """The ``Softmax`` nodes, the attention ops (by op type) and the multiply-add work
    (:func:`work`) of the model at ``path``."""
    ops = collections.Counter(
        n.op_type for n in onnx.load(path, load_external_data=False).graph.node
    )
    return {
        "Softmax": ops["Softmax"],
        "attention_ops": {k: n for k, n in ops.items() if "Attention" in k},
        "work_multiply_adds": work(path, feeds),
    }


def work(path: Path, feeds: dict) -> int:
    """The multiply-adds of the MatMul, Gemm and attention nodes of the model at ``path`` run
    on ``feeds`` (ONNX's ``Attention`` and ONNX Runtime's ``Attention`` / ``MultiHeadAttention``:
    ``Q K^T`` and ``P V``, and the packed projection of com.microsoft ``Attention``), from the
    shapes of their inputs and outputs in one run on ONNX Runtime's CPU provider (no shape
    inference knows every contrib op)."""
    model = onnx.load(path)
    counted = [n for n in model.graph.node if _node_work(n, None) is None]
    names = {v for n in counted for v in (*n.input[:3], n.output[0]) if v}
    outputs = {o.name for o in model.graph.output}
    model.graph.output.extend(onnx.ValueInfoProto(name=v) for v in sorted(names - outputs))
    level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    session = runtime.make_session(model, "cpu", optimization_level=level, threads=1)
    got = session.run(None, feeds)
    shapes = {o.name: list(a.shape) for o, a in zip(session.get_outputs(), got, strict=True)}
    shapes |= {t.name: list(t.dims) for t in model.graph.initializer}
    return sum(_node_work(n, shapes) for n in counted)


def _node_work(node, shapes: dict | None) -> int | None:
    """One node's multiply-adds for :func:`work`, its input and output shapes in ``shapes``
    (None where the node is none :func:`work` counts; with ``shapes`` None, None for a node it
    counts and 0 for any other)."""
    counted = node.op_type in ("MatMul", "Gemm", "Attention", "MultiHeadAttention")
    if shapes is None or not counted:
        return None if counted and shapes is None else 0
    if node.op_type in ("MatMul", "Gemm"):
        a = shapes[node.input[0]]
        trans_a = any(x.name == "transA" and x.i for x in node.attribute)
        return math.prod(shapes[node.output[0]]) * (a[0] if trans_a else a[-1])
    if node.op_type == "Attention" and node.domain == "com.microsoft":
        b, s, hidden = shapes[node.input[0]]
        d = shapes[node.input[1]][1] // 3
        return b * s * hidden * 3 * d + 2 * b * s * s * d
    q, k, v = (shapes[node.input[i]] for i in range(3))
    keys = k[2] if len(k) == 4 else k[1]  # (B, N, S, H) or (B, S, N * H)
    width = v[1] * v[3] if len(v) == 4 else v[-1]
    if len(q) == 4:  # (B, N, S, H): N * H of the query's width
        return q[0] * q[2] * keys * (q[1] * q[3] + width)
    return q[0] * q[1] * keys * (q[2] + width)


def build(raw: Path, folder: Path, family: Family, provider: str, budget_s: float):
    """Every variant of :data:`VARIANTS` but the control, built from the export at ``raw``
    (its example inputs beside it, ``inputs.npz``): name -> Variant, and normexport's
    summary."""
    built = build_variants(raw, provider, folder, only=["ort_raw", "onnxscript_ort"])
    built["ort_transformers"] = _ort_transformers(
        raw, folder / "ort_transformers.onnx", family, provider
    )
    built["normexport"], summary = _normexport(
        raw, folder / "normexport.onnx", folder / "inputs.npz", provider, budget_s
    )
    return {name: built[name] for name in VARIANTS if name in built}, summary


def _max_diff(got: list[np.ndarray], want: list[np.ndarray]) -> float:
    """The largest |got - want| over every output (inf where a shape differs)."""
    if [a.shape for a in got] != [b.shape for b in want]:
        return float("inf")
    return max(
        float(np.abs(a.astype(np.float64) - b).max()) for a, b in zip(got, want, strict=True)
    )


def _opener(path: Path, provider: str) -> Callable[[], object]:
    """Open a timing session of ``path`` on ``provider``; what it raises is returned instead
    (a model the provider cannot run is a result)."""

    def open_session():
        try:
            return runtime.make_session(path, provider, spinning=False, threads=THREADS)
        except Exception as err:
            return err

    return open_session


def measure(paths: dict[str, Path], feeds: dict, provider: str, budget_s: float, copies: int):
    """Time the models at ``paths`` (name -> file), ``copies`` sessions of each, interleaved;
    their medians, ratios to normexport's and largest difference from the raw export's
    outputs, and why a model could not be timed (its session did not open)."""
    opened = counterbalanced({k: _opener(p, provider) for k, p in paths.items()}, copies)
    runners, outputs, errors = {}, {}, {}
    for name, sessions in opened.items():
        failed = [s for s in sessions if isinstance(s, Exception)]
        if failed:
            errors[name] = one_line(failed[0])
            continue
        calls = [runner(s, feeds, io_binding=provider == "cuda") for s in sessions]
        runners[name] = rotating([call for call, _ in calls])
        outputs[name] = [np.asarray(a) for a in calls[0][1]()]
    for name in ("ort_raw", "normexport"):
        if name in errors:
            raise RuntimeError(f"{name} does not run on {provider}: {errors[name]}")
    timings = time_interleaved(runners, budget_s=budget_s, min_runs=10)
    base, raw = timings["normexport"], outputs["ort_raw"]
    return {
        "latency_ms": {k: t.to_dict() for k, t in timings.items()},
        "ratio_to_normexport": {
            k: paired_ratio(t, base).to_dict() for k, t in timings.items() if k != "normexport"
        },
        "max_abs_diff_vs_raw": {k: _max_diff(o, raw) for k, o in outputs.items() if k != "ort_raw"},
        "max_abs_raw": max(float(np.abs(a).max()) for a in raw),
        "session_errors": errors,
    }


def bench_family(family: Family, args: argparse.Namespace) -> dict:
    """Build, export, optimize and time ``family``'s model (one of :data:`FAMILIES`, or of a
    sibling benchmark's); its JSON entry (``skipped`` where its library does not import,
    ``failed`` where a step raised)."""
    entry = {"library": family.library, "config": family.config, "ort_model_type": family.ort_type}
    torch.manual_seed(0)
    try:
        module, example = family.build(**family.config)
    except ImportError as err:
        where = Path(sys.prefix) / ("timm" if family.library == "timm" else "families")
        said = (
            f"{family.library} does not import ({one_line(err)}); make bench installs it in {where}"
        )
        return entry | {"skipped": said}
    module = randomize(module)
    with tempfile.TemporaryDirectory(prefix="families-") as tmp:
        folder = Path(tmp)
        start = time.perf_counter()
        export(module, example, folder / "raw.onnx")
        entry["export_s"] = time.perf_counter() - start
        graph = onnx.load(folder / "raw.onnx", load_external_data=False).graph
        names = [value.name for value in graph.input]
        feeds = dict(zip(names, (t.numpy() for t in example), strict=True))
        entry["inputs"] = {k: list(a.shape) for k, a in feeds.items()}
        np.savez(folder / "inputs.npz", **feeds)
        built, entry["normexport_report"] = build(
            folder / "raw.onnx", folder, family, args.provider, args.normexport_budget
        )
        entry["variants"] = {
            k: v.to_dict() | (ops_of(v.model, feeds) if v.model else {}) for k, v in built.items()
        }
        paths = {k: v.model for k, v in built.items() if v.model is not None}
        if "normexport" not in paths:
            return entry | {"failed": f"normexport: {built['normexport'].error}"}
        paths[CONTROL] = paths["normexport"]
        entry |= measure(paths, feeds, args.provider, args.budget, args.copies)
    entry["targets"] = decoders.targets(entry)
    return entry


def _versions() -> dict[str, str | None]:
    """The versions of the libraries and optimizers the run used (None: not installed)."""
    names = ["onnxscript", "transformers", "torchvision", "timm"]
    names += sorted({family.library for family in FAMILIES.values()} - {"transformers"})
    versions = {}
    for name in names:
        try:
            versions[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            versions[name] = None
    return versions


def _timed(results: dict) -> dict[str, dict]:
    """The models that were timed, by name."""
    return {name: e for name, e in results["models"].items() if "ratio_to_normexport" in e}


def chart(
    results: dict, path: Path, title: str | None = None, variants: list[str] | None = None
) -> None:
    """Each variant's time (of ``variants``, default :data:`VARIANTS` but normexport) over
    normexport's per model (median, 95% interval; above 1: normexport is faster), under
    ``title`` (default: this benchmark's)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    timed = _timed(results)
    names = variants or [v for v in VARIANTS if v != "normexport"]
    fig, ax = plt.subplots(figsize=(max(8, 1.1 * len(timed)), 4.5))
    width = 0.8 / len(names)
    for i, variant in enumerate(names):
        xs, med, err = [], [], [[], []]
        for j, entry in enumerate(timed.values()):
            r = entry["ratio_to_normexport"].get(variant)
            if r:
                xs.append(j + i * width)
                med.append(r["median"])
                err[0].append(r["median"] - r["ci_low"])
                err[1].append(r["ci_high"] - r["median"])
        ax.bar(xs, med, width, yerr=err, capsize=2, label=variant)
    ax.axhline(1.0, color="black", linewidth=1)
    ax.set_xticks(np.arange(len(timed)) + 0.4 - width / 2, list(timed), rotation=30, ha="right")
    ax.set_ylabel("time / normexport's (median, 95% CI)")
    provider = results["machine"]["provider"]
    ax.set_title(
        title
        or f"One model per library, {provider}, {THREADS} threads: above 1, normexport is faster"
    )
    ax.legend(fontsize=7)
    fig.tight_layout()
    save_figure(fig, path)


def _softmax(entry: dict) -> str:
    softmax = {k: entry["variants"][k]["Softmax"] for k in ("ort_raw", "normexport")}
    return f"{softmax['ort_raw']} -> {softmax['normexport']}"


#: :func:`print_table`'s last columns by default: the Softmax nodes left (raw -> normexport),
#: normexport's largest difference from the raw export.
COLUMNS = {
    "Softmax raw -> ne": _softmax,
    "ne - raw": lambda entry: f"{entry['max_abs_diff_vs_raw']['normexport']:.1e}",
}


def print_table(results: dict, console: Console, columns: dict | None = None) -> None:
    """Per model: normexport's median, each other variant's ratio to it (``err``: it did not
    build or run; the JSON says why), then ``columns`` (title -> ``entry -> text``; default
    :data:`COLUMNS`); skipped and failed models with the reason."""
    columns = columns or COLUMNS
    others = [v for v in VARIANTS if v != "normexport"]
    table = Table(title="time / normexport's time (95% interval); > 1: normexport is faster")
    for column in ("model", "normexport ms", *others, *columns):
        table.add_column(column)
    for name, entry in results["models"].items():
        if "ratio_to_normexport" not in entry:
            reason = entry.get("skipped") or entry.get("failed", "")
            table.add_row(name, reason, *[""] * (len(others) + len(columns)))
            continue
        ratios = entry["ratio_to_normexport"]
        table.add_row(
            name,
            f"{entry['latency_ms']['normexport']['median_ms']:.2f}",
            *[fmt_ratio(ratios[v]) if v in ratios else "err" for v in others],
            *[text(entry) for text in columns.values()],
        )
    console.print(table)


def add_timing_arguments(p: argparse.ArgumentParser) -> None:
    """The flags of how the variants are timed and where the results go (this script's and
    ``exporters.py``'s)."""
    p.add_argument("--provider", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--budget", type=float, default=20.0, help="timing seconds per model")
    p.add_argument(
        "--copies", type=int, default=2, help="sessions of each variant, opened ABBA, timed in turn"
    )
    p.add_argument(
        "--normexport-budget", type=float, default=10.0,
        help="seconds normexport's main job times the model itself (0: benchmark=False)",
    )  # fmt: skip
    p.add_argument("--out", type=Path, default=Path(__file__).parent / "results")


def chosen(p: argparse.ArgumentParser, given: str, known, flag: str = "--models") -> list[str]:
    """The names of ``given`` (comma-separated) that ``known`` holds; any other is
    ``p.error``'s (exit 2)."""
    names = [n for n in given.split(",") if n]
    if unknown := [n for n in names if n not in known]:
        p.error(f"{flag}: unknown {', '.join(unknown)}; choose from {', '.join(known)}")
    return names


def run_models(names: list[str], bench: Callable[[str], dict], results: dict, console) -> None:
    """``bench(name)`` for each name into ``results["models"]``, with its wall time; a model
    that raises has its failure as its result (the others still run)."""
    for name in names:
        start = time.perf_counter()
        try:
            entry = bench(name)
        except Exception as err:  # one model's failure is its result; the others still run
            entry = {"failed": one_line(err)}
        entry["wall_s"] = time.perf_counter() - start
        results["models"][name] = entry
        said = entry.get("skipped") or entry.get("failed") or "done"
        console.print(f"{name}: {said} ({entry['wall_s']:.0f} s)")


def save(results: dict, stem: Path, title: str | None = None, variants=None) -> None:
    """``results`` as ``STEM.json`` and its chart (:func:`chart`) as ``STEM.png``."""
    stem.parent.mkdir(parents=True, exist_ok=True)
    report.write_json(results, stem.with_suffix(".json"))
    chart(results, stem.with_suffix(".png"), title, variants)


def header(args: argparse.Namespace, console: Console) -> dict | None:
    """The results' record of the machine and the timing (of :func:`add_timing_arguments`'
    flags), with no model yet; None, said on ``console``, where the provider does not load."""
    try:
        runtime.resolve_provider(args.provider)
    except UsageError as err:
        console.print(f"error: {err}")
        return None
    return {
        "machine": Machine.probe(args.provider).to_dict(),
        "threads": THREADS if args.provider == "cpu" else None,
        "spinning": False,
        "io_binding": args.provider == "cuda",
        "copies": args.copies,
        "budget_s": args.budget,
        "normexport_budget_s": args.normexport_budget,
        "variants": {v: DESCRIPTIONS.get(v) or Variant(v, None).description for v in VARIANTS},
        "models": {},
    }


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; write the JSON and the chart; print the table."""
    p = argparse.ArgumentParser(
        prog="python benchmarks/families.py", description=__doc__.split("\n\n")[0]
    )
    p.add_argument("--models", default=",".join(FAMILIES), help="comma-separated names")
    add_timing_arguments(p)
    args = p.parse_args(argv)
    names = chosen(p, args.models, FAMILIES)
    console = Console(highlight=False, width=200)
    results = header(args, console)
    if results is None:
        return 2
    outside.use()
    torch.set_num_threads(THREADS)
    results["versions"] = _versions()
    run_models(names, lambda name: bench_family(FAMILIES[name], args), results, console)
    stem = args.out / f"families_{args.provider}"
    save(results, stem)
    print_table(results, console)
    console.print(f"wrote {stem}.json and .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
