"""Groupwise weight-only quantization of expert weights (8/4/3/2 bits), Fate's INT4/INT2 scheme.

What it is: pure functions, tensors in and tensors out, that quantize an expert's weights into
packed uint8 codes plus one fp16 scale and one fp16 zero per group (`quantize`, `pack`,
`unpack`, `QuantizedTensor.dequantize`); byte counts for the memory planner that need no tensor
(`quantized_nbytes`, `expert_nbytes`); and the reconstruction error of a spec (`reconstruction_error`). It runs on
any torch device (plain torch ops). The policy saying which precision an expert travels or rests at is
`policy.py`; a quality evaluator that needs no runtime is `surgery.py`.

What it is not: the store, the transfer engine or the offloaded block; those hold
`QuantizedTensor`s, move them with `.to(device, non_blocking=True)` and call `.dequantize()` on
the device before the expert computes. There is no fused low-bit matmul kernel here.

Format (all groups run along the LAST dim, so a group never straddles two rows and a slice of
rows -- one expert of a fused [E, 2I, H] tensor -- quantizes exactly as the whole tensor does):
  w[..., j]  ~=  code[..., j] * scale[..., j // g] + zero[..., j // g]
  * `zero` is the value of code 0 (a float offset, the group minimum for min-max), not an
    integer zero-point: dequantization is one multiply-add.
  * scale and zero are fp16. For min-max they are rounded outward (zero down, scale up) before the
    codes are computed from them, so every element stays within the grid and |w - w_hat| <=
    scale/2 holds with the stored fp16 scale.
  * Inputs must be finite with max |w| <= 65504 (the fp16 maximum): `quantize` refuses NaN/inf
    weights (they would poison their group) and larger ones (a group's zero below -65504, or its
    span / (2^b - 1) above 65504, overflows fp16 and the group dequantizes to NaN) with a ValueError
    naming the tensor. The rule is on max |w|, not on the spec, so a tensor is accepted or refused
    at every bit width alike. Scale and zero are not widened for such a tensor, because the byte
    counts and the packed slots of `transfer.PackedSlots` assume 2-byte fp16 for both.
  * Packing runs over the flattened codes in row-major order; every 8 codes form one
    little-endian integer of 8*b bits written as b bytes (code i sits at bits [b*i, b*i+b)).
    So 4-bit is 2 codes per byte (low nibble first), 2-bit is 4 codes per byte (lowest bits
    first), 3-bit is 8 codes in 3 bytes, 8-bit is the codes themselves. Below 8 bits a tail of
    fewer than 8 codes is zero-padded, so packed bytes = ceil(numel / 8) * b (numel at 8 bits).
  * Bytes of one tensor: ceil(numel/8)*b + 2 * 2 * numel/g  (packed + fp16 scale + fp16 zero);
    int4/g64 is 4.5 bits per weight (0.281 of fp16), int2/g32 is 3.0 bits (0.1875 of fp16).

`refine=True` adds HQQ's half-quadratic refinement of the zero (the proximal solver of Badri &
Shaji 2023 as in hqq 0.2.8 `optimize_weights_proximal_legacy`: lp-norm 0.7, beta 10, <= 20
iterations; the scale stays min-max). Unlike hqq, which stops when the mean error of the whole
tensor stops falling, each group here stops on its own and keeps its best zero, so quantizing
one expert equals the matching slice of quantizing the fused tensor. HQQ trades a larger worst-case error for a smaller
mean error, so the scale/2 bound does not hold under `refine`.

Library decision (evaluated here on CPU, torch 2.13, no CUDA):
  * hqq 0.2.8.post1 installs (needs `termcolor`, and pulls accelerate/einops/hub/tqdm) and its
    pure-torch path quantizes and bit-packs 8/4/3/2 bits on CPU. We did not adopt it: its packing
    runs down the row axis of a [numel/g, g] view, with layouts that depend on the tensor's shape
    (4-bit needs an even number of groups, 3-bit packs 10 codes into int32 words padded to whole
    multiples of 10 groups, so bytes are not `numel*b/8`), its metadata is a free-form dict with
    scales in the compute dtype, it mutates global state and prints, and its packing layout has
    changed between minor versions -- all things a store that persists bytes and a planner that
    counts them must pin down. The algorithm we need from it is ~25 lines (min-max + the
    proximal zero update), reproduced below and checked against hqq on random weights while
    deciding (64x128x256 Gaussian weights, hqq with fp32 scales): 96.7% (8-bit) to 99.96% (2-bit)
    of min-max codes are identical, the rest one step apart from our fp16 rounding of scale and
    zero; mean |error| is within 1% of hqq's for min-max and for refine at 8/4/3/2 bits.
  * torchao 0.18 targets CUDA kernels (its int4 weight-only layouts need CUDA/tinygemm, int2/int3
    only via the uintx prototype); optimum-quanto 0.2.7 offers qint2/qint4/qint8 but no 3-bit and
    is in maintenance mode. Neither gives a plain CPU packer with 3-bit and an exact byte count.
  So this module writes its own ~200 lines and tests them against a brute-force reference.
"""
from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace
from typing import Iterable, Mapping

import torch
import torch.nn.functional as F

SUPPORTED_BITS = (2, 3, 4, 8)
REASONS = ("cache", "prefetch", "prefill_low", "miss")
_SCALE_DTYPE = torch.float16  # scale and zero storage; 2 bytes each per group
_FP16_MAX = float(torch.finfo(_SCALE_DTYPE).max)  # 65504: the largest |w| a tensor may hold to be quantized


def _as_int(value, what: str, allowed: str) -> int:
    """value as a plain int; TypeError naming `what` for floats, bools, strings and other non-integers."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"{what} must be an int, got {value!r} ({type(value).__name__}); allowed: {allowed}")
    return int(value)


def _check_bits(bits: int, what: str = "bits") -> int:
    """bits as a plain int; TypeError unless an integer, ValueError unless a supported width."""
    bits = _as_int(bits, what, f"one of {SUPPORTED_BITS}")
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{what}={bits} is not supported; use one of {SUPPORTED_BITS}")
    return bits


# --- specs --------------------------------------------------------------------------------
@dataclass(frozen=True)
class QuantSpec:
    """How one tensor is quantized: bits per weight, weights per group (along the last dim)."""

    bits: int  # 2, 3, 4 or 8
    group_size: int  # weights sharing one scale/zero; must divide the tensor's last dim
    refine: bool = False  # HQQ half-quadratic refinement of the zero (slower; lower mean error)

    def __post_init__(self):
        # numpy ints are accepted and stored as plain ints, so equal specs hash equal
        object.__setattr__(self, "bits", _check_bits(self.bits, "QuantSpec bits"))
        group_size = _as_int(self.group_size, "QuantSpec group_size", "a positive int such as 32, 64 or 128")
        if group_size < 1:
            raise ValueError(f"QuantSpec group_size={group_size} is not allowed; group_size must be a positive int "
                             f"(weights sharing one scale/zero along the last dim, e.g. 32, 64 or 128)")
        object.__setattr__(self, "group_size", group_size)
        if not isinstance(self.refine, bool):
            raise TypeError(f"QuantSpec refine must be True or False, got {self.refine!r} "
                            f"({type(self.refine).__name__})")

    @classmethod
    def preset(cls, name: str) -> "QuantSpec":
        """A named spec: int8, int4 (g64, Fate's cache), int3, int2 (g32, Fate's I/O), *_hqq refined."""
        if name not in _SPEC_PRESETS:
            raise ValueError(f"unknown QuantSpec preset {name!r}; known: {sorted(_SPEC_PRESETS)}")
        return _SPEC_PRESETS[name]

    @property
    def bits_per_weight(self) -> float:
        """Average stored bits per weight including the fp16 scale and zero."""
        return self.bits + 32 / self.group_size


_SPEC_PRESETS = {
    "int8": QuantSpec(8, 64),
    "int4": QuantSpec(4, 64),  # Fate reference code: group 64 for INT4
    "int3": QuantSpec(3, 64),
    "int2": QuantSpec(2, 32),  # Fate reference code: group 32 for INT2
    "int4_hqq": QuantSpec(4, 64, refine=True),
    "int3_hqq": QuantSpec(3, 64, refine=True),
    "int2_hqq": QuantSpec(2, 32, refine=True),
}


# --- packing ------------------------------------------------------------------------------
def packed_nbytes(numel: int, bits: int) -> int:
    """Bytes that `pack` writes for numel codes of the given width (8 codes -> `bits` bytes)."""
    bits = _check_bits(bits)
    return numel if bits == 8 else math.ceil(numel / 8) * bits


def pack(q: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack integer codes in [0, 2^bits) (any shape, row-major) into a flat uint8 tensor."""
    bits = _check_bits(bits)
    codes = q.reshape(-1)
    if codes.numel() and (int(codes.min()) < 0 or int(codes.max()) >= 2**bits):
        raise ValueError(f"codes must lie in [0, {2**bits}) to pack at {bits} bits, "
                         f"got [{int(codes.min())}, {int(codes.max())}]")
    if bits == 8:
        return codes.to(torch.uint8)
    n = codes.numel()
    pad = (-n) % 8
    c = F.pad(codes.to(torch.int32), (0, pad)).view(-1, 8)  # (U, 8) one unit = 8 codes
    word = c[:, 0].clone()  # (U,) 8*bits <= 32 bits; bit 31 may wrap the sign, masked on read
    for i in range(1, 8):
        word |= c[:, i] << (bits * i)
    out = torch.stack([(word >> (8 * k)) & 0xFF for k in range(bits)], dim=1)  # (U, bits)
    return out.to(torch.uint8).reshape(-1)


def unpack(packed: torch.Tensor, bits: int, numel: int) -> torch.Tensor:
    """Codes [numel] (uint8) from `pack`'s output; the inverse of `pack`."""
    bits = _check_bits(bits)
    if packed.numel() != packed_nbytes(numel, bits):
        raise ValueError(f"{packed.numel()} packed bytes do not hold {numel} {bits}-bit codes "
                         f"(expected {packed_nbytes(numel, bits)})")
    if bits == 8:
        return packed.reshape(-1)[:numel]
    b = packed.reshape(-1, bits).to(torch.int32)  # (U, bits)
    word = b[:, 0].clone()  # (U,)
    for k in range(1, bits):
        word |= b[:, k] << (8 * k)
    mask = (1 << bits) - 1
    c = torch.stack([(word >> (bits * i)) & mask for i in range(8)], dim=1)  # (U, 8)
    return c.to(torch.uint8).reshape(-1)[:numel]


# --- quantized tensors --------------------------------------------------------------------
@dataclass
class QuantizedTensor:
    """Packed codes plus per-group fp16 scale and zero of one weight tensor."""

    packed: torch.Tensor  # (packed_nbytes(numel, bits),) uint8
    scale: torch.Tensor  # (*shape[:-1], shape[-1] // g) fp16
    zero: torch.Tensor  # (*shape[:-1], shape[-1] // g) fp16, the value of code 0
    shape: tuple[int, ...]
    spec: QuantSpec

    @property
    def numel(self) -> int:
        """Number of weights represented."""
        return math.prod(self.shape)

    def nbytes(self) -> int:
        """Exact bytes of packed + scale + zero."""
        return sum(t.numel() * t.element_size() for t in (self.packed, self.scale, self.zero))

    def codes(self) -> torch.Tensor:
        """Unpacked integer codes, shaped like the original tensor (uint8)."""
        return unpack(self.packed, self.spec.bits, self.numel).view(self.shape)

    def dequantize(self, dtype: torch.dtype = torch.float32, out: torch.Tensor | None = None) -> torch.Tensor:
        """The reconstructed weight tensor (computed in float32, returned in dtype or written to out)."""
        g = self.spec.group_size
        codes = unpack(self.packed, self.spec.bits, self.numel).view(-1, g).float()  # (G, g)
        w = codes * self.scale.reshape(-1, 1).float() + self.zero.reshape(-1, 1).float()  # (G, g)
        if out is None:
            return w.view(self.shape).to(dtype)
        if tuple(out.shape) != self.shape:
            raise ValueError(f"out has shape {tuple(out.shape)}, expected {self.shape}")
        return out.copy_(w.view(self.shape))  # e.g. a slot of a fused [E, 2I, H] buffer on the device

    def to(self, device: torch.device | str, non_blocking: bool = False) -> "QuantizedTensor":
        """A copy on device (the packed bytes travel, not the dequantized weights)."""
        move = lambda t: t.to(device, non_blocking=non_blocking)  # noqa: E731
        return replace(self, packed=move(self.packed), scale=move(self.scale), zero=move(self.zero))

    def pin_memory(self) -> "QuantizedTensor":
        """A copy in page-locked host memory, for asynchronous host-to-device copies."""
        return replace(self, packed=self.packed.pin_memory(), scale=self.scale.pin_memory(),
                       zero=self.zero.pin_memory())


def _check_shape(shape: tuple[int, ...], spec: QuantSpec) -> None:
    """ValueError unless groups of spec.group_size tile the last dim of shape."""
    if len(shape) == 0 or shape[-1] % spec.group_size != 0:
        raise ValueError(f"group_size {spec.group_size} does not divide the last dim of shape {tuple(shape)}; "
                         f"groups run along the last (input) dim")


def _round_fp16(x: torch.Tensor, direction: float) -> torch.Tensor:
    """x (float32) rounded to fp16 toward direction (-inf or +inf), so the grid still covers.

    Steps one fp16 ulp on the int16 bit pattern (sign-magnitude), which works on every device.
    """
    h = x.to(_SCALE_DTYPE)
    off = h.float() < x if direction > 0 else h.float() > x  # nearest rounding went the wrong way
    bits = h.view(torch.int16).to(torch.int32)
    away_from_zero = (h > 0) == (direction > 0)  # moving toward direction grows |h|
    stepped = torch.where(away_from_zero, bits + 1, bits - 1)
    tiny = 1 if direction > 0 else -32767  # +-smallest subnormal (0x0001 / 0x8001) from zero
    stepped = torch.where(h == 0, torch.full_like(bits, tiny), stepped)
    return torch.where(off, stepped.to(torch.int16).view(_SCALE_DTYPE), h)


def _hqq_zero(w: torch.Tensor, inv_scale: torch.Tensor, zero_q: torch.Tensor, qmax: int,
              lp_norm: float = 0.7, beta: float = 10.0, iters: int = 20) -> torch.Tensor:
    """HQQ proximal update of the code-space zero-point zero_q [G, 1]; each group stops on its own."""
    best = torch.full_like(zero_q, float("inf"))  # (G, 1) best mean |error| so far
    best_zero = zero_q  # (G, 1) the zero that reached it
    active = torch.ones_like(zero_q, dtype=torch.bool)  # (G, 1) groups still improving
    for _ in range(iters):
        q = torch.round(w * inv_scale + zero_q).clamp(0, qmax)  # (G, g)
        err = w - (q - zero_q) / inv_scale  # (G, g)
        shrunk = torch.sign(err) * (err.abs() - err.abs().pow(lp_norm - 1) / beta).clamp_min(0)  # (G, g)
        new_zero = torch.mean(q - (w - shrunk) * inv_scale, dim=1, keepdim=True)  # (G, 1)
        cur = err.abs().mean(dim=1, keepdim=True)  # (G, 1) error of the current zero
        active = active & (cur < best)
        best = torch.where(active, cur, best)
        best_zero = torch.where(active, zero_q, best_zero)
        zero_q = torch.where(active, new_zero, zero_q)
        if not active.any():
            break
    return best_zero


def _check_quantizable(x: torch.Tensor, shape: tuple[int, ...], name: str | None) -> None:
    """ValueError unless every value of x is finite and |x| fits the fp16 scale/zero of the format.

    Widening scale/zero for such a tensor is not an option: `QuantizedTensor`, `quantized_nbytes`,
    `expert_nbytes` and the packed slots of `transfer.PackedSlots` all count and lay out 2-byte
    fp16 scales and zeros, so a tensor beyond the fp16 range is refused instead.
    """
    label = f"tensor {name!r}" if name else "a tensor"
    finite = torch.isfinite(x)  # (G, g)
    if not bool(finite.all()):
        n_bad = int((~finite).sum())
        first = tuple(int(i) for i in torch.unravel_index((~finite).reshape(-1).int().argmax(), shape))
        raise ValueError(f"cannot quantize {label} of shape {shape}: {n_bad} of {x.numel()} values are "
                         f"non-finite (NaN or inf), the first at index {first}; only finite weights can be "
                         f"quantized (a NaN/inf would poison its whole group). Check the checkpoint it came from.")
    amax = float(x.abs().amax()) if x.numel() else 0.0
    if amax > _FP16_MAX:
        raise ValueError(f"cannot quantize {label} of shape {shape}: its max |w| = {amax:.6g} exceeds the fp16 "
                         f"range ({_FP16_MAX:g}) of the per-group scale and zero, which this format stores as fp16 "
                         f"(QuantizedTensor, quantized_nbytes and transfer.PackedSlots rely on it). Keep this "
                         f"tensor unquantized (spec None, e.g. via QuantPolicy.layer_overrides) or rescale it so "
                         f"that max |w| <= {_FP16_MAX:g}.")


@torch.no_grad()
def quantize(w: torch.Tensor, spec: QuantSpec, name: str | None = None) -> QuantizedTensor:
    """Quantize w groupwise along its last dim (asymmetric min-max, HQQ-refined if spec.refine).

    ValueError (naming `name` when given) for non-finite weights or max |w| beyond fp16's 65504.
    """
    if not isinstance(spec, QuantSpec):
        raise TypeError(f"spec={spec!r}: give a QuantSpec (e.g. QuantSpec(4, 64) or QuantSpec.preset('int4')), not "
                        f"a {type(spec).__name__}")
    if not isinstance(w, torch.Tensor):
        raise TypeError(f"quantize takes a torch.Tensor of weights, got a {type(w).__name__}; convert it first "
                        "(torch.from_numpy(w) for a numpy array)")
    if not w.dtype.is_floating_point:
        raise TypeError(f"quantize takes floating-point weights (float32/bfloat16/float16), got dtype {w.dtype}; "
                        "quantizing ids, masks or codes is meaningless")
    shape = tuple(w.shape)
    _check_shape(shape, spec)
    qmax = 2 ** spec.bits - 1
    x = w.detach().float().reshape(-1, spec.group_size)  # (G, g)
    _check_quantizable(x, shape, name)
    lo, hi = x.amin(dim=1, keepdim=True), x.amax(dim=1, keepdim=True)  # (G, 1)
    if spec.refine:
        span = hi - lo
        inv_scale = torch.where(span > 0, qmax / span, torch.ones_like(span)).clamp(max=2e4)  # (G, 1) fp16-safe
        zero_q = _hqq_zero(x, inv_scale, -lo * inv_scale, qmax)  # (G, 1)
        scale = (1.0 / inv_scale).to(_SCALE_DTYPE)  # (G, 1)
        zero = (-zero_q / inv_scale).to(_SCALE_DTYPE)  # (G, 1) value of code 0
    else:
        zero = _round_fp16(lo, -math.inf)  # (G, 1) <= lo
        scale = _round_fp16((hi - zero.float()) / qmax, math.inf)  # (G, 1) zero + qmax*scale >= hi
        scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # constant group: any scale works
    if not bool(torch.isfinite(scale).all() & torch.isfinite(zero).all()):  # e.g. an HQQ zero pushed past 65504
        label = f"tensor {name!r}" if name else "a tensor"
        raise ValueError(f"cannot quantize {label} of shape {shape} with {spec}: a group's scale or zero "
                         f"overflows fp16 (max {_FP16_MAX:g}); keep it unquantized or rescale its weights")
    codes = torch.round((x - zero.float()) / scale.float()).clamp(0, qmax)  # (G, g)
    group_shape = (*shape[:-1], shape[-1] // spec.group_size)
    return QuantizedTensor(pack(codes.to(torch.uint8), spec.bits), scale.view(group_shape),
                           zero.view(group_shape), shape, spec)


def quantized_nbytes(shape: Iterable[int], spec: QuantSpec) -> int:
    """Bytes of one quantized tensor of this shape (packed + fp16 scale + zero), without making it."""
    shape = tuple(shape)
    _check_shape(shape, spec)
    numel = math.prod(shape)
    return packed_nbytes(numel, spec.bits) + 2 * _SCALE_DTYPE.itemsize * (numel // spec.group_size)


# --- experts ------------------------------------------------------------------------------
def quantize_expert(weights: Mapping[str, torch.Tensor], spec: QuantSpec) -> dict[str, QuantizedTensor]:
    """Quantize each named matrix of one expert, e.g. {"gate": [I, H], "up": [I, H], "down": [H, I]}
    (`MoEAdapter.expert_weights`); `quant.experts.pack_expert` packs an `ExpertWeights` of any layout."""
    return {name: quantize(w, spec, name=name) for name, w in weights.items()}


def expert_nbytes(weights_or_shapes: Mapping[str, torch.Tensor | Iterable[int]], spec: QuantSpec | None,
                  dtype: torch.dtype = torch.float16) -> int:
    """Bytes of one expert at spec; spec None means unquantized (tensors' own dtype, else dtype). Entries
    named ``*_bias`` stay unquantized at every spec (biases travel beside the packed weights)."""
    total = 0
    for name, w in weights_or_shapes.items():
        shape = tuple(w.shape) if isinstance(w, torch.Tensor) else tuple(w)
        if spec is not None and not name.endswith("_bias"):
            total += quantized_nbytes(shape, spec)
        else:
            item = w.element_size() if isinstance(w, torch.Tensor) else dtype.itemsize
            total += math.prod(shape) * item
    return total


def reconstruction_error(w: torch.Tensor, spec: QuantSpec) -> dict:
    """Error of quantize(w, spec) against w: mean/max abs, relative Frobenius, bits per weight."""
    w_hat = quantize(w, spec).dequantize()
    err = (w_hat - w.float()).abs()
    return {
        "bits": spec.bits, "group_size": spec.group_size, "refine": spec.refine,
        "mean_abs": err.mean().item(), "max_abs": err.max().item(),
        "rel_fro": (torch.linalg.vector_norm(w_hat - w.float()) / torch.linalg.vector_norm(w.float())).item(),
        "bits_per_weight": 8 * quantized_nbytes(w.shape, spec) / w.numel(),
    }
