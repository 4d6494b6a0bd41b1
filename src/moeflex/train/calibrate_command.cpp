// `moeflex calibrate --device KIND` (see calibrate_command.h).
#include "moeflex/train/calibrate_command.h"

#include <fmt/format.h>

#include "moeflex/core/error.h"
#include "moeflex/profile/calibrate.h"
#include "moeflex/train/train_config.h"

#ifdef MOEFLEX_HAVE_CUDA
#include "moeflex/ops/cuda/backend.h"
#endif

namespace moeflex {

int run_device_calibrate_command(const std::string& device, const std::string& config_path,
                                 const std::filesystem::path& out_path, Seconds budget) {
  const DeviceKind kind = parse_device_kind(device);
  const RunConfig cfg = config_path.empty() ? RunConfig::defaults() : RunConfig::from_file(config_path);
  const DeviceCalibrationShapes shapes{cfg.model, cfg.train.micro_batch_size, cfg.train.seq_len};
  // The device first: without one nothing is created, not even --out's folder.
  ops::DeviceContext ctx;
  if (kind == DeviceKind::cpu) {
    ctx = ops::make_cpu_context(Arena::kUnlimited);
  } else {
#ifdef MOEFLEX_HAVE_CUDA
    ctx = ops::cuda::make_cuda_context(ops::cuda::CudaContextOptions{});
#else
    throw ConfigError(
        "calibrate --device cuda: this moeflex was built without the CUDA backend (configure with "
        "-DMOEFLEX_CUDA=ON where nvcc is installed)");
#endif
  }
  check_profile_out(out_path);
  const HardwareProfile p = calibrate_device(ctx, shapes, budget, true);
  const CostModel m(p);
  const std::int64_t n = shapes.micro_batch_size * shapes.seq_len, d = shapes.model.hidden_size;
  fmt::print(
      "{}: {} GEMM shapes, attention at {} sequence lengths, elementwise {:.1f} GB/s (launch {:.1f} us), "
      "copies h2d {:.1f} GB/s d2h {:.1f} GB/s\n",
      p.name, p.gemm.size(), p.op_tables.at(op_names::kAttentionForward).size(), p.memory_bandwidth / 1e9,
      p.launch_overhead * 1e6, p.h2d_bandwidth / 1e9, p.d2h_bandwidth / 1e9);
  fmt::print("  the micro-batch's [{} x {}] x [{} x {}]^T GEMM: {:.1f} TFLOP/s\n", n, d, d, d,
             m.gemm_rate(n, d, d, GemmLayout::nt) / 1e12);
  write_profile(p, out_path);
  fmt::print("wrote {}\n", out_path.string());
  return 0;
}

}  // namespace moeflex
