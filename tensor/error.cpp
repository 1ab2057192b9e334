#include "tensor/error.h"

namespace kiln::internal {

void throw_error(const std::string& message) { throw Error(message); }

}  // namespace kiln::internal
