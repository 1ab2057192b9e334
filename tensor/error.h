// kiln::Error and KILN_CHECK: how kiln reports misuse.
//
// Every error kiln raises is a kiln::Error (a std::runtime_error). Its message starts with the
// name of the op in brackets and shows the offending shapes, dtypes or devices:
//
//   KILN_CHECK(a.dim() == 2, "[mm] expected a 2-D tensor, got ", shape_str(a.sizes()));
//
// The message parts are streamed into one string (anything with an operator<< works: numbers,
// strings, dtypes, devices); they are only evaluated when the check fails.
#pragma once

#include <sstream>
#include <stdexcept>
#include <string>

namespace kiln {

class Error : public std::runtime_error {
 public:
  explicit Error(const std::string& what) : std::runtime_error(what) {}
};

namespace internal {
[[noreturn]] void throw_error(const std::string& message);

template <typename... Args>
std::string str_cat(const Args&... args) {
  std::ostringstream os;
  (os << ... << args);
  return os.str();
}
}  // namespace internal

// The arguments streamed into one string, as c10::str: kiln::str("got ", n, " items").
template <typename... Args>
std::string str(const Args&... args) {
  return internal::str_cat(args...);
}

}  // namespace kiln

#define KILN_CHECK(cond, ...)                                      \
  do {                                                             \
    if (!(cond)) [[unlikely]] {                                    \
      ::kiln::internal::throw_error(::kiln::internal::str_cat(__VA_ARGS__)); \
    }                                                              \
  } while (0)

#define KILN_FAIL(...) ::kiln::internal::throw_error(::kiln::internal::str_cat(__VA_ARGS__))
