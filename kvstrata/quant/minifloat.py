"""Unsigned small floats (``E?M?``) for 8- and 10-bit scale codes, encoded and decoded exactly.

A `MiniFloat` has ``mantissa_bits`` and normal binades ``2**emin`` to ``2**emax`` (the top one ends at
``max``), with IEEE-style subnormals below ``2**emin`` (code 0 is 0). Encoding rounds to nearest
(ties to even) and clamps to ``max``. Every step is exact in float32 (exponents read from the bits,
powers of two built from bits, integer codes), so CPU, CUDA and the Triton twins in
`kernel_encode`/`kernel_decode` give the same codes and values.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def pow2(e: torch.Tensor) -> torch.Tensor:
    """``2.0 ** e`` (float32) for int32 ``e`` in [-126, 127], built from its bits (exact)."""
    return ((e + 127) << 23).view(torch.float32)


@dataclass(frozen=True)
class MiniFloat:
    mantissa_bits: int
    emin: int
    emax: int

    @property
    def max(self) -> float:
        return 2.0**self.emax * (2 - 2.0**-self.mantissa_bits)

    def encode(self, r: torch.Tensor) -> torch.Tensor:
        """int32 code of the value nearest each element of float32 ``r >= 0`` (clamped to `max`)."""
        m = self.mantissa_bits
        r = r.to(torch.float32).clamp(0.0, self.max).contiguous()
        e = ((r.view(torch.int32) >> 23) - 127).clamp_(self.emin, self.emax)  # binade (0 -> emin)
        n = torch.round(r * pow2(m - e)).to(torch.int32)  # quanta of the binade, 0 .. 2**(m+1)
        # A normal binade: exponent field e - emin + 1, mantissa n - 2**m; a carry (n = 2**(m+1))
        # lands on the next binade by itself, and the lowest binade gives subnormal codes n < 2**m.
        return ((e - self.emin + 1) << m) + n - (1 << m)

    def decode(self, code: torch.Tensor) -> torch.Tensor:
        """float32 value of int32 codes."""
        m = self.mantissa_bits
        field = code >> m
        n = (code & ((1 << m) - 1)) + torch.where(field > 0, 1 << m, 0)
        return n.to(torch.float32) * pow2(field.clamp(min=1) - 1 + self.emin - m)

    @property
    def bits(self) -> int:
        """Bits of a code: the exponent field plus the mantissa."""
        return (self.emax - self.emin + 1).bit_length() + self.mantissa_bits
