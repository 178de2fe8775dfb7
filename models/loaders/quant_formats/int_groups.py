"""Group-quantized integer weights (GPTQ, AWQ, compressed-tensors' pack-quantized) onto the
on-device formats of `models.quant`: unpacking int32 words, and integer codes with group
scales and zero points mapped onto `q4` (4 bits) or `q8` (8 bits, symmetric) row form.

Every format here dequantizes as w = (q - z) * scale per group of G input features. `q4`
keeps the codes as they are (two a byte), one scale and zero per block of G (a multiple of
32; channel-wise: block = K) and zero = -z * scale. That product needs up to 15 mantissa
bits, so an asymmetric format keeps float32 zeros (exact: q * scale + zero then equals
(q - z) * scale in float32); a symmetric one (z = 8, a power of two) keeps float16 zeros,
exactly. `q8` keeps q - 128 as int8 (symmetric 8-bit only: other zero points do not fit).
"""

from __future__ import annotations

import numpy as np

from models.quant import Q4_BLOCK, QuantFormat, pack_q4_rows

SUPPORTED_BITS = (4, 8)


def group_format(bits: int, group: int, symmetric: bool, where: str) -> QuantFormat:
    """The on-device format of `bits`-bit codes in groups of `group` (-1 or 0: one group per
    output channel).

    Raises:
        ValueError: Bits other than 4 or 8, a group that is not a multiple of 32, or 8-bit
            asymmetric codes (their q - z does not fit int8); `where` names the field.
    """
    if bits not in SUPPORTED_BITS:
        raise ValueError(f"{where}: bits={bits} is not supported (supported: 4, 8)")
    if group not in (-1, 0) and (group <= 0 or group % Q4_BLOCK):
        raise ValueError(f"{where}: group_size={group} is not supported (a multiple of "
                         f"{Q4_BLOCK}, or -1 for one group per output channel)")
    block = 0 if group in (-1, 0) else group
    if bits == 8:
        if not symmetric:
            raise ValueError(f"{where}: asymmetric 8-bit weights (sym=false) are not "
                             f"supported (their codes minus zero points do not fit int8)")
        return QuantFormat("q8", block)
    return QuantFormat("q4", block, "float16" if symmetric else "float32")


def unpack_int32(packed: np.ndarray, bits: int, axis: int,
                 order: tuple[int, ...] | None = None) -> np.ndarray:
    """Codes u8 from int32 words holding 32 / bits each along `axis`: bit slot i (bits
    [bits * i, bits * (i + 1))) holds value i of the word's run, or value `order[i]` (AWQ's
    interleave)."""
    per = 32 // bits
    words = np.moveaxis(np.asarray(packed).view(np.uint32), axis, -1)
    slot_of = np.arange(per) if order is None else np.argsort(order)  # value j's slot
    shifts = slot_of.astype(np.uint32) * np.uint32(bits)
    codes = (words[..., None] >> shifts) & np.uint32((1 << bits) - 1)
    codes = codes.reshape(*words.shape[:-1], words.shape[-1] * per).astype(np.uint8)
    return np.moveaxis(codes, -1, axis)


def check_shape(arr: np.ndarray, want: tuple[int, ...], tensor: str, field: str) -> None:
    """ValueError naming the tensor and the field when `arr` is not shaped `want`."""
    if tuple(arr.shape) != tuple(want):
        raise ValueError(f"quantized tensor {tensor!r}: {field} has shape {tuple(arr.shape)}, "
                         f"expected {tuple(want)}")


def to_rows(fmt: QuantFormat, codes: np.ndarray, scales: np.ndarray,
            zero_points: np.ndarray) -> dict[str, np.ndarray]:
    """Row-form leaves of `fmt` from codes u8[N, K], group scales [N, G] and integer zero
    points [N, G] (w = (q - z) * scale)."""
    scales16 = np.asarray(scales).astype(np.float16)
    if fmt.kind == "q8":  # symmetric: z = 128 (checked by the caller's format)
        return {"qweight": (codes.astype(np.int16) - 128).astype(np.int8), "scales": scales16}
    zero = -zero_points.astype(np.float32) * scales16.astype(np.float32)
    return {"qweight": pack_q4_rows(codes), "scales": scales16,
            "zeros": zero.astype(fmt.zero_dtype)}

