// Portable path: one element at a time, with software fp32 <-> bf16/fp16 conversion. Used on
// CPUs without AVX2 (and on non-x86 machines); compiled without any target attribute, so
// the compiler may still auto-vectorize it for the baseline instruction set.
#include <cmath>
#include <cstdint>
#include <cstring>

#include "adam_kernel.h"

#define FUSEDIST_TARGET

namespace fusedist_cpu {
namespace {

inline uint32_t float_bits(float x) {
  uint32_t u;
  std::memcpy(&u, &x, 4);
  return u;
}

inline float bits_float(uint32_t u) {
  float x;
  std::memcpy(&x, &u, 4);
  return x;
}

// Round-to-nearest-even, NaN -> 0x7FC0: what torch's .to(torch.bfloat16) produces.
inline uint16_t float_to_bf16(float x) {
  if (std::isnan(x)) return 0x7FC0;
  const uint32_t u = float_bits(x);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

// IEEE binary16 round-to-nearest-even, overflow -> inf, NaN -> quiet NaN with the sign kept.
inline uint16_t float_to_fp16(float x) {
  const uint32_t u = float_bits(x);
  const uint16_t sign = static_cast<uint16_t>((u >> 16) & 0x8000u);
  const uint32_t a = u & 0x7FFFFFFFu;
  if (a > 0x7F800000u) return sign | 0x7E00u;  // NaN
  if (a >= 0x477FF000u) return sign | 0x7C00u;  // >= 65520 rounds to inf (ties to even)
  if (a >= 0x38800000u) {                        // normal half: rebias exponent by 127-15
    const uint32_t r = a - 0x38000000u;
    return sign | static_cast<uint16_t>((r + 0x0FFFu + ((r >> 13) & 1u)) >> 13);
  }
  if (a < 0x33000000u) return sign;  // below 2^-25: rounds to zero (2^-25 ties to even 0)
  // Subnormal half: the value is mant * 2^(e - 150); in units of 2^-24 that is
  // mant >> (126 - e), rounded to nearest even on the dropped bits.
  const uint32_t e = a >> 23;
  const uint32_t mant = (a & 0x007FFFFFu) | 0x00800000u;
  const uint32_t shift = 126u - e;  // 14..24
  uint32_t q = mant >> shift;
  const uint32_t rem = mant & ((1u << shift) - 1u);
  const uint32_t half = 1u << (shift - 1u);
  if (rem > half || (rem == half && (q & 1u))) ++q;
  return sign | static_cast<uint16_t>(q);
}

inline float fp16_to_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16;
  const uint32_t e = (h >> 10) & 0x1Fu;
  const uint32_t m = h & 0x3FFu;
  if (e == 0x1F) return bits_float(sign | 0x7F800000u | (m << 13));
  if (e == 0) {
    const float mag = static_cast<float>(m) * 5.9604644775390625e-08f;  // m * 2^-24, exact
    return sign ? -mag : mag;
  }
  return bits_float(sign | ((e + 112u) << 23) | (m << 13));
}

struct Vec {
  using reg = float;
  static constexpr int W = 1;
  static reg set1(float x) { return x; }
  static reg add(reg a, reg b) { return a + b; }
  static reg sub(reg a, reg b) { return a - b; }
  static reg mul(reg a, reg b) { return a * b; }
  static reg div(reg a, reg b) { return a / b; }
  static reg sqrt(reg a) { return std::sqrt(a); }

  template <int D>
  static reg load(const void* base, int64_t i) {
    if (D == kFloat32) return static_cast<const float*>(base)[i];
    const uint16_t h = static_cast<const uint16_t*>(base)[i];
    if (D == kBFloat16) return bits_float(static_cast<uint32_t>(h) << 16);
    return fp16_to_float(h);
  }

  template <int D>
  static void store(void* base, int64_t i, reg x) {
    if (D == kFloat32) {
      static_cast<float*>(base)[i] = x;
    } else if (D == kBFloat16) {
      static_cast<uint16_t*>(base)[i] = float_to_bf16(x);
    } else {
      static_cast<uint16_t*>(base)[i] = float_to_fp16(x);
    }
  }
};

}  // namespace
}  // namespace fusedist_cpu

#include "adam_impl.h"

namespace fusedist_cpu {

void adam_span_scalar(const AdamJob& job, int64_t index, int64_t begin, int64_t end) {
  adam_span_any(job, index, begin, end);
}

void convert_scalar(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
  convert_any(src, src_dtype, dst, dst_dtype, n);
}

}  // namespace fusedist_cpu
