// The Adam/AdamW element math, written once and compiled once per instruction set.
//
// Each ISA translation unit (adam_scalar.cpp, adam_avx2.cpp, adam_avx512.cpp) defines
//   * FUSEDIST_TARGET: the function-level target attribute of that path (empty for scalar),
//   * a struct `Vec` with the register type, its width W, and load/store/arithmetic helpers,
// and then includes this file. Everything here lives in an anonymous namespace, so the three
// compiled copies never meet at link time: a linker that merged an AVX-512 copy of an inline
// function into the scalar path would crash older CPUs (the reason global -m flags are
// avoided too).
//
// Note [operation order]: every path performs the same IEEE float operations in the same
// order -- no fused multiply-add, no reciprocal approximations -- so the scalar, AVX2 and
// AVX-512 paths produce bitwise-identical results, and each follows the operation order of
// torch.optim.AdamW(foreach=True) step by step:
//   g  = ((grad * inv_scale) * clip) [negated for maximize]
//   L2:        g = g + weight_decay * w            (torch: grad.add(param, alpha=wd))
//   decoupled: w = w * (1 - lr * weight_decay)      (torch: param.mul_(1 - lr * wd))
//   m  = lerp(m, g, 1 - beta1)                      (torch's two-sided lerp formula)
//   v  = v * beta2 + ((1 - beta2) * g) * g          (torch: mul_(beta2).addcmul_(g, g, 1-beta2))
//   d  = sqrt(v) / sqrt(1 - beta2^t) + eps
//   w  = w + (-lr / (1 - beta1^t)) * (m / d)        (torch: addcdiv_(m, d, value=-step_size))
// torch's vectorized lerp uses an FMA, so results agree with torch to a few ulp, not bitwise.
#pragma once

#include "adam_kernel.h"

#ifndef FUSEDIST_TARGET
#error "define FUSEDIST_TARGET and struct Vec before including adam_impl.h"
#endif

namespace fusedist_cpu {
namespace {

template <int D>
struct ElemSize {
  static constexpr int value = D == kFloat32 ? 4 : 2;
};

// Loads/stores of the last, partial vector of a span go through a zero-padded stack buffer,
// so the tail runs the very same vector code as the body (bitwise-identical results) and no
// lane ever touches memory outside the tensor.
template <int D>
FUSEDIST_TARGET inline typename Vec::reg load_n(const void* base, int64_t i, int64_t n) {
  if (n == Vec::W) return Vec::template load<D>(base, i);
  constexpr int sz = ElemSize<D>::value;
  alignas(64) unsigned char buf[Vec::W * 4];
  const unsigned char* src = static_cast<const unsigned char*>(base) + i * sz;
  for (int64_t k = 0; k < Vec::W * sz; ++k) buf[k] = k < n * sz ? src[k] : 0;
  return Vec::template load<D>(buf, 0);
}

template <int D>
FUSEDIST_TARGET inline void store_n(void* base, int64_t i, int64_t n, typename Vec::reg x) {
  if (n == Vec::W) {
    Vec::template store<D>(base, i, x);
    return;
  }
  constexpr int sz = ElemSize<D>::value;
  alignas(64) unsigned char buf[Vec::W * 4];
  Vec::template store<D>(buf, 0, x);
  unsigned char* dst = static_cast<unsigned char*>(base) + i * sz;
  for (int64_t k = 0; k < n * sz; ++k) dst[k] = buf[k];
}

struct Broadcast {
  typename Vec::reg inv_scale, clip_signed, weight_decay, decay_factor, lerp_weight,
      lerp_weight_c, beta2, one_minus_beta2, bias_correction2_sqrt, eps, neg_step_size;
};

FUSEDIST_TARGET inline Broadcast broadcast(const AdamCoeffs& c) {
  Broadcast b;
  b.inv_scale = Vec::set1(c.inv_scale);
  b.clip_signed = Vec::set1(c.clip_signed);
  b.weight_decay = Vec::set1(c.weight_decay);
  b.decay_factor = Vec::set1(c.decay_factor);
  b.lerp_weight = Vec::set1(c.lerp_weight);
  b.lerp_weight_c = Vec::set1(c.lerp_weight_c);
  b.beta2 = Vec::set1(c.beta2);
  b.one_minus_beta2 = Vec::set1(c.one_minus_beta2);
  b.bias_correction2_sqrt = Vec::set1(c.bias_correction2_sqrt);
  b.eps = Vec::set1(c.eps);
  b.neg_step_size = Vec::set1(c.neg_step_size);
  return b;
}

// One vector (n == W) or the tail (n < W) of the update; see Note [operation order].
template <int GD, int WD, int CD, int DM, bool LERP_SMALL>
FUSEDIST_TARGET inline void adam_vector(const Broadcast& b, const void* grad, void* weight,
                                        float* exp_avg, float* exp_avg_sq, void* copy,
                                        int64_t i, int64_t n) {
  using V = Vec;
  typename V::reg g = V::mul(V::mul(load_n<GD>(grad, i, n), b.inv_scale), b.clip_signed);
  typename V::reg w = load_n<WD>(weight, i, n);
  if (DM == kDecoupled) {
    w = V::mul(w, b.decay_factor);
  } else if (DM == kL2) {
    g = V::add(g, V::mul(b.weight_decay, w));
  }
  typename V::reg m = load_n<kFloat32>(exp_avg, i, n);
  if (LERP_SMALL) {
    m = V::add(m, V::mul(b.lerp_weight, V::sub(g, m)));
  } else {
    m = V::sub(g, V::mul(V::sub(g, m), b.lerp_weight_c));
  }
  typename V::reg v = load_n<kFloat32>(exp_avg_sq, i, n);
  v = V::add(V::mul(v, b.beta2), V::mul(V::mul(b.one_minus_beta2, g), g));
  typename V::reg denom = V::add(V::div(V::sqrt(v), b.bias_correction2_sqrt), b.eps);
  w = V::add(w, V::mul(b.neg_step_size, V::div(m, denom)));
  store_n<kFloat32>(exp_avg, i, n, m);
  store_n<kFloat32>(exp_avg_sq, i, n, v);
  store_n<WD>(weight, i, n, w);
  if (CD != kNone) store_n<CD>(copy, i, n, w);
}

// How far ahead the span loop prefetches, in elements (2 KiB of fp32). Prefetches past the end
// of a tensor are harmless: a prefetch never faults.
constexpr int64_t kPrefetchAhead = 512;

// noinline: one symbol per instantiation and ISA, so the disassembly check
// (tests/test_cpu_adam_build.py) finds each path's hot loop; the call is once per piece.
template <int GD, int WD, int CD, int DM, bool LERP_SMALL>
FUSEDIST_TARGET __attribute__((noinline)) void adam_span_typed(const AdamJob& job, int64_t t, int64_t begin,
                                     int64_t end) {
  const Broadcast b = broadcast(job.c);
  const void* grad = job.grads[t];
  void* weight = job.weights[t];
  float* exp_avg = job.exp_avgs[t];
  float* exp_avg_sq = job.exp_avg_sqs[t];
  void* copy = CD != kNone ? job.copies[t] : nullptr;
  int64_t i = begin;
  for (; i + Vec::W <= end; i += Vec::W) {
    // Software prefetch kPrefetchAhead elements ahead on all four streams (into every cache
    // level: the lines are read, then written back, so a non-temporal hint halves the speed).
    // Measured +10% at 100M fp32 parameters on AVX-512 (hardware prefetch alone falls behind
    // on four interleaved streams). Skipped on the scalar path (one element per iteration).
    if (Vec::W > 1) {
      __builtin_prefetch(static_cast<const char*>(grad) + (i + kPrefetchAhead) * ElemSize<GD>::value, 0, 3);
      __builtin_prefetch(static_cast<const char*>(weight) + (i + kPrefetchAhead) * ElemSize<WD>::value, 1, 3);
      __builtin_prefetch(exp_avg + i + kPrefetchAhead, 1, 3);
      __builtin_prefetch(exp_avg_sq + i + kPrefetchAhead, 1, 3);
    }
    adam_vector<GD, WD, CD, DM, LERP_SMALL>(b, grad, weight, exp_avg, exp_avg_sq, copy, i,
                                            Vec::W);
  }
  if (i < end) {
    adam_vector<GD, WD, CD, DM, LERP_SMALL>(b, grad, weight, exp_avg, exp_avg_sq, copy, i,
                                            end - i);
  }
}

// Runtime codes -> template instantiation. Weight dtype is fp32 whenever a copy is written
// (the weight is then the FP32 master); a half-precision weight never has a copy.
template <int GD, int WD, int CD, int DM>
FUSEDIST_TARGET void dispatch_lerp(const AdamJob& j, int64_t t, int64_t b, int64_t e) {
  if (j.c.lerp_small) {
    adam_span_typed<GD, WD, CD, DM, true>(j, t, b, e);
  } else {
    adam_span_typed<GD, WD, CD, DM, false>(j, t, b, e);
  }
}

template <int GD, int WD, int CD>
FUSEDIST_TARGET void dispatch_decay(const AdamJob& j, int64_t t, int64_t b, int64_t e) {
  switch (j.c.decay_mode) {
    case kL2: return dispatch_lerp<GD, WD, CD, kL2>(j, t, b, e);
    case kDecoupled: return dispatch_lerp<GD, WD, CD, kDecoupled>(j, t, b, e);
    default: return dispatch_lerp<GD, WD, CD, kNoDecay>(j, t, b, e);
  }
}

template <int GD>
FUSEDIST_TARGET void dispatch_weight(const AdamJob& j, int64_t t, int64_t b, int64_t e) {
  if (j.weight_dtype == kFloat32) {
    switch (j.copy_dtype) {
      case kFloat32: return dispatch_decay<GD, kFloat32, kFloat32>(j, t, b, e);
      case kBFloat16: return dispatch_decay<GD, kFloat32, kBFloat16>(j, t, b, e);
      case kFloat16: return dispatch_decay<GD, kFloat32, kFloat16>(j, t, b, e);
      default: return dispatch_decay<GD, kFloat32, kNone>(j, t, b, e);
    }
  }
  if (j.weight_dtype == kBFloat16) return dispatch_decay<GD, kBFloat16, kNone>(j, t, b, e);
  return dispatch_decay<GD, kFloat16, kNone>(j, t, b, e);
}

FUSEDIST_TARGET void adam_span_any(const AdamJob& j, int64_t t, int64_t b, int64_t e) {
  switch (j.grad_dtype) {
    case kBFloat16: return dispatch_weight<kBFloat16>(j, t, b, e);
    case kFloat16: return dispatch_weight<kFloat16>(j, t, b, e);
    default: return dispatch_weight<kFloat32>(j, t, b, e);
  }
}

template <int SD, int DD>
FUSEDIST_TARGET void convert_typed(const void* src, void* dst, int64_t n) {
  int64_t i = 0;
  for (; i + Vec::W <= n; i += Vec::W) store_n<DD>(dst, i, Vec::W, load_n<SD>(src, i, Vec::W));
  if (i < n) store_n<DD>(dst, i, n - i, load_n<SD>(src, i, n - i));
}

template <int SD>
FUSEDIST_TARGET void convert_from(const void* src, void* dst, int dst_dtype, int64_t n) {
  switch (dst_dtype) {
    case kBFloat16: return convert_typed<SD, kBFloat16>(src, dst, n);
    case kFloat16: return convert_typed<SD, kFloat16>(src, dst, n);
    default: return convert_typed<SD, kFloat32>(src, dst, n);
  }
}

FUSEDIST_TARGET void convert_any(const void* src, int src_dtype, void* dst, int dst_dtype,
                                 int64_t n) {
  switch (src_dtype) {
    case kBFloat16: return convert_from<kBFloat16>(src, dst, dst_dtype, n);
    case kFloat16: return convert_from<kFloat16>(src, dst, dst_dtype, n);
    default: return convert_from<kFloat32>(src, dst, dst_dtype, n);
  }
}

}  // namespace
}  // namespace fusedist_cpu
