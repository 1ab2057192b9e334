// kiln::pretrain::Progress: the progress display of `kiln prepare` and `kiln pretrain`: a bar
// redrawn in place with the rate and ETA on a terminal, plain lines (one per call of line()) when
// the output is a file or a pipe.
//
//   Progress p(std::cout, Progress::is_terminal(std::cout), /*total=*/200, "step");
//   for (...) {
//     p.update(step, "loss 2.31 | lr 3.0e-03");   // terminal: redraws (at most 10 times a second)
//     if (step % 10 == 0) p.line(step, "loss 2.31 | lr 3.0e-03");  // plain: prints this line
//   }
//   p.finish();
//
// On a terminal, line() prints its text above the bar (the bar is redrawn below it), so that
// evaluations and checkpoints stay in the scroll-back; update() only redraws the bar.
#pragma once

#include <chrono>
#include <cstdint>
#include <ostream>
#include <string>

namespace kiln::pretrain {

class Progress {
 public:
  // total: the work's size in `unit`s (steps, bytes); start: work already done before (a resumed
  // run), not counted in the rate.
  Progress(std::ostream& out, bool terminal, double total, std::string unit, double start = 0);

  // Whether `out` is std::cout or std::cerr attached to a terminal (and TERM is not "dumb").
  static bool is_terminal(const std::ostream& out);
  // "1:02:03" or "4:05".
  static std::string format_duration(double seconds);

  void update(double done, const std::string& fields);
  // A line that stays: printed on a terminal above the bar, and as is otherwise.
  void line(const std::string& text);
  void finish();

  // Seconds left at the rate since the start (NaN before any progress).
  double eta_seconds(double done) const;
  bool terminal() const { return terminal_; }

 private:
  void draw(double done, const std::string& fields);
  void clear();

  std::ostream& out_;
  bool terminal_;
  double total_, start_;
  std::string unit_;
  std::chrono::steady_clock::time_point t0_, last_draw_;
  bool drawn_ = false;
  double last_done_ = 0;
  std::string last_fields_;
};

}  // namespace kiln::pretrain
