// The consumer's program: includes kiln the way users do, runs a small computation through the
// op registry and checks the result, so that a broken install fails at build or at run time.
#include <cstdlib>
#include <iostream>

#include <kiln/kiln.h>

int main() {
  // a = [[0, 1, 2], [3, 4, 5]]; a a^T = [[5, 14], [14, 50]] (a strided view into a GEMM).
  const kiln::Tensor a = kiln::arange(6, kiln::kFloat).view({2, 3});
  const kiln::Tensor g = a.matmul(a.t());
  std::cout << "a @ a.t() = " << g << "\n";
  const double total = g.sum().item<double>();
  if (kiln::shape_str(g.sizes()) != "[2, 2]" || total != 83.0 || g[1][0].item<float>() != 14) {
    std::cerr << "kiln_consumer: wrong result, sum " << total << " for shape "
              << kiln::shape_str(g.sizes()) << "\n";
    return EXIT_FAILURE;
  }
  // Errors cross the library boundary as kiln::Error with the op's name.
  try {
    (void)a.matmul(a);
    std::cerr << "kiln_consumer: expected kiln::Error from matmul\n";
    return EXIT_FAILURE;
  } catch (const kiln::Error& e) {
    std::cout << "caught: " << e.what() << "\n";
  }
  std::cout << "kiln_consumer: OK\n";
  return EXIT_SUCCESS;
}
