// kiln_gpu_bench's generated-kernel sections (gpu/fused_bench.cu): elementwise chains and row
// kernels that kiln::compile runs as one fused_cuda region, timed beside their eager ops, with
// the bytes they must move as a share of the 1 GiB copy and of a copy of the same bytes.
#pragma once

namespace kiln::bench {

// `--only fused`: the pointwise chains at the 160m and 1b activation shapes, then the row kernels.
void bench_fused();
// `--only fused-rows`: the row kernels alone (softmax, log_softmax, logsumexp, RMSNorm written
// with ops, a weighted row sum), 16-bit ones also with CompileOptions::emulate_precision_casts
// off.
void bench_fused_rows();

}  // namespace kiln::bench
