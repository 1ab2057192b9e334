// The AVX-512 (x86-64-v4: F, DQ, BW, VL) build of the CPU matrix product (kernels/cpu/gemm.h),
// compiled with those flags (CMakeLists.txt). Include nothing else here: see
// kernels/cpu/gemm_body.h.
#define Eigen kiln_eigen_avx512
#define KILN_GEMM_NS avx512
#include "kernels/cpu/gemm_body.h"
