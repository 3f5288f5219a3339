"""The quantizing copy (refit_quantize_batch): bf16 / f16 / f32 matrices to FP8 codes with their
scales, per tensor, per row, per block (DeepSeek-V3's 128 x 128) or MXFP8, bit for bit as the
arithmetic in the header's comment of refit_quantize_batch says."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterable, Optional, Tuple

from ._args import items, tensor_like, wrong_type
from ._handle import borrow
from ._lib import (
    Arithmetic,
    Backend,
    Fp8,
    Granularity,
    QuantizationStruct,
    QuantizeJobStruct,
    SourceType,
    check,
    check_range,
    invalid_argument,
    lib,
    stream_value,
)

if TYPE_CHECKING:
    from .group import Group

DEFAULT_BLOCK = (128, 128)
MX_BLOCK = 32


@dataclass(frozen=True)
class Quantization:
    """A target FP8 format and a granularity; `block` (rows, cols) only for Granularity.BLOCK (None
    there means 128 x 128); `arithmetic` how fp32 scales and quotients are computed (Arithmetic:
    DEEPGEMM for vLLM's online block quantization, VLLM_CHANNEL for its online per-channel weights,
    VLLM_TENSOR for its online per-tensor weights; MXFP8 takes DIVIDE only)."""

    target: Fp8 = Fp8.E4M3FN
    granularity: Granularity = Granularity.BLOCK
    block: Optional[Tuple[int, int]] = None
    arithmetic: Arithmetic = Arithmetic.DIVIDE

    def block_shape(self, rows: int, cols: int) -> Tuple[int, int]:
        """The elements sharing one scale, for a rows x cols matrix."""
        if self.granularity == Granularity.TENSOR:
            return max(rows, 1), max(cols, 1)
        if self.granularity == Granularity.ROW:
            return 1, max(cols, 1)
        if self.granularity == Granularity.MXFP8:
            return 1, MX_BLOCK
        return self.block or DEFAULT_BLOCK

    def scale_grid(self, rows: int, cols: int) -> Tuple[int, int]:
        """Scales down and across: ceil(rows / block rows) x ceil(cols / block cols)."""
        block_rows, block_cols = self.block_shape(rows, cols)
        return -(-rows // block_rows), -(-cols // block_cols)

    @property
    def scale_size(self) -> int:
        """Bytes per scale: 4 (fp32), 1 for MXFP8 (e8m0)."""
        return 1 if self.granularity == Granularity.MXFP8 else 4


def fill_quantization(s, q: Quantization) -> None:
    """Writes `q` into the refit_quantization and arithmetic of `s` (a refit_quantize_job or a
    refit_need_quantization), checking each number's width (the library checks the rest)."""
    if q.granularity == Granularity.BLOCK:
        block = q.block or DEFAULT_BLOCK
    elif q.block is not None:
        raise invalid_argument(f"quantization.block is {q.block}; only Granularity.BLOCK takes a block")
    else:
        block = (0, 0)
    fields: QuantizationStruct = s.quantization
    fields.target = check_range(q.target, 32, "quantization.target")
    fields.granularity = check_range(q.granularity, 32, "quantization.granularity")
    fields.block_rows = check_range(block[0], 32, "quantization.block rows")
    fields.block_cols = check_range(block[1], 32, "quantization.block cols")
    s.arithmetic = check_range(q.arithmetic, 32, "quantization.arithmetic")


@dataclass
class QuantizeJob:
    """refit_quantize_job: rows x cols elements of `source_type` at `src` (`src_row_stride` elements
    apart) quantized to `dst` (`dst_row_stride` bytes apart) with scales at `scales` (a row-major
    grid, `scale_row_stride` scales apart; see Quantization.scale_grid)."""

    quantization: Quantization
    source_type: SourceType
    src: int
    rows: int
    cols: int
    src_row_stride: int
    dst: int
    dst_row_stride: int
    scales: int
    scale_row_stride: int

    def struct(self) -> QuantizeJobStruct:
        s = QuantizeJobStruct()
        fill_quantization(s, self.quantization)
        s.source_type = check_range(self.source_type, 32, "source_type")
        for field in ("src", "rows", "cols", "src_row_stride", "dst", "dst_row_stride", "scales", "scale_row_stride"):
            setattr(s, field, check_range(getattr(self, field), 64, field))
        return s


# The source type of each element type quantizing reads (torch's names, as refit.tensor.dtype_name
# gives them), and its bytes per element.
SOURCE_TYPES = {"bfloat16": SourceType.BF16, "float16": SourceType.F16, "float32": SourceType.F32}
SOURCE_SIZES = {SourceType.BF16: 2, SourceType.F16: 2, SourceType.F32: 4}


def tensor_job(source, destination, scales, quantization: Quantization = Quantization()) -> QuantizeJob:
    """The job quantizing a 2-D tensor `source` (bf16, f16 or f32; rows may be strided, elements
    contiguous) into `destination` (a 2-D tensor of one byte per element: uint8 or float8) with
    `scales` (2-D: the scale grid, or 1-D contiguous) as torch lays them out."""
    if not isinstance(quantization, Quantization):
        raise wrong_type("quantization", quantization, "a refit.quant.Quantization")
    matrix = ("shape", "dtype", "data_ptr", "element_size", "stride")
    source, destination = tensor_like(source, "source", matrix), tensor_like(destination, "destination", matrix)
    scales = tensor_like(scales, "scales", (*matrix, "numel"))
    if len(source.shape) != 2 or tuple(destination.shape) != tuple(source.shape):
        raise invalid_argument(
            f"source is {tuple(source.shape)} and destination {tuple(destination.shape)}; both must be the same 2-D shape"
        )
    kind = SOURCE_TYPES.get(str(source.dtype).rsplit(".", 1)[-1])
    if kind is None:
        raise invalid_argument(f"source dtype is {source.dtype}; expected bfloat16, float16 or float32")
    if destination.element_size() != 1:
        raise invalid_argument(f"destination dtype is {destination.dtype}; expected one byte per element")
    rows, cols = (int(n) for n in source.shape)
    for name, t in (("source", source), ("destination", destination)):
        if cols > 1 and t.stride(1) != 1:
            raise invalid_argument(f"{name} elements are not contiguous along a row (stride {t.stride()})")
    grid_rows, grid_cols = quantization.scale_grid(rows, cols)
    if scales.element_size() != quantization.scale_size or scales.numel() < grid_rows * grid_cols:
        raise invalid_argument(
            f"scales hold {scales.numel()} elements of {scales.element_size()} bytes; the scale grid needs "
            f"{grid_rows} x {grid_cols} of {quantization.scale_size}"
        )
    scale_stride = scales.stride(0) if len(scales.shape) == 2 else grid_cols
    return QuantizeJob(
        quantization,
        kind,
        source.data_ptr(),
        rows,
        cols,
        source.stride(0),
        destination.data_ptr(),
        destination.stride(0),
        scales.data_ptr(),
        scale_stride,
    )


def quantize_batch(group: Group, rank: int, jobs: Iterable[QuantizeJob], stream: object = None) -> None:
    """refit_quantize_batch: quantizes every job on `stream`, a stream of `rank`'s device (any form
    refit takes; None: torch's current stream of that device when torch uses CUDA, else its legacy
    default stream). CUDA: queued, not waited for (a stream being captured into a CUDA graph is
    RefitError UNSUPPORTED, nothing queued); host backend: complete on return. Raises RefitError
    with the library's status and message for a bad job (the message names jobs[i] and the
    field)."""
    structs = []
    for index, job in enumerate(items(jobs, "jobs")):
        if not isinstance(job, QuantizeJob):
            raise wrong_type(f"jobs[{index}]", job, "a refit.quant.QuantizeJob (see tensor_job)")
        structs.append(job.struct())
    array = (QuantizeJobStruct * len(structs))(*structs)
    rank = check_range(rank, 32, "rank")
    with borrow(group, "group", "group") as handle:
        stream_handle = stream_value(stream, group.device(rank), host=group.backend == Backend.HOST)
        check(lib.refit_quantize_batch(handle, rank, stream_handle, array, len(structs), 0))
