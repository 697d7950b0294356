// The dedicated communication stream and the events that order it.
//
// Note [comm stream ordering]
// ---------------------------
// Collectives run on one high-priority stream per communicator (CommStream), never on the
// caller's stream, so that NCCL kernels overlap the compute that keeps running on the
// caller's ("producer") stream -- the backward pass producing the next gradients. Three
// orderings make that safe:
//
//  1. comm after producer. A collective reads buffers written by kernels the caller enqueued
//     on its own stream. Before each launch, CommStream::wait_for(producer) records the
//     `producer_ready_` event on the producer stream and makes the comm stream wait on it,
//     so the collective starts only after everything the caller enqueued so far. Work the
//     caller enqueues *afterwards* is not waited for: that is the overlap.
//  2. consumer after comm. The result may be read only after the collective finished. Each
//     launch records a "done" Event on the comm stream; CommStream::make_wait(consumer, done)
//     makes the consumer stream wait on it. Neither side blocks the host.
//  3. memory lifetime. The caching allocator of torch only knows the streams a block was
//     used on. The Python layer calls Tensor.record_stream(comm stream) for tensors of a
//     launch, so their memory is not handed out again before the collective is done.
//
// All operations on one comm stream execute in launch order, so the done event of the
// latest launch also covers every earlier one.
#pragma once

#include <cstdint>
#include <memory>

#include <cuda_runtime_api.h>

namespace fusedist {

// A CUDA event without timing (cheaper to record and wait on), owned by this object.
class Event {
 public:
  explicit Event(int device);
  ~Event();
  Event(const Event&) = delete;
  Event& operator=(const Event&) = delete;

  void record(cudaStream_t stream);
  // True once all work captured by the last record() has completed. Throws CudaError when
  // that work failed (e.g. an illegal address in a kernel before it).
  bool query() const;
  // Block the host until complete (no timeout: prefer NcclComm::wait for collectives).
  void synchronize() const;
  // Make `stream` wait for the captured work (does not block the host).
  void block(cudaStream_t stream) const;
  bool recorded() const { return recorded_; }
  cudaEvent_t get() const { return event_; }
  int device() const { return device_; }

 private:
  cudaEvent_t event_ = nullptr;
  int device_;
  bool recorded_ = false;
};

class CommStream {
 public:
  // Creates a non-blocking stream on `device` with the highest priority CUDA offers (so NCCL
  // kernels are scheduled ahead of queued compute blocks) or the default priority.
  CommStream(int device, bool high_priority);
  ~CommStream();
  CommStream(const CommStream&) = delete;
  CommStream& operator=(const CommStream&) = delete;

  cudaStream_t stream() const { return stream_; }
  uintptr_t handle() const { return reinterpret_cast<uintptr_t>(stream_); }
  int device() const { return device_; }
  int priority() const { return priority_; }

  // Ordering 1 of Note [comm stream ordering].
  void wait_for(cudaStream_t producer);
  // Records and returns a fresh done event after everything enqueued so far (ordering 2).
  std::shared_ptr<Event> record_done();
  // Ordering 2: `consumer` waits for `done`.
  void make_wait(cudaStream_t consumer, const Event& done) const;

 private:
  int device_;
  int priority_ = 0;
  cudaStream_t stream_ = nullptr;
  // Recorded on the producer stream right before each launch; the comm stream waits on it.
  // Reused: cudaStreamWaitEvent captures the event's state at call time.
  cudaEvent_t producer_ready_ = nullptr;
};

// Throws CudaError/std::invalid_argument with an explanation unless `stream` belongs to
// `device` (the legacy default stream 0 belongs to the current device).
void check_stream_device(cudaStream_t stream, int device, const char* what);

// Throws std::invalid_argument unless `ptr` is device (or managed) memory usable on `device`.
void check_device_pointer(const void* ptr, int device, const char* what);

inline cudaStream_t as_stream(uintptr_t handle) { return reinterpret_cast<cudaStream_t>(handle); }

}  // namespace fusedist
