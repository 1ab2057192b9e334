// The AVX2 + FMA (x86-64-v3) build of the CPU matrix product (kernels/cpu/gemm.h), compiled with
// -mavx2 -mfma (CMakeLists.txt). Include nothing else here: see kernels/cpu/gemm_body.h.
#define Eigen kiln_eigen_avx2
#define KILN_GEMM_NS avx2
#include "kernels/cpu/gemm_body.h"
