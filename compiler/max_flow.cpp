#include "compiler/max_flow.h"

#include <algorithm>

#include "tensor/error.h"

namespace kiln::compiler {

MaxFlow::MaxFlow(int nodes) : first_(static_cast<size_t>(nodes), -1) {}

int MaxFlow::add_node() {
  first_.push_back(-1);
  return nodes() - 1;
}

void MaxFlow::add_edge(int from, int to, int64_t capacity) {
  KILN_CHECK(from >= 0 && from < nodes() && to >= 0 && to < nodes() && capacity >= 0,
             "[MaxFlow] add_edge(", from, ", ", to, ", ", capacity, ") on a graph of ", nodes(),
             " nodes: nodes must exist and capacities be non-negative");
  capacity = std::min(capacity, kInfinity);
  edges_.push_back({to, first_[static_cast<size_t>(from)], capacity});
  first_[static_cast<size_t>(from)] = static_cast<int>(edges_.size()) - 1;
  edges_.push_back({from, first_[static_cast<size_t>(to)], 0});
  first_[static_cast<size_t>(to)] = static_cast<int>(edges_.size()) - 1;
}

// Breadth-first levels from the source over edges with residual capacity; whether the sink is
// reached.
bool MaxFlow::levels(int source, int sink) {
  level_.assign(first_.size(), -1);
  std::vector<int> queue{source};
  level_[static_cast<size_t>(source)] = 0;
  for (size_t head = 0; head < queue.size(); ++head) {
    const int u = queue[head];
    for (int e = first_[static_cast<size_t>(u)]; e >= 0; e = edges_[static_cast<size_t>(e)].next) {
      const Edge& edge = edges_[static_cast<size_t>(e)];
      if (edge.capacity > 0 && level_[static_cast<size_t>(edge.to)] < 0) {
        level_[static_cast<size_t>(edge.to)] = level_[static_cast<size_t>(u)] + 1;
        queue.push_back(edge.to);
      }
    }
  }
  return level_[static_cast<size_t>(sink)] >= 0;
}

// Pushes up to `limit` from `node` towards the sink along strictly increasing levels; returns
// what it pushed. Each node's cursor skips edges that are saturated or lead nowhere.
int64_t MaxFlow::push(int node, int sink, int64_t limit) {
  if (node == sink) return limit;
  for (int& e = cursor_[static_cast<size_t>(node)]; e >= 0;
       e = edges_[static_cast<size_t>(e)].next) {
    Edge& edge = edges_[static_cast<size_t>(e)];
    if (edge.capacity <= 0 ||
        level_[static_cast<size_t>(edge.to)] != level_[static_cast<size_t>(node)] + 1) {
      continue;
    }
    const int64_t pushed = push(edge.to, sink, std::min(limit, edge.capacity));
    if (pushed > 0) {
      edge.capacity -= pushed;
      edges_[static_cast<size_t>(e ^ 1)].capacity += pushed;
      return pushed;
    }
  }
  return 0;
}

int64_t MaxFlow::run(int source, int sink) {
  KILN_CHECK(source >= 0 && source < nodes() && sink >= 0 && sink < nodes() && source != sink,
             "[MaxFlow] run(", source, ", ", sink, ") on a graph of ", nodes(),
             " nodes: source and sink must be two of its nodes");
  source_ = source;
  sink_ = sink;
  int64_t flow = 0;
  while (flow < kInfinity && levels(source, sink)) {
    cursor_ = first_;
    while (flow < kInfinity) {
      const int64_t pushed = push(source, sink, kInfinity - flow);
      if (pushed == 0) break;
      flow += pushed;
    }
  }
  return flow;
}

std::vector<bool> MaxFlow::reaches_source() const {
  KILN_CHECK(source_ >= 0, "[MaxFlow] reaches_source() before run()");
  std::vector<bool> seen(first_.size(), false);
  std::vector<int> stack{source_};
  seen[static_cast<size_t>(source_)] = true;
  while (!stack.empty()) {
    const int u = stack.back();
    stack.pop_back();
    for (int e = first_[static_cast<size_t>(u)]; e >= 0; e = edges_[static_cast<size_t>(e)].next) {
      const Edge& edge = edges_[static_cast<size_t>(e)];
      if (edge.capacity > 0 && !seen[static_cast<size_t>(edge.to)]) {
        seen[static_cast<size_t>(edge.to)] = true;
        stack.push_back(edge.to);
      }
    }
  }
  return seen;
}

std::vector<bool> MaxFlow::reaches_sink() const {
  KILN_CHECK(sink_ >= 0, "[MaxFlow] reaches_sink() before run()");
  // u reaches the sink when some edge u -> v has residual capacity and v reaches it: walk the
  // edges into v backwards (edge e ^ 1 out of v is the reverse of an edge u -> v).
  std::vector<bool> seen(first_.size(), false);
  std::vector<int> stack{sink_};
  seen[static_cast<size_t>(sink_)] = true;
  while (!stack.empty()) {
    const int v = stack.back();
    stack.pop_back();
    for (int e = first_[static_cast<size_t>(v)]; e >= 0; e = edges_[static_cast<size_t>(e)].next) {
      const int u = edges_[static_cast<size_t>(e)].to;
      if (edges_[static_cast<size_t>(e ^ 1)].capacity > 0 && !seen[static_cast<size_t>(u)]) {
        seen[static_cast<size_t>(u)] = true;
        stack.push_back(u);
      }
    }
  }
  return seen;
}

}  // namespace kiln::compiler
