"""ONNX Runtime sessions made, checked and run (:func:`make_session`, :func:`check_session`,
:func:`run`), and the execution provider resolved (:func:`resolve_provider`): see
:mod:`normexport.runtime`."""

from __future__ import annotations

import contextlib
import functools
import os
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

import onnx
import onnx_ir as ir
import onnxruntime as ort

from normexport.errors import EnvironmentProblem
from normexport.runtime.memory import give_back

CPU = "CPUExecutionProvider"
CUDA = "CUDAExecutionProvider"

#: Session graph optimization level that runs a model as written (ORT's own fusions off): what
#: parity compares, so that ONNX Runtime's rewrites are not part of the comparison.
AS_WRITTEN = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
#: ``--provider`` choices mapped to the ORT provider lists tried for them.
PROVIDERS = {"cpu": [CPU], "cuda": [CUDA, CPU]}


class ProviderUnavailable(EnvironmentProblem):
    """The requested execution provider could not be loaded by ONNX Runtime (exit 2: the
    machine lacks it, not a bug)."""


@contextlib.contextmanager
def _session_source(
    model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike,
) -> Iterator[bytes | str]:
    """What ``ort.InferenceSession`` is given for ``model``: a path wherever there is a file.

    A path is passed as it is, so ONNX Runtime resolves its external data and no model is ever
    one protobuf in memory. An onnx_ir model is written to a temporary folder (with external
    data) and opened from there; the folder is removed once the session has loaded it. Bytes
    and ModelProtos (small models built in code) are passed as bytes.
    """
    if isinstance(model, ir.Model):
        with tempfile.TemporaryDirectory(prefix="normexport-session-") as tmp:
            path = Path(tmp) / "model.onnx"
            ir.save(model, path, external_data="model.onnx.data", size_threshold_bytes=1024)
            yield str(path)
    elif isinstance(model, onnx.ModelProto):
        yield model.SerializeToString()
    elif isinstance(model, bytes):
        yield model
    else:
        yield os.fspath(model)


def make_session(
    model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike,
    provider: str = "cpu",
    *,
    optimization_level: ort.GraphOptimizationLevel = ort.GraphOptimizationLevel.ORT_ENABLE_ALL,
    optimized_model_path: str | None = None,
    spinning: bool = True,
    cuda_graph: bool = False,
    tf32: bool = True,
    disabled_optimizers: Sequence[str] = (),
    threads: int | None = None,
    quiet: bool = False,
    prepacking: bool = True,
    execution_order: ort.ExecutionOrder | None = None,
    external_data_folder: str | os.PathLike | None = None,
) -> ort.InferenceSession:
    """Create an inference session on one named execution provider.

    Args:
        model: a path to an .onnx file (its external data resolved from its folder), an
            onnx_ir model (written to a temporary folder first), or, for small models built in
            code, a ModelProto or serialized bytes.
        provider: ``"cpu"`` or ``"cuda"`` (see :data:`PROVIDERS`).
        optimization_level: ORT's session graph optimization level (ORT_ENABLE_ALL by default,
            what a deployment would use).
        optimized_model_path: if given, ORT writes the model after its session-time
            optimizations there, its tensors of 1 KiB or more in ``optimized_model_path`` +
            ``.data``.
        spinning: let ORT's intra-op threads spin-wait between runs. Sessions timed
            interleaved with other variants turn it off: spinning threads keep the cores busy
            after ``run`` returns and slow down whatever runs next.
        cuda_graph, tf32: CUDA only: capture the run as a CUDA graph and replay it (run it
            through :class:`BoundRun`; one session per input shape); compute float32 matrix
            products in TF32 (the provider's ``use_tf32``: on as deployed, off for the verdict).
        disabled_optimizers: names of ORT graph transformers to leave out, e.g.
            ``"SkipLayerNormFusion"`` (which turns Add + LayerNormalization back into
            SkipLayerNormalization under ORT_ENABLE_ALL).
        threads: intra-op threads (None: ORT's default, one per core); inter-op 1.
        quiet: ONNX Runtime logs nothing of a failure to load or run (the caller reports it).
        prepacking, execution_order, external_data_folder: see :func:`_memory_options`.

    Returns:
        The session; ``session.get_providers()[0]`` is the provider that was asked for.

    Raises:
        ValueError: ``provider`` is not one of :data:`PROVIDERS`.
        ProviderUnavailable: CUDA was asked for but did not load (ORT fell back to CPU).
    """
    providers = _providers(provider, cuda_graph, tf32)
    options = _session_options(optimization_level, optimized_model_path, spinning, threads, quiet)
    _memory_options(options, prepacking, execution_order, external_data_folder)
    with _session_source(model) as source:
        session = ort.InferenceSession(
            source,
            options,
            providers=providers,
            disabled_optimizers=list(disabled_optimizers) or None,
        )
    _check_provider(session, provider)
    return session


def check_session(
    model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike, provider: str = "cpu", **options
) -> ort.InferenceSession:
    """A session that runs ``model`` as written, for the verdict: graph optimizations off
    (:data:`AS_WRITTEN`), no spinning, no prepacking (its external data memory-mapped, so
    opening a GB model costs milliseconds and no anonymous memory; the numbers differ from a
    prepacked run's by float32 rounding only, and every model the verdict compares runs so),
    and ORT's priority-based execution order: under the default order the CPU provider runs
    the ``Cast`` nodes it inserts for half-precision weights (no float16 kernel) long before
    their consumers, and a float16 model's run held most of its weights in float32 at once
    (docs/memory.md). On CUDA, float32 matrix products in float32, not TF32 (``tf32=False``):
    with TF32 a raw export was judged to differ from PyTorch (docs/cuda.md,
    ``benchmarks/results/parity_cuda.json``); the verdict compares functions, not math modes.
    ``options``: more of :func:`make_session`'s keywords.

    Raises:
        see :func:`make_session`.
    """
    lean = {
        "prepacking": False,
        "execution_order": ort.ExecutionOrder.PRIORITY_BASED,
        "tf32": False,
    }
    options = {"optimization_level": AS_WRITTEN, "spinning": False, **lean} | options
    return make_session(model, provider, **options)


#: ORT's CPU transformer that stores float16 initializers read through a Cast as float32
#: (``ORT_ENABLE_ALL``): a float16 model's session then holds its weights at twice their size.
FP16_INITIALIZERS_TO_FP32 = "FuseFp16InitializerToFp32NodeTransformer"


def deployed_session(
    model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike,
    provider: str = "cpu",
    *,
    disabled_optimizers: Sequence[str] = (),
    **options,
) -> ort.InferenceSession:
    """A session that opens ``model`` as a deployment does (``ORT_ENABLE_ALL``: every graph
    transformer of ONNX Runtime runs on it, less ``disabled_optimizers``), lean for the checks:
    no spinning, nothing logged, the weights mapped, not prepacked, float16 initializers not
    widened (:data:`FP16_INITIALIZERS_TO_FP32` off) and CUDA's float32 products in float32
    (:func:`check_session`'s reasons), none of which moves the graph ONNX Runtime runs
    (docs/parity.md#judged-as-deployed). ``options``: more of :func:`make_session`'s keywords.

    Raises:
        see :func:`make_session`.
    """
    lean = {"spinning": False, "quiet": True, "prepacking": False, "tf32": False}
    disabled = [FP16_INITIALIZERS_TO_FP32, *disabled_optimizers]
    return make_session(model, provider, disabled_optimizers=disabled, **(lean | options))


def load_check(path: str | os.PathLike, provider: str = "cpu") -> None:
    """Open the model at ``path`` as a deployment would (:func:`deployed_session`) and free it:
    whether ONNX Runtime's optimizers accept it, at the cost of no copy of the weights.

    Raises:
        ProviderUnavailable: the provider does not load.
        whatever ONNX Runtime raises for a model it cannot load (its own error types).
    """
    deployed_session(path, provider)
    give_back()


class OnDemand:
    """An ONNX Runtime session of one model, opened on first use and freed by :meth:`close`:
    a run holds one model's weights at a time, and reopens a model only if asked for it again.

    Args:
        model, provider, options: :func:`check_session`'s arguments (the session's model,
            provider and keywords).
    """

    def __init__(
        self,
        model: ir.Model | onnx.ModelProto | bytes | str | os.PathLike,
        provider: str = "cpu",
        **options,
    ):
        self._model, self._provider, self._options = model, provider, options
        self._session: ort.InferenceSession | None = None

    def open(self) -> ort.InferenceSession:
        """The session, opened now if it is not open.

        Raises:
            see :func:`make_session`.
        """
        if self._session is None:
            self._session = check_session(self._model, self._provider, **self._options)
        return self._session

    def close(self) -> None:
        """Free the session (its weights and buffers, handed back to the system:
        :func:`normexport.runtime.memory.give_back`); the next use opens it again."""
        if self._session is not None:
            self._session = None
            give_back()


def _check_provider(session: ort.InferenceSession, provider: str) -> None:
    """Raise :class:`ProviderUnavailable` when ``session`` fell back from ``provider``."""
    if session.get_providers()[0] != PROVIDERS[provider][0]:
        raise ProviderUnavailable(
            f"{PROVIDERS[provider][0]} did not load (ONNX Runtime fell back to "
            f"{session.get_providers()[0]}); use --provider cpu, or install the CUDA libraries "
            "that onnxruntime-gpu needs"
        )


def _providers(provider: str, cuda_graph: bool, tf32: bool = True) -> list:
    """ORT's provider list for ``provider`` (see :func:`make_session`), with the CUDA
    provider's options ``enable_cuda_graph`` and ``use_tf32`` where they differ from its
    defaults.

    Raises:
        ValueError: an unknown provider, or a CUDA graph asked of another.
    """
    if provider not in PROVIDERS:
        raise ValueError(f"unknown provider {provider!r}: choose one of {sorted(PROVIDERS)}")
    if cuda_graph and provider != "cuda":
        raise ValueError("cuda_graph needs provider 'cuda'")
    providers: list = list(PROVIDERS[provider])
    options = {"enable_cuda_graph": "1"} if cuda_graph else {}
    if not tf32 and provider == "cuda":
        options["use_tf32"] = "0"
    if options:
        providers[0] = (CUDA, options)
    return providers


def _memory_options(
    options: ort.SessionOptions,
    prepacking: bool,
    execution_order: ort.ExecutionOrder | None,
    external_data_folder: str | os.PathLike | None,
) -> None:
    """Set :func:`make_session`'s memory options on ``options`` (docs/memory.md).

    Args:
        prepacking: let kernels repack constant weights at load, as a deployment runs. Off
            (``session.disable_prepacking``), the CPU provider memory-maps an external data
            file instead of copying the weights out of it: the load takes milliseconds instead
            of seconds per GB, the weights are page cache the kernel can evict (not anonymous
            memory), and each run is slower (the GEMM packs its operand per call).
        execution_order: ORT's node order (``session.execution_order``; None: its default).
        external_data_folder: where the external data of a model given as bytes or a
            ModelProto lies (``session.model_external_initializers_file_folder_path``): a graph
            that points into another model's external data file, opened without copying it.
    """
    if not prepacking:
        options.add_session_config_entry("session.disable_prepacking", "1")
    if execution_order is not None:
        options.execution_order = execution_order
    if external_data_folder is not None:
        options.add_session_config_entry(
            "session.model_external_initializers_file_folder_path", os.fspath(external_data_folder)
        )


def _session_options(
    optimization_level: ort.GraphOptimizationLevel,
    optimized_model_path: str | None,
    spinning: bool,
    threads: int | None,
    quiet: bool,
) -> ort.SessionOptions:
    """The session options of :func:`make_session` (its arguments of the same names)."""
    options = ort.SessionOptions()
    options.graph_optimization_level = optimization_level
    # errors only (the CUDA fallback is reported by us, not ORT); quiet: fatal only
    options.log_severity_level = 4 if quiet else 3
    if optimized_model_path:
        options.optimized_model_filepath = optimized_model_path
        # Its tensors go to an external data file beside it, as large models need.
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_file_name",
            Path(optimized_model_path).name + ".data",
        )
        options.add_session_config_entry(
            "session.optimized_model_external_initializers_min_size_in_bytes", "1024"
        )
    if not spinning:
        options.add_session_config_entry("session.intra_op.allow_spinning", "0")
    if threads is not None:
        options.intra_op_num_threads = threads
        options.inter_op_num_threads = 1
    return options


def resolve_provider(requested: str) -> tuple[str, str | None]:
    """Pick the provider for ``--provider auto|cpu|cuda``.

    ``auto`` takes CUDA when a CUDA session really loads, else CPU.

    Returns:
        ``(provider, note)``: provider is ``"cpu"`` or ``"cuda"``; note is a sentence for the
        report when CUDA was not used under ``auto`` (None otherwise).

    Raises:
        ProviderUnavailable: ``cuda`` was requested and does not load.
    """
    if requested == "cpu":
        return "cpu", None
    probe = _probe_model()
    ort.set_default_logger_severity(4)  # the failed CUDA load is reported by us, once
    try:
        make_session(probe, "cuda")
    except ProviderUnavailable as err:
        if requested == "cuda":
            raise ProviderUnavailable(f"--provider cuda: {err}") from None
        return "cpu", "CUDA was not available (the CUDA provider did not load): ran on CPU"
    finally:
        ort.set_default_logger_severity(3)
    return "cuda", None


@functools.cache
def max_opset() -> int:
    """The highest ai.onnx opset that both onnx and this ONNX Runtime load (a one-node model
    tried from onnx's newest opset down)."""
    for opset in range(onnx.defs.onnx_opset_version(), 6, -1):
        try:
            make_session(_probe_model(opset), "cpu")
        except Exception:  # ORT's own error types: "opset N is not supported"
            continue
        return opset
    return 7


def _probe_model(opset: int = 17) -> onnx.ModelProto:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Relu", ["x"], ["y"])], "probe", [x], [y])
    return onnx.helper.make_model(
        graph, opset_imports=[onnx.helper.make_opsetid("", opset)], ir_version=8
    )
