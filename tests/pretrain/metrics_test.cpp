// A run's metrics.jsonl and metrics.svg (pretrain/metrics.h): the lines, the plot, and a resume
// that drops the lines after its checkpoint.
#include "pretrain/metrics.h"

#include <gtest/gtest.h>

#include <cmath>
#include <sstream>

#include "pretrain_test_util.h"
#include "test_util.h"

namespace kiln::pretrain {
namespace {

class MetricsTest : public test::TempDirTest {};

TEST_F(MetricsTest, LinesAndPlot) {
  {
    MetricsLog m(dir().string(), 0);
    for (int64_t s = 1; s <= 5; ++s) m.train(s, 5.0 - 0.5 * s, 1e-3 * s, 0.5, 1000, 1 << 20);
    m.eval(4, 3.25);
    m.eval(5, NAN);  // no validation split: written as null
    m.write_plot();
  }
  const std::string jsonl = test::read_bytes(file("metrics.jsonl"));
  EXPECT_NE(jsonl.find("{\"step\": 1, \"loss\": 4.5, \"lr\": 0.001, \"grad_norm\": 0.5, \"tok_s\": "
                       "1000, \"mem_bytes\": 1048576}\n"),
            std::string::npos)
      << jsonl;
  EXPECT_NE(jsonl.find("{\"step\": 4, \"val_loss\": 3.25}\n"), std::string::npos);
  EXPECT_NE(jsonl.find("{\"step\": 5, \"val_loss\": null}\n"), std::string::npos);
  const std::string svg = test::read_bytes(file("metrics.svg"));
  EXPECT_EQ(svg.rfind("<svg ", 0), 0u);
  EXPECT_NE(svg.find("train loss"), std::string::npos);
  EXPECT_EQ(std::count(svg.begin(), svg.end(), '\n') > 10, true);
  // Three curves: loss, lr, val loss; and a marker per finite evaluation.
  size_t polylines = 0, circles = 0;
  for (size_t at = 0; (at = svg.find("<polyline", at)) != std::string::npos; ++at) ++polylines;
  for (size_t at = 0; (at = svg.find("<circle", at)) != std::string::npos; ++at) ++circles;
  EXPECT_EQ(polylines, 3u);
  EXPECT_EQ(circles, 1u);
  // The first loss point is at the left edge and the top of the plot (the highest loss).
  EXPECT_NE(svg.find("points=\"60.0,30.0 "), std::string::npos) << svg;
}

TEST_F(MetricsTest, AResumeDropsTheLinesAfterItsCheckpoint) {
  {
    MetricsLog m(dir().string(), 0);
    for (int64_t s = 1; s <= 6; ++s) m.train(s, 3.0, 1e-3, 0.5, 1000, 0);
    m.eval(2, 2.5);
    m.eval(6, 2.0);
  }
  MetricsLog resumed(dir().string(), 4);
  EXPECT_EQ(resumed.losses().size(), 4u);
  ASSERT_EQ(resumed.val_losses().size(), 1u);
  EXPECT_EQ(resumed.val_losses()[0].step, 2);
  resumed.train(5, 2.9, 1e-3, 0.5, 1000, 0);
  const std::string jsonl = test::read_bytes(file("metrics.jsonl"));
  EXPECT_EQ(std::count(jsonl.begin(), jsonl.end(), '\n'), 6);  // steps 1-4, eval 2, step 5
  EXPECT_EQ(jsonl.find("\"step\": 6"), std::string::npos);
  // A fresh run (resume_step 0) starts a new file.
  MetricsLog fresh(dir().string(), 0);
  EXPECT_EQ(test::read_bytes(file("metrics.jsonl")), "");
}

TEST_F(MetricsTest, ADamagedFileIsAnErrorNamingTheLine) {
  test::write_bytes(file("metrics.jsonl"),
                    "{\"step\": 1, \"loss\": 2}\n{\"step\": 2, \"loss\": \n");
  EXPECT_KILN_ERROR(MetricsLog(dir().string(), 5), "metrics.jsonl:2: ");
  test::write_bytes(file("metrics.jsonl"), "{\"loss\": 2}\n");
  EXPECT_KILN_ERROR(MetricsLog(dir().string(), 5), "metrics.jsonl:1: no \"step\"");
}

}  // namespace
}  // namespace kiln::pretrain
