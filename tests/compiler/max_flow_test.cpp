// MaxFlow (Dinic) on small graphs whose maximum flows and minimum cuts are known by hand, and
// on random graphs against the cut it reports: max flow == capacity of the cut (the theorem),
// for both cuts the residual graph gives.
#include "compiler/max_flow.h"

#include <gtest/gtest.h>

#include <random>
#include <tuple>
#include <vector>

#include "test_util.h"

namespace kiln::compiler {
namespace {

using Edges = std::vector<std::tuple<int, int, int64_t>>;

MaxFlow graph(int nodes, const Edges& edges) {
  MaxFlow g(nodes);
  for (const auto& [u, v, c] : edges) g.add_edge(u, v, c);
  return g;
}

// The capacity of the edges from `side` to its complement.
int64_t cut_capacity(const Edges& edges, const std::vector<bool>& side) {
  int64_t c = 0;
  for (const auto& [u, v, cap] : edges) {
    if (side[static_cast<size_t>(u)] && !side[static_cast<size_t>(v)]) c += cap;
  }
  return c;
}

TEST(MaxFlow, TwoDisjointPaths) {
  // 0 -> 1 -> 3 carries 2 (1 -> 3 is the bottleneck), 0 -> 2 -> 3 carries 1.
  const Edges e = {{0, 1, 3}, {1, 3, 2}, {0, 2, 1}, {2, 3, 5}};
  MaxFlow g = graph(4, e);
  EXPECT_EQ(g.run(0, 3), 3);
  const std::vector<bool> s = g.reaches_source();
  EXPECT_EQ(s, (std::vector<bool>{true, true, false, false}));
  EXPECT_EQ(cut_capacity(e, s), 3);
}

TEST(MaxFlow, ClassicTextbookGraph) {
  // CLRS figure 26.1: the maximum flow is 23.
  const Edges e = {{0, 1, 16}, {0, 2, 13}, {1, 3, 12}, {2, 1, 4}, {2, 4, 14},
                   {3, 2, 9},  {3, 5, 20}, {4, 3, 7},  {4, 5, 4}};
  MaxFlow g = graph(6, e);
  EXPECT_EQ(g.run(0, 5), 23);
  EXPECT_EQ(cut_capacity(e, g.reaches_source()), 23);
}

TEST(MaxFlow, NearestCutsDifferOnAChainOfEqualEdges) {
  // 0 -> 1 -> 2 -> 3 with capacities 5, 5, 5: any edge is a minimum cut. The cut nearest the
  // source takes the first, the one nearest the sink the last.
  const Edges e = {{0, 1, 5}, {1, 2, 5}, {2, 3, 5}};
  MaxFlow g = graph(4, e);
  EXPECT_EQ(g.run(0, 3), 5);
  EXPECT_EQ(g.reaches_source(), (std::vector<bool>{true, false, false, false}));
  EXPECT_EQ(g.reaches_sink(), (std::vector<bool>{false, false, false, true}));
}

TEST(MaxFlow, InfiniteEdgesAreNeverCut) {
  // A split node (1 -> 2, capacity 7) between infinite edges: the cut is that edge.
  MaxFlow g = graph(4, {{0, 1, MaxFlow::kInfinity}, {1, 2, 7}, {2, 3, MaxFlow::kInfinity}});
  EXPECT_EQ(g.run(0, 3), 7);
  // Only infinite edges: the flow stops at kInfinity instead of overflowing.
  MaxFlow inf = graph(3, {{0, 1, MaxFlow::kInfinity},
                          {0, 1, MaxFlow::kInfinity},
                          {1, 2, MaxFlow::kInfinity},
                          {1, 2, MaxFlow::kInfinity}});
  EXPECT_EQ(inf.run(0, 2), MaxFlow::kInfinity);
}

TEST(MaxFlow, DisconnectedSinkHasNoFlow) {
  MaxFlow g = graph(3, {{0, 1, 4}});
  EXPECT_EQ(g.run(0, 2), 0);
  EXPECT_EQ(g.reaches_source(), (std::vector<bool>{true, true, false}));
}

TEST(MaxFlow, RandomGraphsFlowEqualsBothCuts) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 200; ++trial) {
    const int n = 2 + static_cast<int>(rng() % 12);
    Edges e;
    const int m = static_cast<int>(rng() % 40);
    for (int k = 0; k < m; ++k) {
      e.emplace_back(static_cast<int>(rng() % n), static_cast<int>(rng() % n),
                     static_cast<int64_t>(rng() % 20));
    }
    MaxFlow g = graph(n, e);
    const int64_t flow = g.run(0, n - 1);
    const std::vector<bool> s = g.reaches_source();
    std::vector<bool> t = g.reaches_sink();
    for (size_t i = 0; i < t.size(); ++i) t[i] = !t[i];  // the source side of the sink's cut
    EXPECT_TRUE(s[0] && !s[static_cast<size_t>(n - 1)]);
    EXPECT_TRUE(t[0] && !t[static_cast<size_t>(n - 1)]);
    EXPECT_EQ(cut_capacity(e, s), flow) << "trial " << trial;
    EXPECT_EQ(cut_capacity(e, t), flow) << "trial " << trial;
  }
}

TEST(MaxFlow, BadArgumentsAreErrors) {
  MaxFlow g(2);
  EXPECT_KILN_ERROR(g.add_edge(0, 2, 1), "[MaxFlow] add_edge(0, 2, 1)");
  EXPECT_KILN_ERROR(g.add_edge(0, 1, -1), "capacities be non-negative");
  EXPECT_KILN_ERROR(g.run(1, 1), "source and sink must be two of its nodes");
}

}  // namespace
}  // namespace kiln::compiler
