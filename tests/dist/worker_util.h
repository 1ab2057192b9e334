// What the multi-process test workers (dist_worker.cpp, fsdp_worker.cpp) share: a check that
// fails the rank with a message, the comparisons and error captures of their scenarios, and
// the main that runs a scenario by name. The GTest side that runs them: test_util.h.
//
//   int main(int argc, char** argv) {
//     return kiln::test::run_worker("fsdp_worker", scenarios(), argc, argv);
//   }
#pragma once

#include <chrono>
#include <cmath>
#include <functional>
#include <iostream>
#include <map>
#include <string>
#include <vector>

#include "dist/dist.h"
#include "kiln.h"

namespace kiln::test {

struct CheckFailed {
  std::string what;
};

#define WCHECK(cond, ...)                                                                          \
  do {                                                                                             \
    if (!(cond)) {                                                                                 \
      throw ::kiln::test::CheckFailed{::kiln::internal::str_cat(__FILE__, ":", __LINE__, ": ",     \
                                                                #cond, " failed: ", __VA_ARGS__)}; \
    }                                                                                              \
  } while (0)

// |got - want| <= tol (1 + |want|) element by element.
inline void expect_close(const Tensor& got, const Tensor& want, double tol,
                         const std::string& what) {
  WCHECK(got.sizes() == want.sizes(), what, ": shape ", shape_str(got.sizes()), " vs ",
         shape_str(want.sizes()));
  const auto g = got.to_vector<double>();
  const auto w = want.to_vector<double>();
  for (size_t i = 0; i < g.size(); ++i) {
    WCHECK(std::abs(g[i] - w[i]) <= tol * (1 + std::abs(w[i])), what, ": element ", i, " is ", g[i],
           ", expected ", w[i]);
  }
}

// Each parameter in `got` is close to the one of `want` at its index (expect_close): its value,
// or its gradient. A failure names `when` and the parameter ("step 2: weight 0").
inline void expect_weights_close(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                                 double tol, const std::string& when) {
  for (size_t i = 0; i < got.size(); ++i)
    expect_close(got[i], want[i], tol, when + "weight " + std::to_string(i));
}
inline void expect_grads_close(const std::vector<Tensor>& got, const std::vector<Tensor>& want,
                               double tol, const std::string& when) {
  for (size_t i = 0; i < got.size(); ++i)
    expect_close(got[i].grad(), want[i].grad(), tol, when + "gradient " + std::to_string(i));
}

// The mean over the ranks of each rank's loss (its part of the global batch) equals the loss
// `ref` one process computed on the whole batch, to tol (1 + |ref|).
inline void expect_global_loss(dist::ProcessGroup& pg, double loss, double ref, int step,
                               double tol = 1e-12) {
  Tensor l = full({1}, loss, kDouble);
  pg.all_reduce(l, dist::ReduceOp::kAvg)->wait();
  WCHECK(std::abs(l.item<double>() - ref) < tol * (1 + std::abs(ref)), "step ", step, ": loss ",
         l.item<double>(), " vs one process ", ref);
}

// The message of what f throws ("" when it does not throw).
inline std::string error_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

inline dist::InitOptions short_timeout(int ms) {
  dist::InitOptions o;
  o.timeout = std::chrono::milliseconds(ms);
  return o;
}

using Scenarios = std::map<std::string, std::function<void()>>;

// Runs scenario argv[1]: exit 0 when every check held, 1 on a failed check or an error, 2 for an
// unknown scenario.
inline int run_worker(const char* program, const Scenarios& scenarios, int argc, char** argv) {
  if (argc < 2 || !scenarios.contains(argv[1])) {
    std::cerr << "usage: " << program << " SCENARIO (";
    for (const auto& [name, f] : scenarios) std::cerr << name << " ";
    std::cerr << ")\n";
    return 2;
  }
  try {
    scenarios.at(argv[1])();
  } catch (const CheckFailed& c) {
    std::cerr << "CHECK FAILED: " << c.what << "\n";
    return 1;
  } catch (const std::exception& e) {
    std::cerr << "ERROR: " << e.what() << "\n";
    return 1;
  }
  return 0;
}

}  // namespace kiln::test
