// Python binding of the CPU kernels: fusedist._cpu_ops.
//
// Tensors arrive as raw addresses (tensor.data_ptr()) with sizes and dtype codes, so this
// module never includes a torch header and does not depend on torch's C++ ABI. Input checks
// that need tensor metadata (device, contiguity, shapes) are done by the Python caller
// (fusedist/optim/_cpu_adam.py); this side checks what it can see: list lengths and codes.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>

#ifdef _OPENMP
#include <omp.h>
#endif

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

#include "adam_kernel.h"

namespace py = pybind11;

namespace fusedist_cpu {
namespace {

// Elements per unit of parallel work: ~1 MB of fp32 Adam traffic, large enough to amortize
// scheduling, small enough that a thread slowed by another process on its core does not hold
// up the step (pieces are handed out dynamically). A multiple of 64 so every piece boundary
// stays vector- and cache-line-aligned relative to the tensor start.
constexpr int64_t kPieceElems = 1 << 15;

struct CpuFeatures {
  bool avx2 = false;    // AVX2 + FMA + F16C, with the OS saving YMM state
  bool avx512 = false;  // AVX-512F on top of that, with the OS saving ZMM/opmask state
};

#if defined(__x86_64__) || defined(__i386__)
uint64_t read_xcr0() {
  uint32_t lo, hi;
  __asm__ volatile("xgetbv" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<uint64_t>(hi) << 32) | lo;
}
#endif

CpuFeatures detect_features() {
  CpuFeatures f;
#if defined(__x86_64__) || defined(__i386__)
  unsigned a, b, c, d;
  if (!__get_cpuid(1, &a, &b, &c, &d)) return f;
  const bool osxsave = c & (1u << 27), avx = c & (1u << 28), fma = c & (1u << 12),
             f16c = c & (1u << 29);
  if (!(osxsave && avx)) return f;
  const uint64_t xcr0 = read_xcr0();
  const bool ymm_saved = (xcr0 & 0x6) == 0x6;
  const bool zmm_saved = (xcr0 & 0xE6) == 0xE6;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d)) return f;
  const bool avx2 = b & (1u << 5), avx512f = b & (1u << 16);
  f.avx2 = ymm_saved && avx2 && fma && f16c;
  f.avx512 = f.avx2 && zmm_saved && avx512f;
#endif
  return f;
}

const CpuFeatures& features() {
  static const CpuFeatures f = detect_features();
  return f;
}

bool isa_usable(int isa) {
  switch (isa) {
    case kScalar: return true;
    case kAvx2: return compiled_avx2() && features().avx2;
    case kAvx512: return compiled_avx512() && features().avx512;
    default: return false;
  }
}

int best_isa() {
  if (isa_usable(kAvx512)) return kAvx512;
  if (isa_usable(kAvx2)) return kAvx2;
  return kScalar;
}

const char* isa_name(int isa) {
  switch (isa) {
    case kAvx512: return "avx512";
    case kAvx2: return "avx2";
    default: return "scalar";
  }
}

int resolve_isa(int requested) {
  if (requested < 0) return best_isa();
  if (requested > kAvx512) throw std::invalid_argument("unknown ISA code " + std::to_string(requested));
  if (!isa_usable(requested)) {
    const bool compiled = requested == kAvx2 ? compiled_avx2() : compiled_avx512();
    throw std::invalid_argument(std::string("the ") + isa_name(requested) +
                                " path is not available here (" +
                                (compiled ? "this CPU lacks the instructions"
                                          : "the compiler could not build it") +
                                "); the widest available path is " + isa_name(best_isa()));
  }
  return requested;
}

using SpanFn = void (*)(const AdamJob&, int64_t, int64_t, int64_t);

SpanFn span_fn(int isa) {
  switch (isa) {
    case kAvx512: return adam_span_avx512;
    case kAvx2: return adam_span_avx2;
    default: return adam_span_scalar;
  }
}

void check_dtype(int code, const char* what, bool allow_none) {
  if ((code == kNone && allow_none) || code == kFloat32 || code == kBFloat16 || code == kFloat16) return;
  throw std::invalid_argument(std::string(what) + " dtype code " + std::to_string(code) +
                              " is not one of 0 (float32), 1 (bfloat16), 2 (float16)");
}

float read_scalar(uintptr_t address, float absent) {
  return address ? *reinterpret_cast<const float*>(address) : absent;
}

struct Piece {
  int64_t tensor, begin, end;
};

// Returns false (and writes nothing) when *found_inf is non-zero or NaN.
bool adam_step(const std::vector<uintptr_t>& weights, const std::vector<uintptr_t>& grads,
               const std::vector<uintptr_t>& exp_avgs, const std::vector<uintptr_t>& exp_avg_sqs,
               const std::vector<uintptr_t>& copies, const std::vector<int64_t>& sizes,
               int weight_dtype, int grad_dtype, int copy_dtype, double lr, double beta1,
               double beta2, double eps, double weight_decay, bool decoupled, int64_t step,
               bool bias_correction, bool maximize, uintptr_t inv_scale, uintptr_t clip_coef,
               uintptr_t found_inf, int isa, int num_threads) {
  const size_t n = weights.size();
  if (grads.size() != n || exp_avgs.size() != n || exp_avg_sqs.size() != n || sizes.size() != n ||
      (!copies.empty() && copies.size() != n)) {
    throw std::invalid_argument("adam_step: weights, grads, exp_avgs, exp_avg_sqs, sizes (and "
                                "copies, when given) must have the same length");
  }
  check_dtype(weight_dtype, "weight", false);
  check_dtype(grad_dtype, "grad", false);
  check_dtype(copy_dtype, "copy", true);
  if (copies.empty() != (copy_dtype == kNone)) {
    throw std::invalid_argument("adam_step: copy_dtype must be -1 exactly when copies is empty");
  }
  if (!copies.empty() && weight_dtype != kFloat32) {
    throw std::invalid_argument("adam_step: copies need float32 weights (the FP32 masters)");
  }
  if (bias_correction && step < 1) {
    throw std::invalid_argument("adam_step: step must be >= 1 with bias correction (got " +
                                std::to_string(step) + ")");
  }
  const SpanFn span = span_fn(resolve_isa(isa));
  if (read_scalar(found_inf, 0.0f) != 0.0f) return false;  // also true for NaN

  // Scalars in double, rounded to float once, as torch rounds its Python-float scalars.
  AdamCoeffs c;
  c.inv_scale = read_scalar(inv_scale, 1.0f);
  const float clip = read_scalar(clip_coef, 1.0f);
  c.clip_signed = maximize ? -clip : clip;
  c.weight_decay = static_cast<float>(weight_decay);
  c.decay_factor = static_cast<float>(1.0 - lr * weight_decay);
  c.decay_mode = weight_decay == 0.0 ? kNoDecay : (decoupled ? kDecoupled : kL2);
  c.lerp_weight = static_cast<float>(1.0 - beta1);
  c.lerp_small = std::fabs(c.lerp_weight) < 0.5f;
  c.lerp_weight_c = 1.0f - c.lerp_weight;
  c.beta2 = static_cast<float>(beta2);
  c.one_minus_beta2 = static_cast<float>(1.0 - beta2);
  c.eps = static_cast<float>(eps);
  double step_size = lr, bc2_sqrt = 1.0;
  if (bias_correction) {
    const double t = static_cast<double>(step);
    step_size = lr / (1.0 - std::pow(beta1, t));
    bc2_sqrt = std::pow(1.0 - std::pow(beta2, t), 0.5);
  }
  c.neg_step_size = static_cast<float>(-step_size);
  c.bias_correction2_sqrt = static_cast<float>(bc2_sqrt);

  AdamJob job;
  job.weights = reinterpret_cast<void* const*>(weights.data());
  job.grads = reinterpret_cast<const void* const*>(grads.data());
  job.exp_avgs = reinterpret_cast<float* const*>(exp_avgs.data());
  job.exp_avg_sqs = reinterpret_cast<float* const*>(exp_avg_sqs.data());
  job.copies = copies.empty() ? nullptr : reinterpret_cast<void* const*>(copies.data());
  job.sizes = sizes.data();
  job.weight_dtype = weight_dtype;
  job.grad_dtype = grad_dtype;
  job.copy_dtype = copy_dtype;
  job.c = c;

  std::vector<Piece> pieces;
  for (size_t t = 0; t < n; ++t) {
    for (int64_t b = 0; b < sizes[t]; b += kPieceElems) {
      pieces.push_back({static_cast<int64_t>(t), b, std::min(sizes[t], b + kPieceElems)});
    }
  }
  const int64_t count = static_cast<int64_t>(pieces.size());
  int64_t total = 0;
  for (size_t t = 0; t < n; ++t) total += sizes[t];
  py::gil_scoped_release no_gil;
#ifdef _OPENMP
  // A thread per kPieceElems elements at most: waking a worker costs more than a small step
  // (and much more when another process holds its core).
  const int64_t useful = (total + kPieceElems - 1) / kPieceElems;
  const int threads = static_cast<int>(std::min<int64_t>(std::max(num_threads, 1), useful));
  if (threads > 1) {
#pragma omp parallel for schedule(dynamic, 1) num_threads(threads)
    for (int64_t k = 0; k < count; ++k) span(job, pieces[k].tensor, pieces[k].begin, pieces[k].end);
    return true;
  }
#else
  (void)num_threads;
#endif
  for (int64_t k = 0; k < count; ++k) span(job, pieces[k].tensor, pieces[k].begin, pieces[k].end);
  return true;
}

void convert(uintptr_t src, int src_dtype, uintptr_t dst, int dst_dtype, int64_t n, int isa) {
  check_dtype(src_dtype, "source", false);
  check_dtype(dst_dtype, "destination", false);
  const int resolved = resolve_isa(isa);
  py::gil_scoped_release no_gil;
  auto* s = reinterpret_cast<const void*>(src);
  auto* d = reinterpret_cast<void*>(dst);
  if (resolved == kAvx512) {
    convert_avx512(s, src_dtype, d, dst_dtype, n);
  } else if (resolved == kAvx2) {
    convert_avx2(s, src_dtype, d, dst_dtype, n);
  } else {
    convert_scalar(s, src_dtype, d, dst_dtype, n);
  }
}

std::vector<std::string> available_isas() {
  std::vector<std::string> out;
  for (int isa = kScalar; isa <= kAvx512; ++isa) {
    if (isa_usable(isa)) out.push_back(isa_name(isa));
  }
  return out;
}

}  // namespace
}  // namespace fusedist_cpu

PYBIND11_MODULE(_cpu_ops, m) {
  using namespace fusedist_cpu;
  m.doc() = "fusedist C++ CPU kernels (multi-tensor Adam/AdamW with AVX-512/AVX2/scalar paths)";
  m.def("adam_step", &adam_step, py::arg("weights"), py::arg("grads"), py::arg("exp_avgs"),
        py::arg("exp_avg_sqs"), py::arg("copies"), py::arg("sizes"), py::arg("weight_dtype"),
        py::arg("grad_dtype"), py::arg("copy_dtype"), py::arg("lr"), py::arg("beta1"),
        py::arg("beta2"), py::arg("eps"), py::arg("weight_decay"), py::arg("decoupled"),
        py::arg("step"), py::arg("bias_correction"), py::arg("maximize"), py::arg("inv_scale"),
        py::arg("clip_coef"), py::arg("found_inf"), py::arg("isa"), py::arg("num_threads"),
        "One Adam/AdamW step over a list of tensors given by address; returns False (and "
        "writes nothing) when *found_inf is non-zero.");
  m.def("convert", &convert, py::arg("src"), py::arg("src_dtype"), py::arg("dst"),
        py::arg("dst_dtype"), py::arg("n"), py::arg("isa"),
        "Copy n elements converting dtype with the kernel's rounding (round-to-nearest-even).");
  m.def("available_isas", &available_isas, "ISA paths usable on this CPU with this build.");
  m.def("best_isa", []() { return std::string(isa_name(best_isa())); });
  m.def("compiled_isas", []() {
    std::vector<std::string> out{"scalar"};
    if (compiled_avx2()) out.push_back("avx2");
    if (compiled_avx512()) out.push_back("avx512");
    return out;
  });
  m.attr("ISA_CODES") = py::dict(py::arg("scalar") = static_cast<int>(kScalar),
                                 py::arg("avx2") = static_cast<int>(kAvx2),
                                 py::arg("avx512") = static_cast<int>(kAvx512));
}
