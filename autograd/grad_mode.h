// Grad mode: whether ops record the autograd graph, per thread.
//
//   { kiln::NoGradGuard no_grad; w -= lr * w.grad(); }   // an update outside the graph
//   kiln::AutoGradMode enable(true);                      // force recording on or off
//   kiln::InferenceMode guard;                            // no recording (inference)
#pragma once

namespace kiln {

class GradMode {
 public:
  static bool is_enabled();
  static void set_enabled(bool enabled);
};

// Sets grad mode for its scope and restores the previous mode.
class AutoGradMode {
 public:
  explicit AutoGradMode(bool enabled) : prev_(GradMode::is_enabled()) {
    GradMode::set_enabled(enabled);
  }
  ~AutoGradMode() { GradMode::set_enabled(prev_); }
  AutoGradMode(const AutoGradMode&) = delete;
  AutoGradMode& operator=(const AutoGradMode&) = delete;

 private:
  bool prev_;
};

class NoGradGuard : public AutoGradMode {
 public:
  NoGradGuard() : AutoGradMode(false) {}
};

// No graph recording while alive, as torch::InferenceMode (kiln keeps no separate
// inference-tensor kind: tensors made here are ordinary tensors without history).
class InferenceMode : public AutoGradMode {
 public:
  explicit InferenceMode(bool enabled = true) : AutoGradMode(!enabled) {}
  static bool is_enabled();
};

}  // namespace kiln
