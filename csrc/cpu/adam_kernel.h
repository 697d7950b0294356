// Shared declarations of the CPU Adam/AdamW kernel: the job description handed from the
// Python binding to the per-ISA implementations, and the dispatch entry points.
//
// The job is plain data (no functions, no torch types) so every translation unit can see it
// without an ODR hazard: each ISA translation unit compiles its own copy of the math with its
// own function-level target attribute (see adam_impl.h) and exports exactly one function.
#pragma once

#include <cstdint>

namespace fusedist_cpu {

// Element type codes shared with fusedist/optim/_cpu_adam.py.
enum DType : int { kFloat32 = 0, kBFloat16 = 1, kFloat16 = 2, kNone = -1 };

// Instruction-set paths, narrowest first; shared with the Python side.
enum Isa : int { kScalar = 0, kAvx2 = 1, kAvx512 = 2 };

// How weight decay enters the update.
enum DecayMode : int { kNoDecay = 0, kL2 = 1, kDecoupled = 2 };

// Per-step scalars, already rounded to float the way torch rounds its Python-double scalars
// (each computed in double, then converted once).
struct AdamCoeffs {
  float inv_scale;      // gradient unscale factor (1 when absent)
  float clip_signed;    // clip coefficient, negated for maximize (negation is exact)
  float weight_decay;   // L2 mode: g += weight_decay * w
  float decay_factor;   // decoupled mode: w *= 1 - lr * weight_decay
  float lerp_weight;    // 1 - beta1: exp_avg.lerp_(g, 1 - beta1)
  float lerp_weight_c;  // 1 - (1 - beta1), used when the lerp weight is >= 0.5
  bool lerp_small;      // |1 - beta1| < 0.5: torch's lerp picks its formula on this test
  float beta2;
  float one_minus_beta2;
  float bias_correction2_sqrt;
  float eps;
  float neg_step_size;  // -lr / (1 - beta1^step)
  int decay_mode;       // DecayMode
};

// A list of tensors updated by one call. weights[i] is what Adam updates in place: the FP32
// master when masters are given, otherwise the parameter itself (fp32, bf16 or fp16; a
// half-precision parameter is widened to fp32, updated, and rounded back). copies[i], when
// copies is non-null, receives the new weight rounded to copy_dtype (the model parameter
// next to an FP32 master).
struct AdamJob {
  void* const* weights;
  const void* const* grads;
  float* const* exp_avgs;
  float* const* exp_avg_sqs;
  void* const* copies;  // may be nullptr
  const int64_t* sizes;
  int weight_dtype;
  int grad_dtype;
  int copy_dtype;  // kNone when copies is nullptr
  AdamCoeffs c;
};

// Update elements [begin, end) of tensor `index`. One function per compiled ISA; the AVX2 and
// AVX-512 ones exist only when the compiler accepted their target attributes.
void adam_span_scalar(const AdamJob& job, int64_t index, int64_t begin, int64_t end);
void adam_span_avx2(const AdamJob& job, int64_t index, int64_t begin, int64_t end);
void adam_span_avx512(const AdamJob& job, int64_t index, int64_t begin, int64_t end);

// Element-type conversion with the same rounding as the kernel's copy-out (for tests and for
// copying FP32 masters into half-precision parameters).
void convert_scalar(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n);
void convert_avx2(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n);
void convert_avx512(const void* src, int src_dtype, void* dst, int dst_dtype, int64_t n);

// Which ISA paths were compiled in (the compiler accepted the target attributes).
bool compiled_avx2();
bool compiled_avx512();

}  // namespace fusedist_cpu
