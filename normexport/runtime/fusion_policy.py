"""The fusion policy per execution provider: which of :mod:`fusion`'s exact rewrites a model
made for ONNX Runtime's CPU or CUDA provider gets (:func:`fusion_policy`), each choice a speed
choice measured on that provider (the results cited with it). :mod:`fusion` keeps
:class:`fusion.Policy` with neutral defaults and takes the policy it is given; the run,
``explain``, ``bench``'s normexport variant and the benchmarks all ask :func:`fusion_policy`.
"""

from __future__ import annotations

import fusion
from fusion.fuse_gqa import FuseGroupQueryAttention
from fusion.fuse_skip import FuseSkip

#: The execution providers on which a run fuses residual Add + norm into ONNX Runtime's Skip
#: ops (:func:`fusion_policy`): on CUDA SkipSimplifiedLayerNormalization is faster than Add +
#: SimplifiedLayerNormalization, and SkipLayerNormalization is what ORT makes of Add +
#: LayerNormalization anyway (``benchmarks/results/forms_cuda.json``, docs/cuda.md).
SKIP_PROVIDERS = ("cuda",)

#: The execution providers on which a run fuses them all only in a model with a KV cache, and
#: elsewhere only where the Skip op absorbs a dense layer's bias Add too and the norm alone
#: reads the sum (``skip="kv_cache"``, :mod:`fusion.fuse_skip`). On the CPU provider the Skip
#: ops make a decoder's decode step faster and its prefill and the encoders slower (the
#: ``normexport_skip`` variant of ``benchmarks/results/decoders_cpu.json``; one node alone,
#: ``forms_cpu.json``, slower), unless they remove two Adds: BERT's post-norm Skip ops with the
#: bias absorbed are faster, ViT's pre-norm ones, whose sum the residual stream reads too, slower
#: (``benchmarks/results/families_cpu.json``; :mod:`fusion.fuse_skip`).
SKIP_KV_CACHE_PROVIDERS = ("cpu",)

#: The execution providers on which a run fuses decoder attention into GroupQueryAttention
#: (:func:`fusion_policy`): ONNX Runtime's CUDA kernel of the op takes float16 and bfloat16 only
#: (its kernel table, :mod:`normexport.runtime.cuda_kernels`), and the passes run on the float32
#: model.
GQA_PROVIDERS = ("cpu",)

#: The execution providers whose attention kernels run one thread per batch and head, so that
#: :mod:`fusion.fuse_sdpa` and :mod:`fusion.fuse_attention` leave an attention with fewer than
#: the run's intra-op threads (the policy's ``threads``).
THREADED_PROVIDERS = ("cpu",)

#: The execution providers on which :mod:`fusion.fuse_sdpa` fuses YOLO's transposed attention
#: (``q^T @ k``, ``v @ attn^T``: ``Attention`` of ``q^T`` and of the Transposes of K and V, its
#: output transposed back; the policy's ``sdpa_transposed``). On the CPU provider it is left
#: (``transposed_form``): ONNX Runtime's session makes the unfused form two ``FusedMatMul``s
#: and a Softmax, no Transpose left, and the fused one four Transposes (copies) around
#: ``Attention``. Whole models, the choice flipped (``benchmarks/results/attention_ab_cpu.json``):
#: YOLO11n fused over left 1.01 [0.99, 1.03], never faster. On CUDA it stays fused, as before
#: (not measured there).
TRANSPOSED_SDPA_PROVIDERS = ("cuda",)


def fusion_policy(target: str, provider: str, threads: int, **settings) -> fusion.Policy:
    """The fusion policy of a model made for ``target`` on ``provider`` (``"cpu"`` or
    ``"cuda"``, as :func:`normexport.runtime.resolve_provider` resolves it).

    The fusions that are a speed choice per provider are decided by the lists above, each only
    for the targets its pass runs for: ``skip`` True on :data:`SKIP_PROVIDERS`, ``"kv_cache"``
    on :data:`SKIP_KV_CACHE_PROVIDERS`; ``gqa`` on :data:`GQA_PROVIDERS`; ``threads`` kept on
    :data:`THREADED_PROVIDERS`, 1 elsewhere; ``sdpa_transposed`` on
    :data:`TRANSPOSED_SDPA_PROVIDERS`.

    Args:
        target: one of :data:`fusion.base.TARGETS`.
        provider: ``"cpu"`` or ``"cuda"``.
        threads: the intra-op threads the model will run on, as the run resolved them
            (:func:`normexport.pipeline.job.run_threads`: ``--threads``, else this machine's
            cores).
        **settings: the other fields of :class:`fusion.Policy` that the caller chooses (a
            user's, such as ``last_rows``), given as they are.

    Returns:
        The policy, to give :func:`fusion.optimize`.

    Raises:
        ValueError: the policy is not one :class:`fusion.Policy` accepts (``target`` not one
            of its targets, ``threads`` below 1, a bad setting).
        TypeError: a name of ``settings`` is no field of :class:`fusion.Policy`, or one that
            this function decides.
    """
    skip: bool | str = False
    if target in FuseSkip.targets and provider in SKIP_PROVIDERS:
        skip = True
    elif target in FuseSkip.targets and provider in SKIP_KV_CACHE_PROVIDERS:
        skip = "kv_cache"
    return fusion.Policy(
        target=target,
        skip=skip,
        gqa=target in FuseGroupQueryAttention.targets and provider in GQA_PROVIDERS,
        threads=threads if provider in THREADED_PROVIDERS else 1,
        sdpa_transposed=provider in TRANSPOSED_SDPA_PROVIDERS,
        **settings,
    )
