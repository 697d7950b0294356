// dlopen-based NCCL loader (see nccl_api.h for why NCCL is not linked).
#include <dlfcn.h>

#include <atomic>
#include <cstdlib>
#include <mutex>
#include <stdexcept>

#include "nccl_api.h"
#include "str.h"

namespace fusedist {
namespace {

// Note [publishing the NCCL table]
// --------------------------------
// load_nccl() runs under g_mutex, but nccl() -- called before every NCCL call, from whichever
// thread launches or polls (the bindings release the GIL: Note [launches without the GIL] in
// communicator.h) -- does not take the lock. So the table and the path are written once, before
// g_loaded is set with release order, and never again; a reader that sees g_loaded true with
// acquire order sees the complete table. (A plain bool here was a data race: a poller could
// read it true while the loading thread's writes of the table were not yet visible to it.)
NcclApi g_api{};
std::atomic<bool> g_loaded{false};
std::string g_path;
std::mutex g_mutex;

template <typename Fn>
void bind(void* lib, const char* name, Fn& slot, const std::string& path) {
  void* sym = dlsym(lib, name);
  if (sym == nullptr) {
    throw std::runtime_error("fusedist: " + path + " has no symbol " + name +
                             " (NCCL too old? fusedist needs NCCL >= 2.10)");
  }
  slot = reinterpret_cast<Fn>(sym);
}

}  // namespace

const NcclApi& load_nccl(const std::string& requested) {
  std::lock_guard<std::mutex> lock(g_mutex);
  if (g_loaded.load(std::memory_order_relaxed)) return g_api;  // (g_mutex orders it)
  std::string path = requested;
  if (path.empty()) {
    const char* env = std::getenv("FUSEDIST_NCCL_LIBRARY");
    path = (env != nullptr && *env != '\0') ? env : "libnccl.so.2";
  }
  // RTLD_GLOBAL is not needed: nothing resolves symbols against NCCL through us.
  void* lib = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
  if (lib == nullptr) {
    const char* why = dlerror();
    throw std::runtime_error(
        str("fusedist: cannot dlopen the NCCL library '", path, "': ", (why ? why : "?"),
            ". Install NCCL (e.g. the nvidia-nccl-cu12/cu13 wheel a CUDA build of torch depends "
            "on), import torch first so its libnccl is already loaded, or point "
            "FUSEDIST_NCCL_LIBRARY at libnccl.so.2."));
  }
  NcclApi api{};
  try {
    bind(lib, "ncclGetVersion", api.GetVersion, path);
    bind(lib, "ncclGetUniqueId", api.GetUniqueId, path);
    bind(lib, "ncclCommInitRank", api.CommInitRank, path);
    bind(lib, "ncclCommDestroy", api.CommDestroy, path);
    bind(lib, "ncclCommAbort", api.CommAbort, path);
    bind(lib, "ncclCommGetAsyncError", api.CommGetAsyncError, path);
    bind(lib, "ncclGetErrorString", api.GetErrorString, path);
    bind(lib, "ncclAllReduce", api.AllReduce, path);
    bind(lib, "ncclReduceScatter", api.ReduceScatter, path);
    bind(lib, "ncclAllGather", api.AllGather, path);
    bind(lib, "ncclBroadcast", api.Broadcast, path);
  } catch (...) {
    dlclose(lib);
    throw;
  }
  int version = 0;
  if (api.GetVersion(&version) != ncclSuccess || version < 21000) {
    dlclose(lib);
    throw std::runtime_error("fusedist: " + path + " reports NCCL version " +
                             std::to_string(version) + "; fusedist needs NCCL >= 2.10 (ncclAvg)");
  }
  // The library stays loaded for the life of the process (communicators may outlive any
  // Python object that could own the handle).
  g_api = api;
  g_path = path;
  g_loaded.store(true, std::memory_order_release);  // Note [publishing the NCCL table]
  return g_api;
}

const NcclApi& nccl() {
  if (!g_loaded.load(std::memory_order_acquire)) {
    throw std::runtime_error("fusedist: NCCL is not loaded yet (call fusedist._C.load_nccl())");
  }
  return g_api;
}

std::string nccl_library_path() {
  std::lock_guard<std::mutex> lock(g_mutex);
  return g_loaded.load(std::memory_order_relaxed) ? g_path : std::string();
}

size_t nccl_dtype_size(int dtype) {
  switch (dtype) {
    case ncclInt8:
    case ncclUint8:
      return 1;
    case ncclFloat16:
    case ncclBfloat16:
      return 2;
    case ncclInt32:
    case ncclUint32:
    case ncclFloat32:
      return 4;
    case ncclInt64:
    case ncclUint64:
    case ncclFloat64:
      return 8;
    default:
      throw std::invalid_argument("fusedist: unsupported NCCL dtype code " +
                                  std::to_string(dtype) +
                                  " (supported: int8, uint8, int32, uint32, int64, uint64, "
                                  "float16, float32, float64, bfloat16)");
  }
}

}  // namespace fusedist
