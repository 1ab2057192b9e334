// metrics.jsonl and metrics.svg of a pretraining run (pretrain/metrics.h).
// Tests: tests/pretrain/metrics_test.cpp.
#include "pretrain/metrics.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <iomanip>
#include <limits>
#include <sstream>

#include "nn/json.h"
#include "nn/safetensors.h"
#include "tensor/error.h"

namespace kiln::pretrain {
namespace {

namespace fs = std::filesystem;

std::string number(double v) {
  if (!std::isfinite(v)) return "null";
  std::ostringstream s;
  s << std::setprecision(9) << v;
  return s.str();
}

}  // namespace

std::string MetricsLog::jsonl_path() const { return (fs::path(dir_) / "metrics.jsonl").string(); }
std::string MetricsLog::svg_path() const { return (fs::path(dir_) / "metrics.svg").string(); }

MetricsLog::MetricsLog(const std::string& dir, int64_t resume_step) : dir_(dir) {
  const std::string path = jsonl_path();
  std::string kept;
  if (resume_step > 0 && fs::exists(path)) {
    std::istringstream in(read_file(path, "metrics"));
    std::string line;
    for (int64_t n = 1; std::getline(in, line); ++n) {
      if (line.empty()) continue;
      int64_t step = -1;
      double loss = NAN, lr = NAN, val = NAN;
      try {
        nn::JsonReader r(line);
        r.begin_object();
        while (auto key = r.next_key()) {
          if (*key == "step") {
            step = r.read_int64("step");
          } else if (r.peek_kind() == 'z') {
            r.skip_value();
          } else if (*key == "loss") {
            loss = r.read_double("loss");
          } else if (*key == "lr") {
            lr = r.read_double("lr");
          } else if (*key == "val_loss") {
            val = r.read_double("val_loss");
          } else {
            r.skip_value();
          }
        }
        r.end_document();
      } catch (const nn::JsonError& e) {
        KILN_FAIL("[metrics] ", path, ":", n, ": ", e.what());
      }
      KILN_CHECK(step >= 0, "[metrics] ", path, ":", n, ": no \"step\"");
      if (step > resume_step) continue;
      kept += line + "\n";
      if (!std::isnan(loss)) loss_.push_back({step, loss});
      if (!std::isnan(lr)) lr_.push_back({step, lr});
      if (!std::isnan(val)) val_.push_back({step, val});
    }
  }
  write_file_atomically(path, kept, "metrics");
  out_.open(path, std::ios::app);
  KILN_CHECK(out_.good(), "[metrics] ", path, ": cannot open for appending");
}

void MetricsLog::train(int64_t step, double loss, double lr, double grad_norm, double tok_s,
                       int64_t mem_bytes) {
  out_ << "{\"step\": " << step << ", \"loss\": " << number(loss) << ", \"lr\": " << number(lr)
       << ", \"grad_norm\": " << number(grad_norm) << ", \"tok_s\": " << number(tok_s)
       << ", \"mem_bytes\": " << mem_bytes << "}\n"
       << std::flush;
  loss_.push_back({step, loss});
  lr_.push_back({step, lr});
}

void MetricsLog::eval(int64_t step, double val_loss) {
  out_ << "{\"step\": " << step << ", \"val_loss\": " << number(val_loss) << "}\n" << std::flush;
  if (std::isfinite(val_loss)) val_.push_back({step, val_loss});
}

void MetricsLog::write_plot() const {
  write_file_atomically(svg_path(), metrics_svg(loss_, val_, lr_), "metrics");
}

std::string metrics_svg(const std::vector<MetricsLog::Point>& loss,
                        const std::vector<MetricsLog::Point>& val,
                        const std::vector<MetricsLog::Point>& lr) {
  constexpr double kW = 720, kH = 360, kLeft = 60, kRight = 70, kTop = 30, kBottom = 40;
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  int64_t max_step = 1, min_step = std::numeric_limits<int64_t>::max();
  double lo = std::numeric_limits<double>::infinity(), hi = -lo, lr_hi = 0;
  for (const auto* series : {&loss, &val}) {
    for (const auto& p : *series) {
      if (!std::isfinite(p.value)) continue;
      lo = std::min(lo, p.value), hi = std::max(hi, p.value);
      max_step = std::max(max_step, p.step), min_step = std::min(min_step, p.step);
    }
  }
  for (const auto& p : lr) {
    if (std::isfinite(p.value)) lr_hi = std::max(lr_hi, p.value);
  }
  if (min_step > max_step) min_step = 0;
  if (!(hi > lo)) lo = std::isfinite(lo) ? lo - 0.5 : 0, hi = lo + 1;
  if (!(lr_hi > 0)) lr_hi = 1;
  const double step_span = std::max<double>(1, static_cast<double>(max_step - min_step));
  auto x = [&](int64_t s) { return kLeft + pw * static_cast<double>(s - min_step) / step_span; };
  auto y = [&](double v) { return kTop + ph * (1 - (v - lo) / (hi - lo)); };
  auto y_lr = [&](double v) { return kTop + ph * (1 - v / lr_hi); };
  std::ostringstream s;
  s << std::fixed << std::setprecision(1);
  s << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << kW << "\" height=\"" << kH
    << "\" font-family=\"sans-serif\" font-size=\"11\">\n"
    << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n"
    << "<rect x=\"" << kLeft << "\" y=\"" << kTop << "\" width=\"" << pw << "\" height=\"" << ph
    << "\" fill=\"none\" stroke=\"#888\"/>\n";
  int64_t last_tick = -1;
  for (int i = 0; i <= 4; ++i) {
    const double v = lo + (hi - lo) * i / 4, l = lr_hi * i / 4;
    s << "<text x=\"" << kLeft - 6 << "\" y=\"" << y(v) + 4 << "\" text-anchor=\"end\">"
      << std::setprecision(2) << v << std::setprecision(1) << "</text>\n"
      << "<text x=\"" << kLeft + pw + 6 << "\" y=\"" << y(v) + 4 << "\" fill=\"#c60\">"
      << std::scientific << std::setprecision(2) << l << std::fixed << std::setprecision(1)
      << "</text>\n";
    const int64_t st = min_step + static_cast<int64_t>(std::llround(step_span * i / 4));
    if (st == last_tick) continue;  // a run of fewer than 4 steps
    last_tick = st;
    s << "<text x=\"" << x(st) << "\" y=\"" << kTop + ph + 16 << "\" text-anchor=\"middle\">" << st
      << "</text>\n";
  }
  s << "<text x=\"" << kLeft + pw / 2 << "\" y=\"" << kH - 6
    << "\" text-anchor=\"middle\">step</text>\n";
  auto polyline = [&](const std::vector<MetricsLog::Point>& pts, const char* color, bool is_lr) {
    if (pts.empty()) return;
    s << "<polyline fill=\"none\" stroke=\"" << color << "\" stroke-width=\"1.5\" points=\"";
    for (const auto& p : pts) {
      if (!std::isfinite(p.value)) continue;
      s << x(p.step) << "," << (is_lr ? y_lr(p.value) : y(p.value)) << " ";
    }
    s << "\"/>\n";
  };
  polyline(loss, "#1f77b4", false);
  polyline(lr, "#c60", true);
  polyline(val, "#2ca02c", false);
  for (const auto& p : val) {
    if (std::isfinite(p.value)) {
      s << "<circle cx=\"" << x(p.step) << "\" cy=\"" << y(p.value)
        << "\" r=\"3\" fill=\"#2ca02c\"/>\n";
    }
  }
  s << "<text x=\"" << kLeft << "\" y=\"18\" fill=\"#1f77b4\">train loss</text>\n"
    << "<text x=\"" << kLeft + 80 << "\" y=\"18\" fill=\"#2ca02c\">val loss</text>\n"
    << "<text x=\"" << kLeft + 150
    << "\" y=\"18\" fill=\"#c60\">learning rate (right axis)</text>\n"
    << "</svg>\n";
  return s.str();
}

}  // namespace kiln::pretrain
