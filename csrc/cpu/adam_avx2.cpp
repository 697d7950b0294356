// AVX2 + FMA + F16C path (8 floats per register). The target is set per function (the
// FUSEDIST_TARGET attribute), never with a global -m flag, so this file compiles on any x86
// compiler that knows the attribute and the code only runs after a CPUID check.
// FUSEDIST_CPU_NO_AVX2 is defined by setup.py when the compiler rejects the attribute.
#include "adam_kernel.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(FUSEDIST_CPU_NO_AVX2)

#include <immintrin.h>

#define FUSEDIST_TARGET __attribute__((target("avx,avx2,fma,f16c")))

namespace fusedist_cpu {
namespace {

struct Vec {
  using reg = __m256;
  static constexpr int W = 8;
  FUSEDIST_TARGET static reg set1(float x) { return _mm256_set1_ps(x); }
  FUSEDIST_TARGET static reg add(reg a, reg b) { return _mm256_add_ps(a, b); }
  FUSEDIST_TARGET static reg sub(reg a, reg b) { return _mm256_sub_ps(a, b); }
  FUSEDIST_TARGET static reg mul(reg a, reg b) { return _mm256_mul_ps(a, b); }
  FUSEDIST_TARGET static reg div(reg a, reg b) { return _mm256_div_ps(a, b); }
  FUSEDIST_TARGET static reg sqrt(reg a) { return _mm256_sqrt_ps(a); }

  template <int D>
  FUSEDIST_TARGET static reg load(const void* base, int64_t i) {
    if (D == kFloat32) return _mm256_loadu_ps(static_cast<const float*>(base) + i);
    const __m128i h =
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(static_cast<const uint16_t*>(base) + i));
    if (D == kBFloat16) return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
    return _mm256_cvtph_ps(h);
  }

  template <int D>
  FUSEDIST_TARGET static void store(void* base, int64_t i, reg x) {
    if (D == kFloat32) {
      _mm256_storeu_ps(static_cast<float*>(base) + i, x);
      return;
    }
    __m128i* dst = reinterpret_cast<__m128i*>(static_cast<uint16_t*>(base) + i);
    if (D == kFloat16) {
      _mm_storeu_si128(dst, _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
      return;
    }
    // bf16, round-to-nearest-even on the bits; NaN -> 0x7FC0 (as torch's scalar conversion).
    const __m256i u = _mm256_castps_si256(x);
    const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(u, 16), _mm256_set1_epi32(1));
    __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(u, _mm256_set1_epi32(0x7FFF)), lsb), 16);
    const __m256i nan = _mm256_castps_si256(_mm256_cmp_ps(x, x, _CMP_UNORD_Q));
    r = _mm256_blendv_epi8(r, _mm256_set1_epi32(0x7FC0), nan);
    // Values are < 2^16, so the unsigned-saturating pack is exact; packing the two 128-bit
    // halves against each other keeps the element order.
    _mm_storeu_si128(dst, _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1)));
  }
};

}  // namespace
}  // namespace fusedist_cpu

#include "adam_impl.h"

namespace fusedist_cpu {

bool compiled_avx2() { return true; }

FUSEDIST_TARGET void adam_span_avx2(const AdamJob& job, int64_t index, int64_t begin, int64_t end) {
  adam_span_any(job, index, begin, end);
}

FUSEDIST_TARGET void convert_avx2(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
  convert_any(src, src_dtype, dst, dst_dtype, n);
}

}  // namespace fusedist_cpu

#else  // no AVX2 path compiled

namespace fusedist_cpu {
bool compiled_avx2() { return false; }
void adam_span_avx2(const AdamJob& job, int64_t index, int64_t begin, int64_t end) {
  adam_span_scalar(job, index, begin, end);
}
void convert_avx2(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
  convert_scalar(src, src_dtype, dst, dst_dtype, n);
}
}  // namespace fusedist_cpu

#endif
