// The consumer's program: includes kiln the way users do, runs a small computation through the
// op registry and checks the result, so that a broken install fails at build or at run time.
#include <cstdlib>
#include <iostream>

#include <kiln/kiln.h>

int main() {
  // [[0, 1, 2], [3, 4, 5]] viewed transposed: a strided view, copied back to row-major.
  const kiln::Tensor a = kiln::arange(6, kiln::kFloat).view({2, 3});
  const kiln::Tensor at = a.t().contiguous();
  std::cout << "a.t() = " << at << "\n";
  // at[2][1] is a[1][2] = 5.
  const double v = at[2][1].to(kiln::kDouble).item<double>();
  if (kiln::shape_str(at.sizes()) != "[3, 2]" || v != 5.0) {
    std::cerr << "kiln_consumer: wrong result " << v << " for shape "
              << kiln::shape_str(at.sizes()) << "\n";
    return EXIT_FAILURE;
  }
  // Errors cross the library boundary as kiln::Error with the op's name.
  try {
    (void)a.view({4, 2});
    std::cerr << "kiln_consumer: expected kiln::Error from view\n";
    return EXIT_FAILURE;
  } catch (const kiln::Error& e) {
    std::cout << "caught: " << e.what() << "\n";
  }
  std::cout << "kiln_consumer: OK\n";
  return EXIT_SUCCESS;
}
