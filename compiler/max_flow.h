// A maximum s-t flow on a small directed graph (Dinic's algorithm), and the minimum cuts it
// implies: what the remat partitioner (compiler/partition.h) uses to choose the values a compiled
// backward saves.
//
//   compiler::MaxFlow g(4);                 // nodes 0..3
//   g.add_edge(0, 1, 3);
//   g.add_edge(1, 3, 2);
//   g.add_edge(0, 2, 1);
//   g.add_edge(2, 3, 5);
//   int64_t f = g.run(0, 3);                // 3
//   std::vector<bool> t = g.reaches_sink(); // the sink side of the cut nearest the sink
//
// Capacities are non-negative int64; kInfinity stands for an edge that is never cut. run()
// stops as soon as the flow reaches kInfinity (a cut of only finite edges does not exist), so
// sums of infinite paths never overflow. After run(), the residual graph gives two minimum cuts:
// reaches_source() (nodes the source still reaches: the cut nearest the source) and
// reaches_sink() (nodes that still reach the sink: the cut nearest the sink).
#pragma once

#include <cstdint>
#include <vector>

namespace kiln::compiler {

class MaxFlow {
 public:
  static constexpr int64_t kInfinity = int64_t{1} << 60;

  explicit MaxFlow(int nodes = 0);
  int add_node();
  int nodes() const { return static_cast<int>(first_.size()); }
  // Adds an edge from `from` to `to`; parallel edges add up.
  void add_edge(int from, int to, int64_t capacity);

  // The value of a maximum flow from `source` to `sink`, capped at kInfinity.
  int64_t run(int source, int sink);

  // After run(): per node, whether the source reaches it through edges with residual capacity.
  std::vector<bool> reaches_source() const;
  // After run(): per node, whether it reaches the sink through edges with residual capacity.
  std::vector<bool> reaches_sink() const;

 private:
  struct Edge {
    int to;
    int next;  // the next edge out of the same node, or -1
    int64_t capacity;
  };
  bool levels(int source, int sink);
  int64_t push(int node, int sink, int64_t limit);

  std::vector<Edge> edges_;  // edge 2k is forward, 2k+1 its reverse
  std::vector<int> first_;   // per node: its first edge, or -1
  std::vector<int> level_, cursor_;
  int source_ = -1, sink_ = -1;
};

}  // namespace kiln::compiler
