// The deadline of a host wait, from a timeout in seconds as Python passes it (a double).
//
// Note [wait timeouts]
// --------------------
// steady_clock counts signed 64-bit nanoseconds (about 292 years). Converting a double to that
// duration is undefined behaviour when the value does not fit -- NaN, infinity, and finite values
// as common as datetime.timedelta.max.total_seconds() (8.6e13 s), which Python programs use for
// "no timeout" -- and adding a fitting but huge duration to now() overflows the time point. The
// result was an arbitrary deadline: a wait that timed out at once and aborted the communicator,
// or one that never timed out. So the conversion is defined here:
//   * NaN and negative timeouts are refused (std::invalid_argument, ValueError in Python): they
//     are a caller's bug, and guessing a meaning would hide it;
//   * a timeout the clock cannot represent from now on -- infinity included -- means no deadline:
//     the wait ends when the work completes or NCCL reports an error, as a wait without timeout;
//   * any other value is a deadline `timeout_s` after `start`.
// Kept free of CUDA so it can be compiled and checked on any machine.
#pragma once

#include <chrono>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "str.h"

namespace fusedist {

// Longest finite wait honoured as a deadline (about 31 years); anything longer waits without one.
// Far inside the clock's range, so `start + timeout` can never overflow for any realistic start.
constexpr double kLongestDeadlineS = 1e9;

// The deadline of a wait of `timeout_s` seconds begun at `start`, or nullopt for no deadline
// (Note [wait timeouts]). `what` names the operation in the error for a NaN or negative timeout.
inline std::optional<std::chrono::steady_clock::time_point> wait_deadline(
    double timeout_s, std::chrono::steady_clock::time_point start, const std::string& what) {
  using clock = std::chrono::steady_clock;
  if (std::isnan(timeout_s) || timeout_s < 0.0) {
    throw std::invalid_argument(str("fusedist: ", what, ": the wait's timeout must be a number of seconds >= 0, got ",
                                    timeout_s, " (pass inf to wait until the collective completes)"));
  }
  // The time left before the clock's counter overflows, halved against rounding in the double.
  const double left_s = std::chrono::duration<double>(clock::time_point::max() - start).count();
  if (timeout_s > kLongestDeadlineS || timeout_s >= 0.5 * left_s) return std::nullopt;
  return start + std::chrono::duration_cast<clock::duration>(std::chrono::duration<double>(timeout_s));
}

}  // namespace fusedist
