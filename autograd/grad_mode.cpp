#include "autograd/grad_mode.h"

namespace kiln {

namespace {
thread_local bool t_grad_enabled = true;
}

bool GradMode::is_enabled() { return t_grad_enabled; }
void GradMode::set_enabled(bool enabled) { t_grad_enabled = enabled; }
bool InferenceMode::is_enabled() { return !t_grad_enabled; }

}  // namespace kiln
