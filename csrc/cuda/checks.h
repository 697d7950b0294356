// The one checked boundary of the extension: every CUDA runtime and NCCL call goes through
// CUDA_CHECK / NCCL_CHECK, which turn a failure into a C++ exception carrying the call, the
// library's own error string and the source location. bindings.cpp maps the exception types
// to Python (fusedist._C.CudaError / fusedist._C.NcclError, both RuntimeError subclasses).
#pragma once

#include <stdexcept>
#include <string>

#include <cuda_runtime_api.h>

#include "nccl_api.h"
#include "str.h"

namespace fusedist {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A synchronous NCCL failure, an asynchronous one found by polling, or a collective that did
// not finish within its timeout (after which the communicator is aborted).
struct NcclError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda_error(cudaError_t err, const char* call, const char* file,
                                          int line) {
  std::string msg = str("fusedist: CUDA call ", call, " failed: ", cudaGetErrorName(err), " (",
                        cudaGetErrorString(err), ") at ", file, ":", line);
  if (err == cudaErrorInsufficientDriver || err == cudaErrorNoDevice) {
    msg += ". No usable NVIDIA driver/GPU is visible to this process: the CUDA extension needs "
           "one at run time (it only needs nvcc to build).";
  }
  throw CudaError(msg);
}

[[noreturn]] inline void throw_nccl_error(ncclResult_t res, const char* call, const char* file,
                                          int line) {
  // Calls are spelled nccl().AllReduce(...) (the dlopen'ed table); report NCCL's own name.
  std::string name(call);
  if (name.rfind("nccl().", 0) == 0) name = "nccl" + name.substr(7);
  std::string msg = str("fusedist: NCCL call ", name, " failed with code ", static_cast<int>(res),
                        ": ", nccl().GetErrorString(res), " at ", file, ":", line);
  if (res == ncclUnhandledCudaError || res == ncclSystemError || res == ncclRemoteError) {
    msg += " (run with NCCL_DEBUG=WARN for NCCL's own diagnosis)";
  }
  throw NcclError(msg);
}

#define FUSEDIST_CUDA_CHECK(expr)                                              \
  do {                                                                         \
    cudaError_t fusedist_err_ = (expr);                                        \
    if (fusedist_err_ != cudaSuccess) {                                        \
      cudaGetLastError(); /* reset the (non-sticky) last-error state */ \
      ::fusedist::throw_cuda_error(fusedist_err_, #expr, __FILE__, __LINE__);   \
    }                                                                          \
  } while (0)

#define FUSEDIST_NCCL_CHECK(expr)                                            \
  do {                                                                       \
    ::fusedist::ncclResult_t fusedist_res_ = (expr);                         \
    if (fusedist_res_ != ::fusedist::ncclSuccess) {                          \
      ::fusedist::throw_nccl_error(fusedist_res_, #expr, __FILE__, __LINE__); \
    }                                                                        \
  } while (0)

// Makes `device` current for the lifetime of the guard and restores the previous device.
class DeviceGuard {
 public:
  explicit DeviceGuard(int device) {
    FUSEDIST_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != device) FUSEDIST_CUDA_CHECK(cudaSetDevice(device));
  }
  ~DeviceGuard() {
    int now = -1;
    if (cudaGetDevice(&now) == cudaSuccess && now != previous_) cudaSetDevice(previous_);
  }
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int previous_ = 0;
};

}  // namespace fusedist
