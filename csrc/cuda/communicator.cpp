#include "communicator.h"

#include <chrono>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <thread>

#include "checks.h"
#include "wait_deadline.h"

namespace fusedist {
namespace {

ncclRedOp_t checked_op(int op) {
  if (op < ncclSum || op > ncclAvg) {
    throw std::invalid_argument("fusedist: unsupported NCCL reduce op code " + std::to_string(op) +
                                " (0=sum, 1=prod, 2=max, 3=min, 4=avg)");
  }
  return static_cast<ncclRedOp_t>(op);
}

}  // namespace

NcclComm::NcclComm(const std::string& unique_id, int world_size, int rank, int device)
    : world_size_(world_size), rank_(rank), device_(device) {
  if (unique_id.size() != static_cast<size_t>(kNcclUniqueIdBytes)) {
    throw std::invalid_argument("fusedist: an NCCL unique id has " +
                                std::to_string(kNcclUniqueIdBytes) + " bytes, got " +
                                std::to_string(unique_id.size()));
  }
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    throw std::invalid_argument("fusedist: rank " + std::to_string(rank) +
                                " is outside world_size " + std::to_string(world_size));
  }
  int count = 0;
  FUSEDIST_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    throw std::invalid_argument("fusedist: device cuda:" + std::to_string(device) +
                                " does not exist (this process sees " + std::to_string(count) +
                                " CUDA device(s))");
  }
  ncclUniqueId id;
  std::memcpy(id.internal, unique_id.data(), kNcclUniqueIdBytes);
  DeviceGuard guard(device);
  FUSEDIST_NCCL_CHECK(nccl().CommInitRank(&comm_, world_size, id, rank));
}

std::string NcclComm::where() const {
  return str("rank ", rank_, " of ", world_size_, " (cuda:", device_, ")");
}

ncclComm_t NcclComm::live(const std::string& what) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return live_locked(what);
}

ncclComm_t NcclComm::live_locked(const std::string& what) const {
  if (aborted_) {
    throw NcclError("fusedist: " + what + " on " + where() +
                    ": the NCCL communicator was aborted earlier (" + abort_reason_ +
                    "); it is not re-created on its own (creating one is a collective of every "
                    "rank): destroy and re-create the process group on every rank, or restart "
                    "the job");
  }
  if (destroyed_) {
    throw NcclError("fusedist: " + what + " on " + where() +
                    ": the NCCL communicator was destroyed (close() was called)");
  }
  return comm_;
}

void NcclComm::check_launch(uintptr_t stream, const std::string& what, size_t count, int dtype,
                            std::initializer_list<uintptr_t> buffers) const {
  nccl_dtype_size(dtype);  // throws a clear message for unknown codes
  check_stream_device(as_stream(stream), device_, what.c_str());
  if (count == 0) return;
  for (uintptr_t buf : buffers) {
    check_device_pointer(reinterpret_cast<const void*>(buf), device_, what.c_str());
  }
}

void NcclComm::all_reduce(uintptr_t send, uintptr_t recv, size_t count, int dtype, int op,
                          uintptr_t stream, const std::string& what) {
  std::lock_guard<std::timed_mutex> launching(launch_mutex_);
  ncclComm_t comm = live(what);
  DeviceGuard guard(device_);
  check_launch(stream, what, count, dtype, {send, recv});
  FUSEDIST_NCCL_CHECK(nccl().AllReduce(reinterpret_cast<const void*>(send),
                                       reinterpret_cast<void*>(recv), count,
                                       static_cast<ncclDataType_t>(dtype), checked_op(op), comm,
                                       as_stream(stream)));
}

void NcclComm::reduce_scatter(uintptr_t send, uintptr_t recv, size_t recv_count, int dtype,
                              int op, uintptr_t stream, const std::string& what) {
  std::lock_guard<std::timed_mutex> launching(launch_mutex_);
  ncclComm_t comm = live(what);
  DeviceGuard guard(device_);
  check_launch(stream, what, recv_count, dtype, {send, recv});
  FUSEDIST_NCCL_CHECK(nccl().ReduceScatter(reinterpret_cast<const void*>(send),
                                           reinterpret_cast<void*>(recv), recv_count,
                                           static_cast<ncclDataType_t>(dtype), checked_op(op),
                                           comm, as_stream(stream)));
}

void NcclComm::all_gather(uintptr_t send, uintptr_t recv, size_t send_count, int dtype,
                          uintptr_t stream, const std::string& what) {
  std::lock_guard<std::timed_mutex> launching(launch_mutex_);
  ncclComm_t comm = live(what);
  DeviceGuard guard(device_);
  check_launch(stream, what, send_count, dtype, {send, recv});
  FUSEDIST_NCCL_CHECK(nccl().AllGather(reinterpret_cast<const void*>(send),
                                       reinterpret_cast<void*>(recv), send_count,
                                       static_cast<ncclDataType_t>(dtype), comm,
                                       as_stream(stream)));
}

void NcclComm::broadcast(uintptr_t send, uintptr_t recv, size_t count, int dtype, int root,
                         uintptr_t stream, const std::string& what) {
  std::lock_guard<std::timed_mutex> launching(launch_mutex_);
  ncclComm_t comm = live(what);
  if (root < 0 || root >= world_size_) {
    throw std::invalid_argument("fusedist: " + what + ": broadcast root " + std::to_string(root) +
                                " is outside world_size " + std::to_string(world_size_));
  }
  DeviceGuard guard(device_);
  check_launch(stream, what, count, dtype, {send, recv});
  FUSEDIST_NCCL_CHECK(nccl().Broadcast(reinterpret_cast<const void*>(send),
                                       reinterpret_cast<void*>(recv), count,
                                       static_cast<ncclDataType_t>(dtype), root, comm,
                                       as_stream(stream)));
}

void NcclComm::check_async_error(const std::string& what) {
  ncclResult_t async_error = ncclSuccess;
  {
    // Held across the poll: abort() and destroy() (another thread: the watchdog, close()) mark
    // the communicator gone under this lock before freeing it, so a poll never reads a freed
    // communicator; the poll itself never blocks.
    std::lock_guard<std::mutex> lock(mutex_);
    FUSEDIST_NCCL_CHECK(nccl().CommGetAsyncError(live_locked(what), &async_error));
  }
  if (async_error != ncclSuccess && async_error != ncclInProgress) {
    std::string reason = std::string("asynchronous NCCL error: ") +
                         nccl().GetErrorString(async_error) + " (code " +
                         std::to_string(static_cast<int>(async_error)) + ")";
    abort(what + ": " + reason);
    throw NcclError("fusedist: " + what + " failed on " + where() + ": " + reason +
                    "; the communicator was aborted (NCCL_DEBUG=WARN shows NCCL's diagnosis)");
  }
}

void NcclComm::wait(const Event& done, double timeout_s, const std::string& what) {
  using clock = std::chrono::steady_clock;
  const auto start = clock::now();
  // nullopt: no deadline (an infinite timeout); NaN or negative ones raise before anything is
  // polled (Note [wait timeouts] in wait_deadline.h).
  const std::optional<clock::time_point> deadline = wait_deadline(timeout_s, start, what);
  // Spin briefly (most waits at the end of a backward pass are short), then back off so a
  // long wait does not burn a CPU core.
  auto sleep = std::chrono::microseconds(0);
  while (true) {
    if (done.query()) {
      check_async_error(what);
      return;
    }
    check_async_error(what);
    if (deadline && clock::now() >= *deadline) {
      const std::string reason = str(what, " did not complete within ", timeout_s, " s");
      abort(reason);
      throw NcclError("fusedist: " + reason + " on " + where() +
                      "; the NCCL communicator was aborted. Usual causes: a rank that never "
                      "joined this collective (it crashed, or took another code path), or "
                      "ranks issuing collectives in different orders or sizes.");
    }
    if (sleep.count() > 0) std::this_thread::sleep_for(sleep);
    if (clock::now() - start > std::chrono::microseconds(200)) {
      sleep = std::min(std::chrono::microseconds(1000), sleep + std::chrono::microseconds(20));
    }
  }
}

void NcclComm::abort(const std::string& reason) {
  // Note [launches without the GIL]: wait a little for a launch in progress to return, so the
  // communicator is not freed under it; a launch still running after that is blocked (in a
  // lazy connection to a peer that never comes) and only the abort itself can end it.
  std::unique_lock<std::timed_mutex> launching(launch_mutex_, std::defer_lock);
  (void)launching.try_lock_for(std::chrono::milliseconds(kAbortLaunchWaitMs));
  ncclComm_t comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_ || destroyed_) return;
    aborted_ = true;
    abort_reason_ = reason;
    comm = comm_;
    comm_ = nullptr;
  }
  // After a fatal CUDA error selecting the device may throw too: the abort goes on without it,
  // so that the error which caused the abort is the one raised.
  std::optional<DeviceGuard> guard;
  try {
    guard.emplace(device_);
  } catch (const CudaError&) {
  }
  // The communicator is gone whatever abort returns; its status adds nothing the caller can
  // act on, and throwing here would hide the error that caused the abort.
  nccl().CommAbort(comm);
}

void NcclComm::destroy() {
  std::lock_guard<std::timed_mutex> launching(launch_mutex_);  // never under a running launch
  ncclComm_t comm = nullptr;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (aborted_ || destroyed_) return;
    destroyed_ = true;
    comm = comm_;
    comm_ = nullptr;
  }
  DeviceGuard guard(device_);
  FUSEDIST_NCCL_CHECK(nccl().CommDestroy(comm));
}

bool NcclComm::is_aborted() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return aborted_;
}

std::string NcclComm::abort_reason() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return abort_reason_;
}

}  // namespace fusedist
