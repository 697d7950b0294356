// CUDA kernels of the extension (kernels.cu), callable from host code compiled by g++.
#pragma once

#include <cstddef>

#include <cuda_runtime_api.h>

namespace fusedist {

// data[i] *= factor for i < count, in place, on `stream`. `dtype` is an ncclDataType_t code
// of a floating type (float16, bfloat16, float32, float64); the product is computed in fp32
// (fp64 for float64) and rounded once. Throws std::invalid_argument for other dtypes.
void launch_scale(void* data, size_t count, int dtype, double factor, cudaStream_t stream);

// Throws std::invalid_argument unless launch_scale supports `dtype` (no device access).
void check_scale_dtype(int dtype);

}  // namespace fusedist
