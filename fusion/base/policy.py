"""The fusion policy of a run: what :func:`fusion.optimize` may emit and which of its exact
rewrites it makes, one typed value (:class:`Policy`) that a caller builds once per run and
gives every :func:`fusion.optimize` of that run. Its defaults are neutral: the choices that
depend on the execution provider the model will run on are the caller's.
"""

from __future__ import annotations

import dataclasses

#: What optimize() may emit: ``"ort"`` allows ONNX Runtime's contrib and default-domain ops,
#: ``"onnx"`` only standard ONNX ops of the model's opset.
TARGETS = ("ort", "onnx")


@dataclasses.dataclass(frozen=True)
class Policy:
    """The choices of one :func:`fusion.optimize` run, given whole (``optimize(model,
    policy)``) or field by field as its keywords; a pass reads the fields it declares
    (:attr:`fusion.base.FusionPass.option`, :attr:`fusion.base.FusionPass.settings`).

    Attributes:
        target: one of :data:`TARGETS`: ``"ort"`` may emit ONNX Runtime's contrib
            ops, ``"onnx"`` standard ops only.
        skip: fuse residual Add + norm into com.microsoft Skip(Simplified)LayerNormalization
            (:mod:`fusion.fuse_skip`), a speed choice per execution provider: True, False, or
            ``"kv_cache"`` (all only in a model with a KV cache, elsewhere only where the Skip
            op also absorbs a dense layer's bias Add and the norm alone reads the sum).
            Needs ``target="ort"``.
        attention: fuse attention and GELU into com.microsoft ops with onnxscript's rules
            (:mod:`fusion.fuse_attention`); None: for ``target="ort"`` only.
        gqa: fuse decoder attention into GroupQueryAttention (:mod:`fusion.fuse_gqa`); None:
            for ``target="ort"`` only.
        sdpa: fuse the attention left decomposed into ONNX's ``Attention``
            (:mod:`fusion.fuse_sdpa`); None: for both targets.
        threads: the intra-op threads of ONNX Runtime's CPU provider the model is made for
            (1 for any other provider): :mod:`fusion.fuse_sdpa` leaves an attention whose batch
            times heads is fewer, as the CPU kernel of ``Attention`` runs one thread per batch
            and head.
        sdpa_transposed: :mod:`fusion.fuse_sdpa` fuses YOLO's transposed attention (``q^T @ k``,
            ``v @ attn^T``) too, a speed choice per execution provider: False leaves it
            (``transposed_form``).
        last_rows: names of graph outputs of shape ``(batch, sequence, ...)`` to keep at their
            last position only (``(batch, 1, ...)``: a decoder's logits where only the next
            token is read): :mod:`fusion.prune_rows` writes the selection and moves it up. It
            changes the outputs' shape, so it is the user's choice, never a default.

    Raises:
        ValueError: ``target`` is not one of :data:`TARGETS`; ``skip``, ``attention``
            or ``gqa`` asked for without ``target="ort"``; ``skip`` neither a bool nor
            ``"kv_cache"``; ``threads`` below 1; ``sdpa_transposed`` not a bool;
            ``last_rows`` not a tuple of names.
    """

    target: str = "ort"
    skip: bool | str = False
    attention: bool | None = None
    gqa: bool | None = None
    sdpa: bool | None = None
    threads: int = 1
    sdpa_transposed: bool = True
    last_rows: tuple[str, ...] = ()

    def __post_init__(self):
        if self.target not in TARGETS:
            raise ValueError(f"unknown target {self.target!r}: choose one of {TARGETS}")
        if self.skip not in (True, False, "kv_cache"):
            raise ValueError(f"skip={self.skip!r}: give True, False or 'kv_cache'")
        for name in ("skip", "attention", "gqa"):
            if getattr(self, name) and self.target != "ort":
                raise ValueError(f"{name}=True emits com.microsoft ops: it needs target='ort'")
        if not (isinstance(self.threads, int) and self.threads >= 1):
            raise ValueError(f"threads={self.threads!r}: give a whole number of 1 or more")
        if not isinstance(self.sdpa_transposed, bool):
            raise ValueError(f"sdpa_transposed={self.sdpa_transposed!r}: give True or False")
        if not (
            isinstance(self.last_rows, tuple) and all(isinstance(n, str) for n in self.last_rows)
        ):
            raise ValueError(f"last_rows={self.last_rows!r}: give a tuple of output names")

    def without_attention(self) -> Policy:
        """This policy with no attention fusion of any kind (the autotuner's variant)."""
        return dataclasses.replace(self, attention=False, gqa=False, sdpa=False)
