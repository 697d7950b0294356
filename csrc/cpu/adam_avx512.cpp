// AVX-512F path (16 floats per register); needs only the AVX-512 Foundation subset (the
// F16C conversions have 512-bit forms in AVX-512F). The target is set per function, never
// with a global -m flag (see adam_avx2.cpp). FUSEDIST_CPU_NO_AVX512 is defined by setup.py
// when the compiler rejects the attribute; the install then proceeds with the narrower paths.
#include "adam_kernel.h"

#if (defined(__x86_64__) || defined(__i386__)) && !defined(FUSEDIST_CPU_NO_AVX512)

#include <immintrin.h>

#define FUSEDIST_TARGET __attribute__((target("avx,avx2,fma,f16c,avx512f")))

namespace fusedist_cpu {
namespace {

struct Vec {
  using reg = __m512;
  static constexpr int W = 16;
  FUSEDIST_TARGET static reg set1(float x) { return _mm512_set1_ps(x); }
  FUSEDIST_TARGET static reg add(reg a, reg b) { return _mm512_add_ps(a, b); }
  FUSEDIST_TARGET static reg sub(reg a, reg b) { return _mm512_sub_ps(a, b); }
  FUSEDIST_TARGET static reg mul(reg a, reg b) { return _mm512_mul_ps(a, b); }
  FUSEDIST_TARGET static reg div(reg a, reg b) { return _mm512_div_ps(a, b); }
  FUSEDIST_TARGET static reg sqrt(reg a) { return _mm512_sqrt_ps(a); }

  template <int D>
  FUSEDIST_TARGET static reg load(const void* base, int64_t i) {
    if (D == kFloat32) return _mm512_loadu_ps(static_cast<const float*>(base) + i);
    const __m256i h = _mm256_loadu_si256(
        reinterpret_cast<const __m256i*>(static_cast<const uint16_t*>(base) + i));
    if (D == kBFloat16) return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(h), 16));
    return _mm512_cvtph_ps(h);
  }

  template <int D>
  FUSEDIST_TARGET static void store(void* base, int64_t i, reg x) {
    if (D == kFloat32) {
      _mm512_storeu_ps(static_cast<float*>(base) + i, x);
      return;
    }
    __m256i* dst = reinterpret_cast<__m256i*>(static_cast<uint16_t*>(base) + i);
    if (D == kFloat16) {
      _mm256_storeu_si256(dst, _mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT));
      return;
    }
    // bf16, round-to-nearest-even on the bits; NaN -> 0x7FC0. (Not VCVTNEPS2BF16: it
    // flushes denormals, which torch's conversion does not.)
    const __m512i u = _mm512_castps_si512(x);
    const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
    __m512i r = _mm512_srli_epi32(_mm512_add_epi32(_mm512_add_epi32(u, _mm512_set1_epi32(0x7FFF)), lsb), 16);
    const __mmask16 nan = _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    r = _mm512_mask_blend_epi32(nan, r, _mm512_set1_epi32(0x7FC0));
    _mm256_storeu_si256(dst, _mm512_cvtepi32_epi16(r));  // values < 2^16: truncation is exact
  }
};

}  // namespace
}  // namespace fusedist_cpu

#include "adam_impl.h"

namespace fusedist_cpu {

bool compiled_avx512() { return true; }

FUSEDIST_TARGET void adam_span_avx512(const AdamJob& job, int64_t index, int64_t begin, int64_t end) {
  adam_span_any(job, index, begin, end);
}

FUSEDIST_TARGET void convert_avx512(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
  convert_any(src, src_dtype, dst, dst_dtype, n);
}

}  // namespace fusedist_cpu

#else  // no AVX-512 path compiled

namespace fusedist_cpu {
bool compiled_avx512() { return false; }
void adam_span_avx512(const AdamJob& job, int64_t index, int64_t begin, int64_t end) {
  adam_span_avx2(job, index, begin, end);
}
void convert_avx512(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n) {
  convert_avx2(src, src_dtype, dst, dst_dtype, n);
}
}  // namespace fusedist_cpu

#endif
