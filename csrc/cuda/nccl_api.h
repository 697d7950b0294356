// The slice of the NCCL C API fusedist uses, declared by hand and reached through dlopen.
//
// Why not #include <nccl.h> and link -lnccl: the extension must build on machines without
// NCCL (CI has only nvcc) and must use the very libnccl that torch already loaded, so that
// one build serves every torch version. The declarations below follow nccl.h of NCCL 2.x;
// the enum values and the 128-byte unique id are part of NCCL's stable ABI.
#pragma once

#include <cstddef>
#include <string>

#include <cuda_runtime_api.h>

namespace fusedist {

typedef struct ncclComm* ncclComm_t;

constexpr int kNcclUniqueIdBytes = 128;
typedef struct {
  char internal[kNcclUniqueIdBytes];
} ncclUniqueId;

typedef enum {
  ncclSuccess = 0,
  ncclUnhandledCudaError = 1,
  ncclSystemError = 2,
  ncclInternalError = 3,
  ncclInvalidArgument = 4,
  ncclInvalidUsage = 5,
  ncclRemoteError = 6,
  ncclInProgress = 7,
} ncclResult_t;

typedef enum { ncclSum = 0, ncclProd = 1, ncclMax = 2, ncclMin = 3, ncclAvg = 4 } ncclRedOp_t;

typedef enum {
  ncclInt8 = 0,
  ncclUint8 = 1,
  ncclInt32 = 2,
  ncclUint32 = 3,
  ncclInt64 = 4,
  ncclUint64 = 5,
  ncclFloat16 = 6,
  ncclFloat32 = 7,
  ncclFloat64 = 8,
  ncclBfloat16 = 9,
} ncclDataType_t;

// Function table filled by load_nccl(). Every call goes through NCCL_CHECK (checks.h).
struct NcclApi {
  ncclResult_t (*GetVersion)(int* version);
  ncclResult_t (*GetUniqueId)(ncclUniqueId* id);
  ncclResult_t (*CommInitRank)(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank);
  ncclResult_t (*CommDestroy)(ncclComm_t comm);
  ncclResult_t (*CommAbort)(ncclComm_t comm);
  ncclResult_t (*CommGetAsyncError)(ncclComm_t comm, ncclResult_t* async_error);
  const char* (*GetErrorString)(ncclResult_t result);
  ncclResult_t (*AllReduce)(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                            ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*ReduceScatter)(const void* send, void* recv, size_t recv_count,
                                ncclDataType_t dtype, ncclRedOp_t op, ncclComm_t comm,
                                cudaStream_t stream);
  ncclResult_t (*AllGather)(const void* send, void* recv, size_t send_count, ncclDataType_t dtype,
                            ncclComm_t comm, cudaStream_t stream);
  ncclResult_t (*Broadcast)(const void* send, void* recv, size_t count, ncclDataType_t dtype,
                            int root, ncclComm_t comm, cudaStream_t stream);
};

// Load NCCL from `path` ("" means the default search: $FUSEDIST_NCCL_LIBRARY, else
// "libnccl.so.2", which resolves to the copy torch already loaded when there is one).
// Idempotent: the first successful load wins; later calls return it. Throws
// std::runtime_error naming the library and dlerror() when it cannot be loaded.
const NcclApi& load_nccl(const std::string& path = "");

// The loaded table; throws if load_nccl() has not succeeded yet.
const NcclApi& nccl();

// Path (or soname) NCCL was loaded from; "" when not loaded.
std::string nccl_library_path();

// Element size in bytes of an ncclDataType_t code; throws std::invalid_argument naming the
// code for values outside the table above.
size_t nccl_dtype_size(int dtype);

}  // namespace fusedist
