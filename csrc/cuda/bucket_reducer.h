// Bucketed gradient reduction in C++: ready counts per bucket -> launch when full -> finalize
// waits and scales. Each bucket is all-reduced in place, or reduce-scattered into a shard.
//
// Note [bucket launch order]
// --------------------------
// NCCL matches collectives across ranks by issue order, so every rank must launch the
// buckets in the same order even when its backward pass finishes them in another order
// (different kernels, data-dependent control flow). A full bucket is therefore launched only
// once every bucket before it has been launched: bucket i waits for buckets 0..i-1, and one
// gradient can release a run of consecutive full buckets. Such a run is launched as one
// ncclGroupStart/End group so NCCL can schedule the collectives together.
//
// Note [pre/post division]
// ------------------------
// Averaging N fp16 gradients as sum-then-divide can overflow (65504 is fp16's largest
// finite value) although the mean is representable. The reducer multiplies each bucket by
// 1/predivide before the sum and by predivide/divide after it (divide = world size when
// averaging). predivide = divide makes overflow impossible (each addend is at most max/N);
// predivide = 1 is exact sum-then-divide. Both scalings run on the comm stream, around the
// collective; post-scaling kernels are issued after ncclGroupEnd, because NCCL only enqueues
// grouped collectives at ncclGroupEnd and a kernel issued inside the group would run first.
#pragma once

#include <cstdint>
#include <memory>
#include <string>
#include <vector>

#include "comm_stream.h"
#include "communicator.h"

namespace fusedist {

// The bookkeeping of the reducer alone (no CUDA), so it can be tested anywhere.
class BucketSchedule {
 public:
  explicit BucketSchedule(std::vector<int> grads_per_bucket);

  // Record one ready gradient of `bucket`; returns the buckets that may launch now, in
  // launch order (see Note [bucket launch order]). Throws std::logic_error if the bucket
  // already received all its gradients this iteration.
  std::vector<int> mark_ready(int bucket);
  // Throws std::logic_error naming every bucket that has not launched yet.
  void check_complete() const;
  void reset();

  int num_buckets() const { return static_cast<int>(expected_.size()); }
  int ready_count(int bucket) const { return ready_.at(checked(bucket)); }
  int expected_count(int bucket) const { return expected_.at(checked(bucket)); }
  int launched_count() const { return next_launch_; }

 private:
  int checked(int bucket) const;
  std::vector<int> expected_;
  std::vector<int> ready_;
  int next_launch_ = 0;  // buckets [0, next_launch_) have been launched this iteration
};

struct Bucket {
  uintptr_t data;  // device pointer of the flat bucket buffer
  size_t numel;
  int dtype;  // ncclDataType_t code
  std::string tag;
  // 0: all-reduce `data` in place (DDP). Otherwise the device pointer of this rank's shard
  // (numel / world_size elements): `data` is reduce-scattered into it (ZeRO stage 2) and
  // `data` itself is left pre-scaled, not reduced.
  uintptr_t shard = 0;
};

class BucketReducer {
 public:
  // `predivide` and `divide` as in Note [pre/post division] (both 1 for a plain sum).
  BucketReducer(std::shared_ptr<NcclComm> comm, std::shared_ptr<CommStream> stream,
                std::vector<Bucket> buckets, std::vector<int> grads_per_bucket, double predivide,
                double divide);

  // One gradient of `bucket` is ready on `producer_stream`. Launches the buckets this
  // releases and returns their indices (empty when nothing launches).
  std::vector<int> mark_ready(int bucket, uintptr_t producer_stream);
  // Every bucket must have launched. Orders `consumer_stream` after all of them; with
  // `blocking`, also waits on the host (bounded by `timeout_s`, polling NCCL's async errors)
  // so a failure surfaces here naming the bucket. Then resets for the next iteration.
  void finalize(uintptr_t consumer_stream, double timeout_s, bool blocking);
  // Abandon the iteration (after an exception): waits for launched buckets, clears counts.
  void reset(double timeout_s);

  const BucketSchedule& schedule() const { return schedule_; }
  int num_buckets() const { return schedule_.num_buckets(); }

 private:
  void launch(const std::vector<int>& run, cudaStream_t producer);
  std::string describe(int bucket) const;
  std::string op_name(int bucket) const;
  size_t shard_numel(int bucket) const;

  std::shared_ptr<NcclComm> comm_;
  std::shared_ptr<CommStream> stream_;
  std::vector<Bucket> buckets_;
  BucketSchedule schedule_;
  std::vector<std::shared_ptr<Event>> done_;  // per bucket, recorded after its post-scaling
  double pre_factor_;                         // 1 / predivide
  double post_factor_;                        // predivide / divide
};

}  // namespace fusedist
