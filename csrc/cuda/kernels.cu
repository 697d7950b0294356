#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <stdexcept>
#include <string>

#include "checks.h"
#include "kernels.h"

namespace fusedist {
namespace {

template <typename T>
struct Compute {
  using type = float;
};
template <>
struct Compute<double> {
  using type = double;
};

// Grid-stride loop: one launch of a bounded grid covers any size.
template <typename T>
__global__ void scale_kernel(T* __restrict__ data, size_t count,
                             typename Compute<T>::type factor) {
  using C = typename Compute<T>::type;
  const size_t stride = static_cast<size_t>(blockDim.x) * gridDim.x;
  for (size_t i = static_cast<size_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < count;
       i += stride) {
    data[i] = static_cast<T>(static_cast<C>(data[i]) * factor);
  }
}

template <typename T>
void launch_typed(void* data, size_t count, double factor, cudaStream_t stream) {
  constexpr int kThreads = 256;
  // Enough blocks to fill any current GPU several times over; the grid-stride loop does the rest.
  const size_t wanted = (count + kThreads - 1) / kThreads;
  const unsigned blocks = static_cast<unsigned>(wanted < 4096 ? wanted : 4096);
  scale_kernel<T><<<blocks, kThreads, 0, stream>>>(static_cast<T*>(data), count,
                                                   static_cast<typename Compute<T>::type>(factor));
  FUSEDIST_CUDA_CHECK(cudaGetLastError());
}

}  // namespace

void check_scale_dtype(int dtype) {
  nccl_dtype_size(dtype);  // unknown codes get the full list of supported dtypes
  if (dtype != ncclFloat16 && dtype != ncclBfloat16 && dtype != ncclFloat32 &&
      dtype != ncclFloat64) {
    throw std::invalid_argument(std::string("fusedist: scaling (averaging) needs a floating "
                                            "dtype, got ") +
                                nccl_dtype_name(dtype) +
                                "; reduce integer buffers with op='sum' and no divide factor");
  }
}

void launch_scale(void* data, size_t count, int dtype, double factor, cudaStream_t stream) {
  check_scale_dtype(dtype);
  if (count == 0) return;
  switch (dtype) {
    case ncclFloat16:
      return launch_typed<__half>(data, count, factor, stream);
    case ncclBfloat16:
      return launch_typed<__nv_bfloat16>(data, count, factor, stream);
    case ncclFloat32:
      return launch_typed<float>(data, count, factor, stream);
    case ncclFloat64:
      return launch_typed<double>(data, count, factor, stream);
    default:
      check_scale_dtype(dtype);  // throws
  }
}

}  // namespace fusedist
