// kiln::pretrain::MetricsLog: a run's metrics beside its checkpoints, as `kiln pretrain` writes
// them: metrics.jsonl (one JSON object per line) and metrics.svg (train and validation loss and
// the learning rate against the step), refreshed as the run goes.
//
//   MetricsLog m("out/run", /*resume_step=*/0);
//   m.train(step, loss, lr, grad_norm, tok_s, mem_bytes);  // appends a line
//   m.eval(step, val_loss);
//   m.write_plot();                                       // metrics.svg, atomically
//
// Lines: {"step": 12, "loss": 2.31, "lr": 0.0012, "grad_norm": 0.51, "tok_s": 5210,
// "mem_bytes": 325058560} for a training step, {"step": 100, "val_loss": 2.45} for an evaluation.
//
// A resumed run (resume_step > 0) keeps the lines of steps <= resume_step, drops later ones (a
// run killed after its last checkpoint logged steps the resumed run does again) and rewrites the
// file atomically before appending; the plot then shows the whole run. Lines that cannot be
// parsed are an error naming the file and line.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>
#include <vector>

namespace kiln::pretrain {

class MetricsLog {
 public:
  MetricsLog(const std::string& dir, int64_t resume_step);

  void train(int64_t step, double loss, double lr, double grad_norm, double tok_s,
             int64_t mem_bytes);
  void eval(int64_t step, double val_loss);
  void write_plot() const;

  struct Point {
    int64_t step;
    double value;
  };
  const std::vector<Point>& losses() const { return loss_; }
  const std::vector<Point>& val_losses() const { return val_; }
  const std::vector<Point>& lrs() const { return lr_; }
  std::string jsonl_path() const;
  std::string svg_path() const;

 private:
  std::string dir_;
  std::ofstream out_;
  std::vector<Point> loss_, val_, lr_;
};

// The SVG of the three curves (for tests and tools): loss and val loss on the left axis, lr on
// the right one.
std::string metrics_svg(const std::vector<MetricsLog::Point>& loss,
                        const std::vector<MetricsLog::Point>& val,
                        const std::vector<MetricsLog::Point>& lr);

}  // namespace kiln::pretrain
