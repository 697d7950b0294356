#include "comm_stream.h"

#include <stdexcept>

#include "checks.h"

namespace fusedist {

Event::Event(int device) : device_(device) {
  DeviceGuard guard(device);
  FUSEDIST_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

Event::~Event() {
  if (event_ != nullptr) cudaEventDestroy(event_);  // never throw from a destructor
}

void Event::record(cudaStream_t stream) {
  DeviceGuard guard(device_);
  FUSEDIST_CUDA_CHECK(cudaEventRecord(event_, stream));
  recorded_ = true;
}

bool Event::query() const {
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return false;
  FUSEDIST_CUDA_CHECK(err);
  return true;
}

void Event::synchronize() const { FUSEDIST_CUDA_CHECK(cudaEventSynchronize(event_)); }

void Event::block(cudaStream_t stream) const {
  DeviceGuard guard(device_);
  FUSEDIST_CUDA_CHECK(cudaStreamWaitEvent(stream, event_, 0));
}

CommStream::CommStream(int device, bool high_priority) : device_(device) {
  int count = 0;
  FUSEDIST_CUDA_CHECK(cudaGetDeviceCount(&count));
  if (device < 0 || device >= count) {
    throw std::invalid_argument("fusedist: CommStream device " + std::to_string(device) +
                                " does not exist (this process sees " + std::to_string(count) +
                                " CUDA device(s))");
  }
  DeviceGuard guard(device);
  if (high_priority) {
    int least = 0, greatest = 0;
    FUSEDIST_CUDA_CHECK(cudaDeviceGetStreamPriorityRange(&least, &greatest));
    priority_ = greatest;  // numerically lowest = highest priority
  }
  FUSEDIST_CUDA_CHECK(cudaStreamCreateWithPriority(&stream_, cudaStreamNonBlocking, priority_));
  FUSEDIST_CUDA_CHECK(cudaEventCreateWithFlags(&producer_ready_, cudaEventDisableTiming));
}

CommStream::~CommStream() {
  if (producer_ready_ != nullptr) cudaEventDestroy(producer_ready_);
  if (stream_ != nullptr) cudaStreamDestroy(stream_);
}

void CommStream::wait_for(cudaStream_t producer) {
  if (producer == stream_) return;  // already in order
  DeviceGuard guard(device_);
  FUSEDIST_CUDA_CHECK(cudaEventRecord(producer_ready_, producer));
  FUSEDIST_CUDA_CHECK(cudaStreamWaitEvent(stream_, producer_ready_, 0));
}

std::shared_ptr<Event> CommStream::record_done() {
  auto done = std::make_shared<Event>(device_);
  done->record(stream_);
  return done;
}

void CommStream::make_wait(cudaStream_t consumer, const Event& done) const {
  if (consumer == stream_) return;
  done.block(consumer);
}

void check_stream_device(cudaStream_t stream, int device, const char* what) {
  // The legacy (0) and per-thread (2) default streams belong to whichever device is current;
  // callers hold a DeviceGuard for `device`, so they are fine.
  uintptr_t h = reinterpret_cast<uintptr_t>(stream);
  if (h == 0 || h == 1 || h == 2) return;
  int stream_device = -1;
  FUSEDIST_CUDA_CHECK(cudaStreamGetDevice(stream, &stream_device));
  if (stream_device != device) {
    throw std::invalid_argument(
        str("fusedist: ", what, ": the stream belongs to cuda:", stream_device,
            " but the communicator works on cuda:", device, ". Launch from a stream of cuda:",
            device,
            " (torch.cuda.set_device / torch.cuda.stream) or create the communicator while that "
            "device is current."));
  }
}

void check_device_pointer(const void* ptr, int device, const char* what) {
  cudaPointerAttributes attr{};
  cudaError_t err = cudaPointerGetAttributes(&attr, ptr);
  if (err != cudaSuccess) {
    cudaGetLastError();
    throw std::invalid_argument(std::string("fusedist: ") + what +
                                ": the buffer is not CUDA memory (" + cudaGetErrorString(err) +
                                "); pass CUDA tensors");
  }
  if (attr.type == cudaMemoryTypeManaged) return;
  if (attr.type != cudaMemoryTypeDevice) {
    throw std::invalid_argument(std::string("fusedist: ") + what +
                                ": the buffer is host memory; NCCL needs device memory (move the "
                                "tensor with .cuda())");
  }
  if (attr.device != device) {
    throw std::invalid_argument(str("fusedist: ", what, ": the buffer lives on cuda:", attr.device,
                                    " but the communicator works on cuda:", device));
  }
}

}  // namespace fusedist
