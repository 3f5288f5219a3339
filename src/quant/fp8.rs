//! The two FP8 encodings (OCP FP8: E4M3 "fn" without infinities, and E5M2), encoded from f32 with
//! round-to-nearest-even and saturation, and the source element types (bf16, f16, f32) decoded to f32.

/// An FP8 element format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Fp8 {
    /// 1 sign, 4 exponent (bias 7), 3 mantissa bits; no infinities, NaN is S.1111.111; largest
    /// finite 448 (0x7e), smallest subnormal 2^-9 (0x01). torch.float8_e4m3fn.
    E4m3fn,
    /// 1 sign, 5 exponent (bias 15), 2 mantissa bits; IEEE-like (infinities 0x7c, NaNs above);
    /// largest finite 57344 (0x7b), smallest subnormal 2^-16 (0x01). torch.float8_e5m2.
    E5m2,
}

impl Fp8 {
    /// Mantissa bits.
    pub const fn mantissa_bits(self) -> u32 {
        match self {
            Fp8::E4m3fn => 3,
            Fp8::E5m2 => 2,
        }
    }

    /// Exponent bias.
    pub const fn bias(self) -> i32 {
        match self {
            Fp8::E4m3fn => 7,
            Fp8::E5m2 => 15,
        }
    }

    /// The largest finite magnitude (FP8_MAX): 448 or 57344.
    pub const fn max(self) -> f32 {
        match self {
            Fp8::E4m3fn => 448.0,
            Fp8::E5m2 => 57344.0,
        }
    }

    /// The code of the largest finite positive value.
    pub const fn max_code(self) -> u8 {
        match self {
            Fp8::E4m3fn => 0x7e,
            Fp8::E5m2 => 0x7b,
        }
    }

    /// The exponent of the largest finite value (emax of the OCP MX spec): 8 or 15.
    pub const fn max_exponent(self) -> i32 {
        match self {
            Fp8::E4m3fn => 8,
            Fp8::E5m2 => 15,
        }
    }

    /// The NaN every NaN input becomes: 0x7f in both formats (positive sign; the NaN a GPU's
    /// division produces is positive, whatever its operands).
    pub const NAN: u8 = 0x7f;

    /// Encodes `x`: NaN gives [`Fp8::NAN`]; a magnitude at or above [`Fp8::max`] (infinity included)
    /// gives the largest finite value of its sign (saturation); anything else is rounded to the nearest
    /// representable value, ties to the even code, and the sign is kept (so -0.0 and negative values
    /// that round to zero give 0x80). For |x| below FP8_MAX this is torch's `.to(torch.float8_*)` of
    /// an f32; above, torch gives NaN (e4m3fn) or infinity (e5m2) where this saturates, which is what
    /// quantizers get by clamping to +-FP8_MAX before that cast.
    pub fn encode(self, x: f32) -> u8 {
        if x.is_nan() {
            return Fp8::NAN;
        }
        let sign = if x.is_sign_negative() { 0x80u8 } else { 0 };
        let magnitude = x.abs();
        if magnitude >= self.max() {
            return sign | self.max_code();
        }
        let bits = magnitude.to_bits();
        let field = (bits >> 23) as i32;
        if field == 0 {
            // f32 zero or subnormal: far below half the smallest FP8 subnormal.
            return sign;
        }
        let m = self.mantissa_bits() as i32;
        let min_normal_exponent = 1 - self.bias();
        let exponent = (field - 127).max(min_normal_exponent);
        // |x| = significand * 2^(field - 127 - 23); the code counts units of 2^(exponent - m), so drop
        // the low `shift` bits of the significand, rounding to nearest even.
        let significand = u64::from((bits & 0x7f_ffff) | 0x80_0000);
        let shift = (exponent - m) - (field - 127 - 23);
        let units = round_shift_even(significand, shift as u32);
        // A code is ((exponent - min_normal_exponent) << m) + units, units counting the implicit bit:
        // a carry of the rounding into the next binade adds one to the exponent field by itself.
        let code = (((exponent - min_normal_exponent) as u64) << m) + units;
        sign | code as u8
    }

    /// The value of `code` as f32 (exact). NaN codes give a NaN, e5m2's infinities infinity.
    pub fn decode(self, code: u8) -> f32 {
        let sign = if code & 0x80 != 0 { -1.0f32 } else { 1.0 };
        let m = self.mantissa_bits();
        let field = i32::from((code & 0x7f) >> m);
        let mantissa = u32::from(code) & ((1 << m) - 1);
        let all_ones = (1i32 << (7 - m)) - 1;
        match self {
            Fp8::E4m3fn if field == all_ones && mantissa == (1 << m) - 1 => return f32::NAN,
            Fp8::E5m2 if field == all_ones => {
                return if mantissa == 0 { sign * f32::INFINITY } else { f32::NAN };
            }
            _ => {}
        }
        let (units, exponent) = match field {
            0 => (mantissa, 1 - self.bias()),
            _ => (mantissa | (1 << m), field - self.bias()),
        };
        sign * units as f32 * 2f32.powi(exponent - m as i32)
    }
}

/// `value >> shift`, rounded to nearest, ties to even.
fn round_shift_even(value: u64, shift: u32) -> u64 {
    if shift == 0 {
        return value;
    }
    if shift > 63 {
        return 0;
    }
    let kept = value >> shift;
    let rest = value & ((1u64 << shift) - 1);
    let half = 1u64 << (shift - 1);
    kept + u64::from(rest > half || (rest == half && kept & 1 == 1))
}

/// A source element type.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum SourceType {
    Bf16,
    F16,
    F32,
}

impl SourceType {
    /// Bytes per element.
    pub const fn size(self) -> u64 {
        match self {
            SourceType::Bf16 | SourceType::F16 => 2,
            SourceType::F32 => 4,
        }
    }

    /// The element at the start of `bytes` (little-endian), as f32 (exact for every type).
    pub fn decode(self, bytes: &[u8]) -> f32 {
        match self {
            SourceType::Bf16 => bf16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
            SourceType::F16 => f16_to_f32(u16::from_le_bytes([bytes[0], bytes[1]])),
            SourceType::F32 => f32::from_le_bytes([bytes[0], bytes[1], bytes[2], bytes[3]]),
        }
    }
}

/// A bf16 bit pattern as f32: the same bits in the high half (exact, NaN payloads kept).
pub fn bf16_to_f32(bits: u16) -> f32 {
    f32::from_bits(u32::from(bits) << 16)
}

/// An IEEE binary16 bit pattern as f32 (exact; a NaN stays a NaN with its sign).
pub fn f16_to_f32(bits: u16) -> f32 {
    let sign = u32::from(bits & 0x8000) << 16;
    let field = u32::from((bits >> 10) & 0x1f);
    let mantissa = u32::from(bits & 0x3ff);
    let magnitude = match (field, mantissa) {
        (0, 0) => 0,
        // Subnormal: mantissa * 2^-24, normalized for f32.
        (0, m) => {
            let top = 31 - m.leading_zeros(); // position of the leading 1, 0..=9
            let exponent = top as i32 - 24;
            (((exponent + 127) as u32) << 23) | ((m << (23 - top)) & 0x7f_ffff)
        }
        (0x1f, m) => 0x7f80_0000 | (m << 13),
        (f, m) => ((f + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(sign | magnitude)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The nearest finite code by search over every code (the independent formula): the smallest
    /// |x - value|, ties to the even code, saturating; NaN to 0x7f.
    fn nearest(format: Fp8, x: f32) -> u8 {
        if x.is_nan() {
            return Fp8::NAN;
        }
        let clamped = f64::from(x).clamp(-f64::from(format.max()), f64::from(format.max()));
        let mut best: Option<(f64, u8)> = None;
        for code in 0u8..=255 {
            let value = format.decode(code);
            if !value.is_finite() || (code & 0x80 != 0) != clamped.is_sign_negative() {
                continue;
            }
            let distance = (f64::from(value) - clamped).abs();
            best = match best {
                Some((d, c)) if d < distance || (d == distance && c & 1 == 0) => Some((d, c)),
                _ => Some((distance, code)),
            };
        }
        best.unwrap().1
    }

    #[test]
    fn torchs_documented_e4m3fn_values() {
        let f = Fp8::E4m3fn;
        assert_eq!(f.decode(0x7e), 448.0);
        assert_eq!(f.decode(0x01), 2f32.powi(-9));
        assert_eq!(f.decode(0x08), 2f32.powi(-6)); // smallest normal
        assert_eq!(f.decode(0x07), 0.875 * 2f32.powi(-6)); // largest subnormal
        assert_eq!(f.decode(0x38), 1.0);
        assert!(f.decode(0x7f).is_nan() && f.decode(0xff).is_nan());
        assert_eq!(f.encode(448.0), 0x7e);
        assert_eq!(f.encode(-448.0), 0xfe);
        assert_eq!(f.encode(1.0), 0x38);
        assert_eq!(f.encode(2f32.powi(-9)), 0x01);
        assert_eq!(f.encode(2f32.powi(-10)), 0x00); // the tie between 0 and 2^-9 goes to even 0
        assert_eq!(f.encode(1.5 * 2f32.powi(-10)), 0x01);
        assert_eq!(f.encode(-0.0), 0x80);
        assert_eq!(f.encode(1e-30), 0x00);
        assert_eq!(f.encode(-1e-30), 0x80);
        assert_eq!(f.encode(464.0), 0x7e); // saturates where torch's unclamped cast gives NaN
        assert_eq!(f.encode(f32::INFINITY), 0x7e);
        assert_eq!(f.encode(f32::NEG_INFINITY), 0xfe);
        assert_eq!(f.encode(f32::NAN), 0x7f);
        assert_eq!(f.encode(-f32::NAN), 0x7f);
        // 1.0625 lies halfway between 1.0 (0x38) and 1.125 (0x39): to even.
        assert_eq!(f.encode(1.0625), 0x38);
        assert_eq!(f.encode(1.1875), 0x3a);
        assert_eq!(f.encode(f32::from_bits(1.0625f32.to_bits() + 1)), 0x39);
    }

    #[test]
    fn e5m2_values() {
        let f = Fp8::E5m2;
        assert_eq!(f.decode(0x7b), 57344.0);
        assert_eq!(f.decode(0x01), 2f32.powi(-16));
        assert_eq!(f.decode(0x7c), f32::INFINITY);
        assert!(f.decode(0x7f).is_nan());
        assert_eq!(f.encode(57344.0), 0x7b);
        assert_eq!(f.encode(f32::INFINITY), 0x7b);
        assert_eq!(f.encode(-1e9), 0xfb);
        assert_eq!(f.encode(1.0), 0x3c);
        assert_eq!(f.encode(f32::NAN), 0x7f);
    }

    #[test]
    fn every_bf16_input_encodes_to_the_nearest_code() {
        for format in [Fp8::E4m3fn, Fp8::E5m2] {
            for bits in 0..=u16::MAX {
                let x = bf16_to_f32(bits);
                assert_eq!(format.encode(x), nearest(format, x), "{format:?} of bf16 {bits:#06x} ({x:e})");
            }
        }
    }

    #[test]
    fn f32_inputs_at_and_beside_every_rounding_boundary_encode_to_the_nearest_code() {
        for format in [Fp8::E4m3fn, Fp8::E5m2] {
            for code in 0u8..=0x7f {
                let (low, high) = (format.decode(code), format.decode(code.wrapping_add(1)));
                if !low.is_finite() || !high.is_finite() || code == format.max_code() {
                    continue;
                }
                let middle = ((f64::from(low) + f64::from(high)) / 2.0) as f32;
                for x in [middle, f32::from_bits(middle.to_bits() - 1), f32::from_bits(middle.to_bits() + 1)]
                {
                    for signed in [x, -x] {
                        assert_eq!(
                            format.encode(signed),
                            nearest(format, signed),
                            "{format:?} of {signed:e}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn every_f16_decodes_as_its_value() {
        for bits in 0..=u16::MAX {
            let got = f16_to_f32(bits);
            let (sign, field, mantissa) = (bits >> 15, (bits >> 10) & 0x1f, bits & 0x3ff);
            let magnitude = match field {
                0 => f64::from(mantissa) * 2f64.powi(-24),
                0x1f if mantissa == 0 => f64::INFINITY,
                0x1f => f64::NAN,
                f => (1.0 + f64::from(mantissa) / 1024.0) * 2f64.powi(i32::from(f) - 15),
            };
            let want = if sign == 1 { -magnitude } else { magnitude };
            if want.is_nan() {
                assert!(got.is_nan(), "{bits:#06x}");
            } else {
                assert_eq!(f64::from(got), want, "{bits:#06x}");
                assert_eq!(got.is_sign_negative(), sign == 1, "{bits:#06x}");
            }
        }
    }
}
