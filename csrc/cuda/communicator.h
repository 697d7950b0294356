// A direct NCCL communicator over raw device buffers, with timeout-bounded waits.
//
// Note [launches without the GIL]
// -------------------------------
// NCCL >= 2.22 connects lazily (NCCL_RUNTIME_CONNECT=1, its default): the first collective
// of each algorithm exchanges messages with the peers inside the launch call itself, so a
// launch can block the host until every peer reaches the same collective. Holding the GIL
// there would stop every Python thread of the process -- the reliability monitor's stall
// report, a data loader, a thread that could abort -- for as long as the slowest peer takes.
// So the bindings release the GIL around every NCCL call. Launches are then serialized here
// instead (launch_mutex_): NCCL does not allow concurrent calls on one communicator from
// several threads. abort() -- called from the watchdog thread on a timeout -- waits for that
// lock only briefly (kAbortLaunchWaitMs): a launch that returns in that time is not raced,
// and one stuck in a connection can still be aborted from another thread; destroy() takes
// the lock, so it never frees the communicator under a running launch.
//
// Buffers are passed as raw device pointers, element counts and ncclDataType_t codes, streams
// as cudaStream_t values: the extension never sees a torch type (see nccl_api.h). Every NCCL
// call is checked (checks.h); a communicator that hit an asynchronous error or a timeout is
// aborted, and every later call on it raises with the recorded reason.
#pragma once

#include <cstdint>
#include <memory>
#include <mutex>
#include <string>

#include "comm_stream.h"
#include "nccl_api.h"

namespace fusedist {

class NcclComm {
 public:
  // Joins the communicator identified by `unique_id` (the 128 bytes from ncclGetUniqueId on
  // one rank, shared with all others) as `rank` of `world_size`, on CUDA device `device`.
  // Blocks until all ranks have joined.
  NcclComm(const std::string& unique_id, int world_size, int rank, int device);
  // Leaks the NCCL communicator unless destroy() or abort() ran: destroying one during
  // interpreter shutdown (after the CUDA runtime tore down) can hang or crash.
  ~NcclComm() = default;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  int device() const { return device_; }

  // The collectives. `what` names the operation for error messages (op, tag, sequence).
  void all_reduce(uintptr_t send, uintptr_t recv, size_t count, int dtype, int op,
                  uintptr_t stream, const std::string& what);
  void reduce_scatter(uintptr_t send, uintptr_t recv, size_t recv_count, int dtype, int op,
                      uintptr_t stream, const std::string& what);
  void all_gather(uintptr_t send, uintptr_t recv, size_t send_count, int dtype, uintptr_t stream,
                  const std::string& what);
  void broadcast(uintptr_t send, uintptr_t recv, size_t count, int dtype, int root,
                 uintptr_t stream, const std::string& what);

  // Poll once for an asynchronous NCCL error; on one, abort and throw NcclError naming `what`.
  void check_async_error(const std::string& what);
  // Block the host until `done` has completed, polling for asynchronous errors. After
  // `timeout_s` seconds (or on an error) the communicator is aborted and NcclError names
  // `what`, this rank and the reason. An infinite (or unrepresentably long) timeout waits
  // without a deadline; a NaN or negative one raises std::invalid_argument before anything is
  // polled (Note [wait timeouts] in wait_deadline.h). Call without the GIL.
  void wait(const Event& done, double timeout_s, const std::string& what);

  // Abort: stops in-flight NCCL work, frees the communicator; later calls raise `reason`.
  void abort(const std::string& reason);
  // Orderly teardown once all work is done. Idempotent.
  void destroy();
  bool is_aborted() const;
  std::string abort_reason() const;

 private:
  ncclComm_t live(const std::string& what) const;  // throws if aborted or destroyed
  ncclComm_t live_locked(const std::string& what) const;  // the same, mutex_ held
  void check_launch(uintptr_t stream, const std::string& what, size_t count, int dtype,
                    std::initializer_list<uintptr_t> buffers) const;
  std::string where() const;

  ncclComm_t comm_ = nullptr;
  int world_size_;
  int rank_;
  int device_;
  mutable std::mutex mutex_;        // the state below (aborted_, destroyed_, the reason)
  std::timed_mutex launch_mutex_;   // Note [launches without the GIL]
  static constexpr int kAbortLaunchWaitMs = 2000;
  bool aborted_ = false;
  bool destroyed_ = false;
  std::string abort_reason_;
};

}  // namespace fusedist
