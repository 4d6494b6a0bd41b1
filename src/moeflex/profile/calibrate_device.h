// `moeflex calibrate --device cuda`: a device's HardwareProfile, measured through
// the compute backend (ops/backend.h) that training runs on, at the shapes of the
// model it will train.
//
// What it measures (each time the median of kDeviceBatches batches of calls, every
// batch closed by Backend::synchronize_compute and timed on the wall clock, after
// one untimed call; a batch holds as many calls as make it last ~1/kDeviceBatches of
// the measurement's share of the budget):
//   - GEMMs (Backend::gemm, the calls linear layers make: y = x w^T nt, dx = dy w
//     nn, dw += dy^T x tn) for every weight shape of the model (attention
//     projections, dense MLP, routed and shared experts, router, LM head), along
//     the token count: the profile's GEMM lines;
//   - attention, forward and backward, over sequence lengths up to the model's, per
//     head (the attention_forward/backward tables);
//   - RMSNorm over [n, hidden] and SwiGLU over n x the experts' width, forward and
//     backward, along the same token counts (their op tables);
//   - y += x over sizes (the elementwise table; launch overhead and bandwidth);
//   - host <-> device copies over sizes, as offload and prefetch run them
//     (Device::copy_async from the backend's pinned host memory; plain memcpy where
//     the backend's memory is the host's): the copy tables.
// Other op families (router, permutes, rope, cross entropy, optimizer) are
// priced as elementwise bytes, as for a derived profile; a profiled run adds them at
// their exact shapes (`moeflex calibrate --from-run`).
//
// Unlike the CPU calibration (calibrate.h) it does not evict caches between calls:
// a GPU's L2 (tens of MiB) holds little of a training step, and repeated kernels
// time within ~1%.
#pragma once
#include <filesystem>
#include <string>

#include "moeflex/core/units.h"
#include "moeflex/model/config.h"
#include "moeflex/ops/backend.h"
#include "moeflex/provision/cost_model.h"

namespace moeflex {

/// Batches per measurement (their median is its time).
inline constexpr int kDeviceBatches = 5;
/// The default budget of `moeflex calibrate --device cuda`, seconds.
inline constexpr Seconds kDefaultDeviceCalibrationBudget = 30.0;

/// The shapes a device calibration measures for one model and micro-batch.
struct DeviceCalibrationShapes {
  ModelConfig model;
  std::int64_t micro_batch_size = 1;
  std::int64_t seq_len = 128;
};

/// Measures `ctx`'s backend (the CPU backend when ctx.backend is null) at the
/// shapes of `shapes` in about `budget` seconds (at least one batch per
/// measurement, whatever the budget), allocating its operands from ctx.arena.
/// The profile's device is the backend's kind and its name its description.
/// With `progress`, prints a line per phase. Throws ConfigError for a budget <= 0
/// or an empty shape, OutOfMemoryError when the operands do not fit the arena.
HardwareProfile calibrate_device(ops::DeviceContext& ctx, const DeviceCalibrationShapes& shapes, Seconds budget,
                                 bool progress = false);

// The command `moeflex calibrate --device KIND`, which reads a run config for its
// shapes, is train/calibrate_command.h.

}  // namespace moeflex
