// The progress bar of `kiln prepare` and `kiln pretrain` (pretrain/progress.h).
// Tests: tests/pretrain/progress_test.cpp.
#include "pretrain/progress.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <iostream>
#include <sstream>

namespace kiln::pretrain {

using Clock = std::chrono::steady_clock;

Progress::Progress(std::ostream& out, bool terminal, double total, std::string unit, double start)
    : out_(out),
      terminal_(terminal),
      total_(total),
      start_(start),
      unit_(std::move(unit)),
      t0_(Clock::now()),
      last_draw_(t0_ - std::chrono::seconds(1)),
      last_done_(start) {}

bool Progress::is_terminal(const std::ostream& out) {
  const char* term = std::getenv("TERM");
  if (term != nullptr && std::strcmp(term, "dumb") == 0) return false;
  if (&out == &std::cout) return ::isatty(STDOUT_FILENO) == 1;
  if (&out == &std::cerr || &out == &std::clog) return ::isatty(STDERR_FILENO) == 1;
  return false;
}

std::string Progress::format_duration(double seconds) {
  if (!std::isfinite(seconds) || seconds < 0) return "?";
  const auto s = static_cast<int64_t>(std::llround(seconds));
  char buf[32];
  if (s >= 3600) {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld:%02lld", static_cast<long long>(s / 3600),
                  static_cast<long long>(s / 60 % 60), static_cast<long long>(s % 60));
  } else {
    std::snprintf(buf, sizeof(buf), "%lld:%02lld", static_cast<long long>(s / 60),
                  static_cast<long long>(s % 60));
  }
  return buf;
}

double Progress::eta_seconds(double done) const {
  const double elapsed = std::chrono::duration<double>(Clock::now() - t0_).count();
  const double rate = (done - start_) / elapsed;
  if (!(rate > 0) || !std::isfinite(rate)) return std::nan("");
  return std::max(0.0, (total_ - done) / rate);
}

void Progress::clear() {
  if (drawn_) out_ << "\r\033[2K";
  drawn_ = false;
}

void Progress::draw(double done, const std::string& fields) {
  constexpr int kWidth = 24;
  const double frac = total_ > 0 ? std::clamp(done / total_, 0.0, 1.0) : 1.0;
  const int filled = static_cast<int>(frac * kWidth);
  std::ostringstream s;
  s << "\r\033[2K" << unit_ << " ";
  if (unit_ == "step") {
    s << static_cast<int64_t>(done) << "/" << static_cast<int64_t>(total_) << " ";
  }
  s << "[" << std::string(static_cast<size_t>(filled), '#')
    << std::string(static_cast<size_t>(kWidth - filled), '.') << "] "
    << static_cast<int>(frac * 100) << "%";
  if (!fields.empty()) s << " | " << fields;
  s << " | ETA " << format_duration(eta_seconds(done));
  out_ << s.str() << std::flush;
  drawn_ = true;
}

void Progress::update(double done, const std::string& fields) {
  last_done_ = done;
  last_fields_ = fields;
  if (!terminal_) return;
  const auto now = Clock::now();
  if (now - last_draw_ < std::chrono::milliseconds(100) && done < total_) return;
  last_draw_ = now;
  draw(done, fields);
}

void Progress::line(const std::string& text) {
  if (terminal_) {
    clear();
    out_ << text << "\n";
    draw(last_done_, last_fields_);
  } else {
    out_ << text << "\n" << std::flush;
  }
}

void Progress::finish() {
  if (terminal_ && drawn_) {
    draw(last_done_, last_fields_);
    out_ << "\n" << std::flush;
    drawn_ = false;
  }
}

}  // namespace kiln::pretrain
