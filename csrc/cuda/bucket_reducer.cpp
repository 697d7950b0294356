#include "bucket_reducer.h"

#include <algorithm>
#include <chrono>
#include <stdexcept>

#include "checks.h"
#include "kernels.h"

namespace fusedist {

BucketSchedule::BucketSchedule(std::vector<int> grads_per_bucket)
    : expected_(std::move(grads_per_bucket)), ready_(expected_.size(), 0) {
  for (size_t b = 0; b < expected_.size(); ++b) {
    if (expected_[b] < 1) {
      throw std::invalid_argument("fusedist: bucket " + std::to_string(b) + " expects " +
                                  std::to_string(expected_[b]) +
                                  " gradients; every bucket needs at least one");
    }
  }
}

int BucketSchedule::checked(int bucket) const {
  if (bucket < 0 || bucket >= num_buckets()) {
    throw std::out_of_range("fusedist: bucket index " + std::to_string(bucket) +
                            " is outside [0, " + std::to_string(num_buckets()) + ")");
  }
  return bucket;
}

std::vector<int> BucketSchedule::mark_ready(int bucket) {
  checked(bucket);
  if (ready_[bucket] >= expected_[bucket]) {
    throw std::logic_error(
        "fusedist: bucket " + std::to_string(bucket) + " was marked ready more often than its " +
        std::to_string(expected_[bucket]) +
        " gradients in one iteration: a gradient was reported twice (a parameter used twice "
        "in the graph?) or finalize() was not called between iterations");
  }
  ++ready_[bucket];
  std::vector<int> run;
  while (next_launch_ < num_buckets() && ready_[next_launch_] == expected_[next_launch_]) {
    run.push_back(next_launch_++);
  }
  return run;
}

void BucketSchedule::check_complete() const {
  if (next_launch_ == num_buckets()) return;
  std::string msg = "fusedist: finalize() before all gradients were ready:";
  for (int b = next_launch_; b < num_buckets(); ++b) {
    msg += str(" bucket ", b, " has ", ready_[b], " of ", expected_[b], ";");
  }
  msg += " buckets launch in index order, so a missing gradient also holds back later "
         "buckets. Parameters that get no gradient must still be marked ready (or excluded "
         "from the buckets).";
  throw std::logic_error(msg);
}

void BucketSchedule::reset() {
  std::fill(ready_.begin(), ready_.end(), 0);
  next_launch_ = 0;
}

BucketReducer::BucketReducer(std::shared_ptr<NcclComm> comm, std::shared_ptr<CommStream> stream,
                             std::vector<Bucket> buckets, std::vector<int> grads_per_bucket,
                             double predivide, double divide)
    : comm_(std::move(comm)),
      stream_(std::move(stream)),
      buckets_(std::move(buckets)),
      schedule_(std::move(grads_per_bucket)) {
  if (!comm_ || !stream_) throw std::invalid_argument("fusedist: BucketReducer needs a comm and a stream");
  if (stream_->device() != comm_->device()) {
    throw std::invalid_argument("fusedist: the comm stream is on cuda:" +
                                std::to_string(stream_->device()) + ", the communicator on cuda:" +
                                std::to_string(comm_->device()));
  }
  if (buckets_.size() != static_cast<size_t>(schedule_.num_buckets())) {
    throw std::invalid_argument("fusedist: " + std::to_string(buckets_.size()) + " buckets but " +
                                std::to_string(schedule_.num_buckets()) + " gradient counts");
  }
  if (!(predivide > 0) || !(divide > 0)) {
    throw std::invalid_argument("fusedist: predivide and divide factors must be positive");
  }
  pre_factor_ = 1.0 / predivide;
  post_factor_ = predivide / divide;
  DeviceGuard guard(comm_->device());
  for (size_t b = 0; b < buckets_.size(); ++b) {
    const Bucket& bucket = buckets_[b];
    nccl_dtype_size(bucket.dtype);
    if (pre_factor_ != 1.0 || post_factor_ != 1.0) {
      try {
        check_scale_dtype(bucket.dtype);
      } catch (const std::invalid_argument& e) {
        throw std::invalid_argument(describe(static_cast<int>(b)) + ": " + e.what());
      }
    }
    if (bucket.numel > 0) {
      check_device_pointer(reinterpret_cast<const void*>(bucket.data), comm_->device(),
                           describe(static_cast<int>(b)).c_str());
    }
    if (bucket.shard != 0) {
      if (bucket.numel % static_cast<size_t>(comm_->world_size()) != 0) {
        throw std::invalid_argument("fusedist: " + describe(static_cast<int>(b)) + " has " +
                                    std::to_string(bucket.numel) +
                                    " elements, not a multiple of world_size " +
                                    std::to_string(comm_->world_size()) +
                                    "; pad it to reduce-scatter into shards");
      }
      if (bucket.numel > 0) {
        check_device_pointer(reinterpret_cast<const void*>(bucket.shard), comm_->device(),
                             (describe(static_cast<int>(b)) + " shard").c_str());
      }
    }
    done_.push_back(std::make_shared<Event>(comm_->device()));
  }
}

std::string BucketReducer::describe(int bucket) const {
  std::string s = "bucket " + std::to_string(bucket);
  const std::string& tag = buckets_.at(bucket).tag;
  if (!tag.empty()) s += " [" + tag + "]";
  return s;
}

size_t BucketReducer::shard_numel(int bucket) const {
  return buckets_.at(bucket).numel / static_cast<size_t>(comm_->world_size());
}

std::string BucketReducer::op_name(int bucket) const {
  return (buckets_.at(bucket).shard != 0 ? "reduce_scatter of " : "all_reduce of ") +
         describe(bucket);
}

std::vector<int> BucketReducer::mark_ready(int bucket, uintptr_t producer_stream) {
  std::vector<int> run = schedule_.mark_ready(bucket);
  if (!run.empty()) launch(run, as_stream(producer_stream));
  return run;
}

void BucketReducer::launch(const std::vector<int>& run, cudaStream_t producer) {
  DeviceGuard guard(comm_->device());
  check_stream_device(producer, comm_->device(), "BucketReducer.mark_ready");
  cudaStream_t s = stream_->stream();
  // Ordering 1 of Note [comm stream ordering]: the gradients were written on `producer`.
  stream_->wait_for(producer);
  if (pre_factor_ != 1.0) {
    for (int b : run) launch_scale(reinterpret_cast<void*>(buckets_[b].data), buckets_[b].numel,
                                   buckets_[b].dtype, pre_factor_, s);
  }
  // Note [bucket launch order]: the whole run goes out as one NCCL group.
  comm_->group_start();
  try {
    for (int b : run) {
      const Bucket& bucket = buckets_[b];
      if (bucket.numel == 0) continue;  // nothing to send; NCCL gets no zero-size calls
      if (bucket.shard != 0) {
        comm_->reduce_scatter(bucket.data, bucket.shard, shard_numel(b), bucket.dtype, ncclSum,
                              stream_->handle(), op_name(b));
      } else {
        comm_->all_reduce(bucket.data, bucket.data, bucket.numel, bucket.dtype, ncclSum,
                          stream_->handle(), op_name(b));
      }
    }
  } catch (...) {
    try {
      comm_->group_end();
    } catch (...) {
    }
    throw;
  }
  comm_->group_end();
  for (int b : run) {
    // Note [pre/post division]: after ncclGroupEnd, so it runs after the collective.
    if (post_factor_ != 1.0) {
      const Bucket& bucket = buckets_[b];
      if (bucket.shard != 0) {
        launch_scale(reinterpret_cast<void*>(bucket.shard), shard_numel(b), bucket.dtype,
                     post_factor_, s);
      } else {
        launch_scale(reinterpret_cast<void*>(bucket.data), bucket.numel, bucket.dtype,
                     post_factor_, s);
      }
    }
    done_[b]->record(s);  // bucket b is final once this event completes
  }
}

void BucketReducer::finalize(uintptr_t consumer_stream, double timeout_s, bool blocking) {
  schedule_.check_complete();
  DeviceGuard guard(comm_->device());
  check_stream_device(as_stream(consumer_stream), comm_->device(), "BucketReducer.finalize");
  if (num_buckets() > 0) {
    // Ordering 2 of Note [comm stream ordering]: the last bucket's event covers all earlier
    // ones (one stream, launch order).
    stream_->make_wait(as_stream(consumer_stream), *done_.back());
  }
  if (blocking) {
    using clock = std::chrono::steady_clock;
    const auto deadline = clock::now() + std::chrono::duration_cast<clock::duration>(
                                             std::chrono::duration<double>(timeout_s));
    for (int b = 0; b < num_buckets(); ++b) {
      // In launch order, so a failure names the first bucket that did not complete.
      double left = std::chrono::duration<double>(deadline - clock::now()).count();
      comm_->wait(*done_[b], left > 0 ? left : 0.0, op_name(b));
    }
  } else {
    comm_->check_async_error("bucket reduction");
  }
  schedule_.reset();
}

void BucketReducer::reset(double timeout_s) {
  const int launched = schedule_.launched_count();
  schedule_.reset();
  if (comm_->is_aborted()) return;
  for (int b = 0; b < launched; ++b) {
    comm_->wait(*done_[b], timeout_s, op_name(b) + " (reset)");
  }
}

}  // namespace fusedist
