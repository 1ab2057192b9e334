// Random programs for testing kiln::compile against eager (tests/compiler/random_program_test.cpp).
//
// A Program is data: a list of nodes, each an op kind, the earlier nodes it reads and its
// parameters, with the result shape and dtype the generator predicted. Input nodes (anywhere in
// the list) are the compiled callable's arguments, in order. One interpreter, run(), executes a
// program as kiln ops, eagerly or inside kiln::compile; source() prints it as C++.
//
//   Program p = generate(seed);
//   std::vector<Tensor> args = make_inputs(p);
//   std::vector<Tensor> outs = run(p, args);
//   std::cout << source(p);  // defined in random_program_test.cpp
//
// What it generates: 3-12 ops (unary, broadcasting binary with dtype promotion, tensor-scalar,
// compare, where, cast, sum / mean / amax over random dims, reshape / transpose / permute / slice /
// unsqueeze / expand / select / index_select / cat, matmul, and the fused rms_norm, layer_norm,
// softmax, log_softmax and swiglu) over f32, f64, int64 and bool tensors of rank 0-4 with size-0
// and size-1 dims; float arguments require grad at random, some are passed transposed (strided),
// some twice (one tensor as two arguments); 1-3 outputs, rarely an argument itself or one node
// twice; one program in ten runs under NoGradGuard.
//
// The generator only builds programs eager accepts: it computes every node's shape and dtype
// (result dtypes of mixed binary ops come from kiln::result_type) and picks parameters that are
// valid for them; run_nodes() lets a test check those predictions against eager.
#pragma once

#include <algorithm>
#include <array>
#include <cstdint>
#include <numeric>
#include <optional>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "kiln.h"

namespace kiln::test {

enum class OpKind : uint8_t {
  // A tensor argument: randn / randint / bool data from the node's own seed, passed transposed
  // when ints is {1}; with in {j}, the same tensor as input j (an aliased argument).
  kInput,
  kIndexInput,  // an int64 index argument of length shape[0], values in [0, ints[0])
  kUnary,
  kBinary,   // broadcasting, dtype promotion
  kScalar,   // tensor-scalar op
  kCompare,  // -> bool; with a second node or a scalar
  kWhere,    // where(in0 (bool), in1, in2)
  kCast,
  kSum,
  kMean,
  kAmax,
  kReshape,
  kTranspose,
  kPermute,
  kSlice,  // ints: dim, start, end, step
  kUnsqueeze,
  kExpand,
  kSelect,       // ints: dim, index
  kIndexSelect,  // in1: a kIndexInput; ints: dim
  kMatmul,
  kRmsNorm,    // ints: normalized shape; in1 (optional): weight; scalar: eps
  kLayerNorm,  // ints: normalized shape; fn bit 0: weight, bit 1: bias; scalar: eps
  kSoftmax,
  kLogSoftmax,
  kSwiglu,  // nn::functional::swiglu(in0, in1)
  kCat,     // cat({in0, in1}, ints[0])
};

enum UnaryFn { kExp, kTanh, kRelu, kNeg, kAbs, kSigmoid, kSin, kSquare, kSilu, kLogicalNot };
enum BinaryFn { kAdd, kSub, kMul, kDiv, kMaximum, kMinimum };
enum ScalarFn { kAddS, kMulS, kRsubS, kDivS, kPow2S, kClampS };
enum CompareFn { kGt, kLt, kEq, kNe };

struct Node {
  OpKind op = OpKind::kInput;
  int fn = 0;                 // which unary / binary / scalar / compare function
  std::vector<int> in;        // the earlier nodes it reads
  std::vector<int64_t> ints;  // dims, sizes, slice bounds, as passed to the op
  double scalar = 0;          // a scalar operand or eps
  bool flag = false;          // keepdim; requires_grad for inputs
  uint64_t seed = 0;          // inputs: their data; outputs: the weight w of the loss
  Shape shape;                // predicted result
  ScalarType dtype = kFloat;
};

struct Program {
  uint64_t seed = 0;
  bool no_grad = false;  // run (eager and compiled) under NoGradGuard
  std::vector<Node> nodes;
  std::vector<int> outputs;

  bool is_input(int i) const {
    const OpKind k = nodes[static_cast<size_t>(i)].op;
    return k == OpKind::kInput || k == OpKind::kIndexInput;
  }
};

namespace internal {

inline int64_t numel(const Shape& s) {
  return std::accumulate(s.begin(), s.end(), int64_t{1}, std::multiplies<>());
}

inline std::optional<Shape> broadcast(const Shape& a, const Shape& b) {
  const size_t n = std::max(a.size(), b.size());
  Shape out(n);
  for (size_t i = 0; i < n; ++i) {
    const int64_t da = i < n - a.size() ? 1 : a[i - (n - a.size())];
    const int64_t db = i < n - b.size() ? 1 : b[i - (n - b.size())];
    if (da != db && da != 1 && db != 1) return std::nullopt;
    out[i] = da == 1 ? db : da;
  }
  return out;
}

// broadcast() of shapes the generator made compatible.
inline Shape broadcast_checked(const Shape& a, const Shape& b, int line) {
  std::optional<Shape> s = broadcast(a, b);
  KILN_CHECK(s.has_value(), "[random_program] the generator paired ", shape_str(a), " with ",
             shape_str(b), " line ", line);
  return *s;
}

inline int64_t wrap(int64_t d, int64_t rank) { return d < 0 ? d + rank : d; }

class Generator {
 public:
  explicit Generator(uint64_t seed) : rng_(seed) {
    p_.seed = seed;
    p_.no_grad = chance(0.1);
  }

  Program build() {
    const int num_ops = uniform(3, 12);
    add_input(random_shape(), random_dtype());
    int attempts = 0;
    while (op_count_ < num_ops && attempts++ < 400) add_op();
    // Outputs: the last node, and up to two more of the ops.
    std::vector<int> ops;
    for (int i = 0; i < static_cast<int>(p_.nodes.size()); ++i) {
      if (!p_.is_input(i)) ops.push_back(i);
    }
    if (ops.empty()) ops.push_back(add_node(unary_node(0)));
    p_.outputs.push_back(ops.back());
    const int extra = uniform(0, 2);
    for (int e = 0; e < extra; ++e) {
      const int o = ops[static_cast<size_t>(uniform(0, static_cast<int>(ops.size()) - 1))];
      if (std::find(p_.outputs.begin(), p_.outputs.end(), o) == p_.outputs.end()) {
        p_.outputs.push_back(o);
      }
    }
    // Rarely, an argument returned as it is, or one node returned twice.
    if (chance(0.05)) p_.outputs.push_back(0);
    if (chance(0.05)) p_.outputs.push_back(p_.outputs.front());
    for (int o : p_.outputs) p_.nodes[static_cast<size_t>(o)].seed = rng_();
    return p_;
  }

 private:
  int uniform(int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng_); }
  bool chance(double p) { return std::uniform_real_distribution<double>(0, 1)(rng_) < p; }
  template <typename T>
  T pick(std::initializer_list<T> options) {
    return options.begin()[uniform(0, static_cast<int>(options.size()) - 1)];
  }
  const Node& node(int i) const { return p_.nodes[static_cast<size_t>(i)]; }
  static bool is_float(ScalarType t) { return t == kFloat || t == kDouble; }

  Shape random_shape() {
    Shape s(static_cast<size_t>(pick({0, 1, 1, 2, 2, 2, 3, 3, 4})));
    for (int64_t& d : s) d = chance(0.08) ? 0 : pick<int64_t>({1, 1, 2, 2, 3, 4});
    return s;
  }
  ScalarType random_dtype() {
    return pick({kFloat, kFloat, kFloat, kFloat, kDouble, kDouble, kDouble, kInt64, kBool});
  }
  // A shape that broadcasts with `s`: leading dims dropped or added, some dims 1, some 1s grown.
  Shape partner_shape(const Shape& s) {
    Shape out = s;
    if (!out.empty() && chance(0.25)) {
      out.erase(out.begin(), out.begin() + uniform(1, static_cast<int>(out.size())));
    }
    for (int64_t& d : out) {
      if (chance(0.25)) {
        d = 1;
      } else if (d == 1 && chance(0.3)) {
        d = pick<int64_t>({0, 2, 3});
      }
    }
    // A new leading dim only where none was dropped: it would align with one of s.
    if (out.size() == s.size() && chance(0.15)) out.insert(out.begin(), pick<int64_t>({1, 2}));
    return out;
  }

  int add_node(Node n) {
    p_.nodes.push_back(std::move(n));
    return static_cast<int>(p_.nodes.size()) - 1;
  }
  int add_input(Shape shape, ScalarType dtype) {
    Node n;
    n.op = OpKind::kInput;
    n.shape = std::move(shape);
    n.dtype = dtype;
    n.flag = is_float(dtype) && chance(0.6);
    if (n.shape.size() >= 2 && chance(0.2)) n.ints = {1};  // passed transposed (strided)
    n.seed = rng_();
    return add_node(std::move(n));
  }
  // An existing node whose shape broadcasts with `s` and whose dtype passes `ok`, or a new input.
  template <typename Ok>
  int partner(const Shape& s, ScalarType dtype, Ok ok) {
    if (chance(0.5)) {
      std::vector<int> cands;
      for (int i = 0; i < static_cast<int>(p_.nodes.size()); ++i) {
        if (node(i).op != OpKind::kIndexInput && ok(node(i).dtype) && broadcast(s, node(i).shape)) {
          cands.push_back(i);
        }
      }
      if (!cands.empty())
        return cands[static_cast<size_t>(uniform(0, static_cast<int>(cands.size()) - 1))];
    }
    ScalarType t = dtype;
    if (chance(0.3)) t = random_dtype();
    if (!ok(t)) t = dtype;
    return add_input(partner_shape(s), t);
  }
  Node unary_node(int x) {
    Node n;
    n.op = OpKind::kUnary;
    n.in = {x};
    n.shape = node(x).shape;
    n.dtype = node(x).dtype;
    if (n.dtype == kBool) {
      n.fn = kLogicalNot;
    } else if (n.dtype == kInt64) {
      n.fn = pick({kNeg, kAbs, kSquare});
    } else {
      n.fn = uniform(kExp, kSilu);
    }
    return n;
  }
  static ScalarType result_dtype(const Node& a, const Node& b) {
    return result_type(empty(a.shape, a.dtype), empty(b.shape, b.dtype));
  }
  // Reduction dims: a random nonempty subset (some negative), or {} for a 0-d tensor;
  // `nonzero` keeps only dims of nonzero size (amax of an empty dim is an error).
  std::optional<std::vector<int64_t>> reduce_dims(const Shape& s, bool nonzero) {
    std::vector<int64_t> dims;
    const int64_t rank = static_cast<int64_t>(s.size());
    for (int64_t d = 0; d < rank; ++d) {
      if ((!nonzero || s[static_cast<size_t>(d)] > 0) && chance(0.5)) {
        dims.push_back(chance(0.3) ? d - rank : d);
      }
    }
    if (dims.empty() && rank > 0) {
      std::vector<int64_t> ok;
      for (int64_t d = 0; d < rank; ++d) {
        if (!nonzero || s[static_cast<size_t>(d)] > 0) ok.push_back(d);
      }
      if (ok.empty()) return std::nullopt;
      dims.push_back(ok[static_cast<size_t>(uniform(0, static_cast<int>(ok.size()) - 1))]);
    }
    return dims;
  }
  static Shape reduced_shape(const Shape& s, const std::vector<int64_t>& dims, bool keepdim) {
    const int64_t rank = static_cast<int64_t>(s.size());
    Shape out;
    for (int64_t d = 0; d < rank; ++d) {
      bool reduced = false;
      for (int64_t r : dims) reduced |= wrap(r, rank) == d;
      if (!reduced) {
        out.push_back(s[static_cast<size_t>(d)]);
      } else if (keepdim) {
        out.push_back(1);
      }
    }
    return out;
  }
  Shape reshape_target(const Shape& s, std::vector<int64_t>& ints) {
    const int64_t total = numel(s);
    int64_t n = total;
    Shape out;
    if (n == 0) {
      out.resize(static_cast<size_t>(uniform(1, 3)));
      for (int64_t& d : out) d = pick<int64_t>({1, 2, 3});
      out[static_cast<size_t>(uniform(0, static_cast<int>(out.size()) - 1))] = 0;
    } else {
      while (n > 1 && out.size() < 4) {
        std::vector<int64_t> divs;
        for (int64_t d = 2; d <= n; ++d) {
          if (n % d == 0) divs.push_back(d);
        }
        const int64_t d =
            chance(0.3) ? n
                        : divs[static_cast<size_t>(uniform(0, static_cast<int>(divs.size()) - 1))];
        out.push_back(d);
        n /= d;
        if (chance(0.2)) out.push_back(1);
      }
      if (n > 1) out.back() *= n;
      std::shuffle(out.begin(), out.end(), rng_);
    }
    ints.assign(out.begin(), out.end());
    if (total != 0 && !ints.empty() && chance(0.3)) {
      ints[static_cast<size_t>(uniform(0, static_cast<int>(ints.size()) - 1))] = -1;
    }
    return out;
  }

  // Picks a recent node most of the time.
  int pick_source() {
    const int n = static_cast<int>(p_.nodes.size());
    for (int tries = 0; tries < 8; ++tries) {
      const int i = chance(0.6) ? std::max(0, n - uniform(1, 3)) : uniform(0, n - 1);
      if (node(i).op != OpKind::kIndexInput) return i;
    }
    return 0;
  }

  void add_op() {
    if (chance(0.03)) {  // an argument passed twice (node 0 is always an input)
      std::vector<int> inputs;
      for (int i = 0; i < static_cast<int>(p_.nodes.size()); ++i) {
        if (node(i).op == OpKind::kInput && node(i).in.empty()) inputs.push_back(i);
      }
      const int j = inputs[static_cast<size_t>(uniform(0, static_cast<int>(inputs.size()) - 1))];
      Node alias = node(j);
      alias.in = {j};
      add_node(std::move(alias));
      return;
    }
    const int x = pick_source();
    const Shape s = node(x).shape;
    const ScalarType t = node(x).dtype;
    const int64_t rank = static_cast<int64_t>(s.size());
    const bool fl = is_float(t), numeric = t != kBool;
    Node n;
    n.in = {x};
    n.shape = s;
    n.dtype = t;
    const auto kind = static_cast<OpKind>(
        uniform(static_cast<int>(OpKind::kUnary), static_cast<int>(OpKind::kCat)));
    switch (kind) {
      case OpKind::kUnary:
        n = unary_node(x);
        break;
      case OpKind::kBinary: {
        if (!numeric) return;
        n.fn = uniform(kAdd, kMinimum);
        const bool div = n.fn == kDiv;
        if (div && !fl) return;
        const int y = partner(s, t, [&](ScalarType u) { return div ? is_float(u) : u != kBool; });
        n.in.push_back(y);
        n.shape = broadcast_checked(s, node(y).shape, __LINE__);
        n.dtype = result_dtype(node(x), node(y));
        break;
      }
      case OpKind::kScalar:
        if (!numeric) return;
        n.op = kind;
        n.fn = fl ? uniform(kAddS, kClampS) : uniform(kAddS, kRsubS);
        n.scalar = fl ? pick({-2.0, -0.5, 0.5, 1.5, 3.0}) : pick({-2.0, -1.0, 2.0, 3.0});
        break;
      case OpKind::kCompare: {
        n.fn = uniform(kGt, kNe);
        n.dtype = kBool;
        if (chance(0.4) && numeric) {
          n.scalar = pick({-0.5, 0.0, 1.0});
          if (!fl) n.scalar = std::round(n.scalar);
        } else {
          const int y = partner(s, t, [&](ScalarType u) { return (u == kBool) == (t == kBool); });
          n.in.push_back(y);
          n.shape = broadcast_checked(s, node(y).shape, __LINE__);
        }
        break;
      }
      case OpKind::kWhere: {
        const int c = partner(s, kBool, [](ScalarType u) { return u == kBool; });
        const int y =
            partner(node(c).shape, t, [&](ScalarType u) { return (u == kBool) == (t == kBool); });
        const auto b = broadcast(s, node(c).shape);
        if (!b || !broadcast(*b, node(y).shape)) return;
        n.in = {c, x, y};
        n.shape = broadcast_checked(*b, node(y).shape, __LINE__);
        n.dtype = result_dtype(node(x), node(y));
        break;
      }
      case OpKind::kCast:
        // Float -> int64 is left out: out-of-range values (inf, nan) have no defined result.
        n.dtype = fl ? pick({kFloat, kDouble, kBool}) : pick({kFloat, kDouble, kInt64, kBool});
        if (n.dtype == t) return;
        break;
      case OpKind::kSum:
      case OpKind::kMean:
      case OpKind::kAmax: {
        if (kind == OpKind::kMean && !fl) return;
        if (kind == OpKind::kAmax && !numeric) return;
        const auto dims = reduce_dims(s, kind == OpKind::kAmax);
        if (!dims) return;
        n.ints = *dims;
        n.flag = chance(0.4);
        n.shape = reduced_shape(s, n.ints, n.flag);
        if (kind == OpKind::kSum && !fl) n.dtype = kInt64;
        break;
      }
      case OpKind::kReshape:
        n.shape = reshape_target(s, n.ints);
        break;
      case OpKind::kTranspose: {
        if (rank < 1) return;
        const int64_t a = uniform(0, static_cast<int>(rank) - 1);
        const int64_t b = uniform(0, static_cast<int>(rank) - 1);
        n.ints = {a, chance(0.3) ? b - rank : b};
        std::swap(n.shape[static_cast<size_t>(a)], n.shape[static_cast<size_t>(b)]);
        break;
      }
      case OpKind::kPermute: {
        if (rank < 2) return;
        n.ints.resize(static_cast<size_t>(rank));
        std::iota(n.ints.begin(), n.ints.end(), 0);
        std::shuffle(n.ints.begin(), n.ints.end(), rng_);
        for (size_t i = 0; i < n.ints.size(); ++i) n.shape[i] = s[static_cast<size_t>(n.ints[i])];
        break;
      }
      case OpKind::kSlice: {
        if (rank < 1) return;
        const int64_t d = uniform(0, static_cast<int>(rank) - 1);
        const int64_t size = s[static_cast<size_t>(d)];
        const int64_t start = uniform(0, static_cast<int>(size));
        const int64_t end = uniform(static_cast<int>(start), static_cast<int>(size));
        const int64_t step = pick<int64_t>({1, 1, 2});
        n.ints = {d, start, end, step};
        n.shape[static_cast<size_t>(d)] = (end - start + step - 1) / step;
        break;
      }
      case OpKind::kUnsqueeze: {
        const int64_t d = uniform(0, static_cast<int>(rank));
        n.ints = {chance(0.3) ? d - rank - 1 : d};
        n.shape.insert(n.shape.begin() + d, 1);
        break;
      }
      case OpKind::kExpand: {
        if (chance(0.3)) n.shape.insert(n.shape.begin(), pick<int64_t>({1, 2, 3}));
        n.ints.assign(n.shape.begin(), n.shape.end());
        const size_t lead = n.shape.size() - s.size();
        for (size_t i = 0; i < n.shape.size(); ++i) {
          if (i >= lead && s[i - lead] == 1 && chance(0.6)) n.shape[i] = pick<int64_t>({0, 2, 3});
          n.ints[i] = i >= lead && chance(0.3) ? -1 : n.shape[i];
          if (n.ints[i] == -1) n.shape[i] = s[i - lead];
        }
        break;
      }
      case OpKind::kSelect: {
        std::vector<int64_t> ok;
        for (int64_t d = 0; d < rank; ++d) {
          if (s[static_cast<size_t>(d)] > 0) ok.push_back(d);
        }
        if (ok.empty()) return;
        const int64_t d = ok[static_cast<size_t>(uniform(0, static_cast<int>(ok.size()) - 1))];
        const int64_t size = s[static_cast<size_t>(d)];
        const int64_t index = uniform(0, static_cast<int>(size) - 1);
        n.ints = {d, chance(0.3) ? index - size : index};
        n.shape.erase(n.shape.begin() + d);
        break;
      }
      case OpKind::kIndexSelect: {
        if (rank < 1) return;
        const int64_t d = uniform(0, static_cast<int>(rank) - 1);
        const int64_t size = s[static_cast<size_t>(d)];
        Node idx;
        idx.op = OpKind::kIndexInput;
        idx.dtype = kInt64;
        idx.shape = {size == 0 ? 0 : uniform(0, 4)};
        idx.ints = {size};
        idx.seed = rng_();
        n.in.push_back(add_node(std::move(idx)));
        n.ints = {d};
        n.shape[static_cast<size_t>(d)] = node(n.in[1]).shape[0];
        break;
      }
      case OpKind::kMatmul: {
        if (!fl || rank < 1) return;
        const int64_t k = s.back(), m = pick<int64_t>({0, 1, 2, 3});
        Shape ws;
        if (rank == 1 || chance(0.6)) {
          ws = chance(0.2) ? Shape{k} : Shape{k, m};
        } else {
          ws = Shape(s.begin(), s.end() - 2);
          for (int64_t& d : ws) d = chance(0.3) ? 1 : d;
          ws.push_back(k);
          ws.push_back(m);
        }
        int w = -1;
        for (int i = 0; i < static_cast<int>(p_.nodes.size()) && chance(0.5); ++i) {
          if (node(i).shape == ws && node(i).dtype == t) w = i;
        }
        if (w < 0) w = add_input(ws, t);
        n.in.push_back(w);
        n.shape = Shape(s.begin(), s.end() - 1);
        if (ws.size() >= 2) {
          Shape batch(ws.begin(), ws.end() - 2), lhs = n.shape;
          if (rank >= 2) lhs.pop_back();
          n.shape = broadcast_checked(rank >= 2 ? lhs : Shape{}, batch, __LINE__);
          if (rank >= 2) n.shape.push_back(s[s.size() - 2]);
          n.shape.push_back(m);
        }
        break;
      }
      case OpKind::kRmsNorm:
      case OpKind::kLayerNorm: {
        if (!fl || rank < 1) return;
        const int64_t k = rank >= 2 && chance(0.3) ? 2 : 1;
        n.ints.assign(s.end() - k, s.end());
        n.scalar = pick({1e-5, 1e-6});
        const Shape ws(s.end() - k, s.end());
        if (kind == OpKind::kRmsNorm) {
          if (chance(0.7)) n.in.push_back(add_input(ws, t));
        } else {
          n.fn = uniform(0, 3);
          if (n.fn & 1) n.in.push_back(add_input(ws, t));
          if (n.fn & 2) n.in.push_back(add_input(ws, t));
        }
        break;
      }
      case OpKind::kSoftmax:
      case OpKind::kLogSoftmax: {
        if (!fl || rank < 1) return;
        const int64_t d = uniform(0, static_cast<int>(rank) - 1);
        n.ints = {chance(0.3) ? d - rank : d};
        break;
      }
      case OpKind::kCat: {
        if (rank < 1) return;
        const int64_t d = uniform(0, static_cast<int>(rank) - 1);
        Shape ys = s;
        ys[static_cast<size_t>(d)] = pick<int64_t>({0, 1, 2});
        const int y = chance(0.4) ? x : add_input(ys, t);
        n.in.push_back(y);
        n.ints = {chance(0.3) ? d - rank : d};
        n.shape[static_cast<size_t>(d)] += node(y).shape[static_cast<size_t>(d)];
        break;
      }
      case OpKind::kSwiglu: {
        if (!fl) return;
        int up = -1;
        for (int i = 0; i < static_cast<int>(p_.nodes.size()); ++i) {
          if (node(i).shape == s && node(i).dtype == t && chance(0.5)) up = i;
        }
        n.in.push_back(up >= 0 ? up : add_input(s, t));
        break;
      }
      default:
        return;
    }
    if (n.op == OpKind::kInput) n.op = kind;
    add_node(std::move(n));
    ++op_count_;
  }

  std::mt19937_64 rng_;
  Program p_;
  int op_count_ = 0;
};

}  // namespace internal

inline Program generate(uint64_t seed) { return internal::Generator(seed).build(); }

// Whether an input is passed as the transpose of a contiguous tensor (ints {1}).
inline bool transposed_input(const Node& n) {
  return n.op == OpKind::kInput && !n.ints.empty() && n.ints[0] == 1;
}

// The device the programs' arguments are made on (the CPU, or CUDA for the gpu-labelled run):
// every value of a program follows its arguments' device.
inline Device& program_device() {
  static Device device(kCPU);
  return device;
}

// The callable's arguments: each input node's tensor, made from its own seed (so dropping nodes
// while shrinking keeps the others' data), on program_device().
inline Tensor make_input(const Node& n) {
  manual_seed(n.seed);
  if (n.op == OpKind::kIndexInput) {
    const Tensor t =
        n.ints[0] == 0 ? zeros(n.shape, kInt64) : randint(0, n.ints[0], n.shape, kInt64);
    return program_device().is_cpu() ? t : t.to(program_device());
  }
  Shape shape = n.shape;
  if (transposed_input(n)) std::swap(shape[shape.size() - 1], shape[shape.size() - 2]);
  Tensor t = n.dtype == kInt64  ? randint(-4, 5, shape, kInt64)
             : n.dtype == kBool ? randn(shape) > 0.0
                                : randn(shape, n.dtype);
  if (!program_device().is_cpu()) t = t.to(program_device());
  if (transposed_input(n)) t = t.transpose(-1, -2);
  return is_floating_point(n.dtype) ? t.requires_grad_(n.flag) : t;
}

// Each input node's argument index.
inline std::vector<int> argument_indices(const Program& p) {
  std::vector<int> arg(p.nodes.size(), -1);
  int next = 0;
  for (int i = 0; i < static_cast<int>(p.nodes.size()); ++i) {
    if (p.is_input(i)) arg[static_cast<size_t>(i)] = next++;
  }
  return arg;
}

inline std::vector<Tensor> make_inputs(const Program& p) {
  const std::vector<int> arg = argument_indices(p);
  std::vector<Tensor> args;
  for (int i = 0; i < static_cast<int>(p.nodes.size()); ++i) {
    const Node& n = p.nodes[static_cast<size_t>(i)];
    if (!p.is_input(i)) continue;
    args.push_back(n.in.empty() ? make_input(n)
                                : args[static_cast<size_t>(arg[static_cast<size_t>(n.in[0])])]);
  }
  return args;
}

namespace internal {

using UnaryOp = Tensor (*)(const Tensor&);
using BinaryOp = Tensor (*)(const Tensor&, const Tensor&);
// Indexed by UnaryFn and BinaryFn.
inline constexpr std::array<UnaryOp, 10> kUnaryFns = {
    [](const Tensor& x) { return exp(x); },  [](const Tensor& x) { return tanh(x); },
    [](const Tensor& x) { return relu(x); }, [](const Tensor& x) { return neg(x); },
    [](const Tensor& x) { return abs(x); },  [](const Tensor& x) { return sigmoid(x); },
    [](const Tensor& x) { return sin(x); },  [](const Tensor& x) { return square(x); },
    [](const Tensor& x) { return silu(x); }, [](const Tensor& x) { return logical_not(x); }};
inline constexpr std::array<BinaryOp, 6> kBinaryFns = {
    [](const Tensor& a, const Tensor& b) { return a + b; },
    [](const Tensor& a, const Tensor& b) { return a - b; },
    [](const Tensor& a, const Tensor& b) { return a * b; },
    [](const Tensor& a, const Tensor& b) { return a / b; },
    [](const Tensor& a, const Tensor& b) { return maximum(a, b); },
    [](const Tensor& a, const Tensor& b) { return minimum(a, b); }};

}  // namespace internal

// Every node's value (inputs included), in order.
inline std::vector<Tensor> run_nodes(const Program& p, const std::vector<Tensor>& args) {
  namespace F = nn::functional;
  using internal::kBinaryFns;
  using internal::kUnaryFns;
  std::vector<Tensor> v;
  size_t next_arg = 0;
  for (const Node& n : p.nodes) {
    auto in = [&](size_t i) -> const Tensor& { return v[static_cast<size_t>(n.in[i])]; };
    const IntArrayRef ints(n.ints);
    Tensor r;
    switch (n.op) {
      case OpKind::kInput:
      case OpKind::kIndexInput:
        r = args.at(next_arg++);
        break;
      case OpKind::kUnary:
        r = kUnaryFns[static_cast<size_t>(n.fn)](in(0));
        break;
      case OpKind::kBinary:
        r = kBinaryFns[static_cast<size_t>(n.fn)](in(0), in(1));
        break;
      case OpKind::kScalar: {
        const Tensor& x = in(0);
        const Scalar s = is_floating_point(x.dtype()) ? Scalar(n.scalar)
                                                      : Scalar(static_cast<int64_t>(n.scalar));
        switch (n.fn) {
          case kAddS:
            r = x + s;
            break;
          case kMulS:
            r = x * s;
            break;
          case kRsubS:
            r = s - x;
            break;
          case kDivS:
            r = x / s;
            break;
          case kPow2S:
            r = x.pow(2);
            break;
          default:
            r = x.clamp(-std::abs(n.scalar), std::abs(n.scalar));
            break;
        }
        break;
      }
      case OpKind::kCompare: {
        const Tensor& a = in(0);
        if (n.in.size() == 1) {
          const Scalar s = is_floating_point(a.dtype()) ? Scalar(n.scalar)
                                                        : Scalar(static_cast<int64_t>(n.scalar));
          r = n.fn == kGt ? a.gt(s) : n.fn == kLt ? a.lt(s) : n.fn == kEq ? a.eq(s) : a.ne(s);
        } else {
          const Tensor& b = in(1);
          r = n.fn == kGt ? gt(a, b) : n.fn == kLt ? lt(a, b) : n.fn == kEq ? eq(a, b) : ne(a, b);
        }
        break;
      }
      case OpKind::kWhere:
        r = where(in(0), in(1), in(2));
        break;
      case OpKind::kCast:
        r = in(0).to(n.dtype);
        break;
      case OpKind::kSum:
        r = sum(in(0), ints, n.flag);
        break;
      case OpKind::kMean:
        r = mean(in(0), ints, n.flag);
        break;
      case OpKind::kAmax:
        r = amax(in(0), ints, n.flag);
        break;
      case OpKind::kReshape:
        r = in(0).reshape(ints);
        break;
      case OpKind::kTranspose:
        r = in(0).transpose(n.ints[0], n.ints[1]);
        break;
      case OpKind::kPermute:
        r = in(0).permute(ints);
        break;
      case OpKind::kSlice:
        r = in(0).slice(n.ints[0], n.ints[1], n.ints[2], n.ints[3]);
        break;
      case OpKind::kUnsqueeze:
        r = in(0).unsqueeze(n.ints[0]);
        break;
      case OpKind::kExpand:
        r = in(0).expand(ints);
        break;
      case OpKind::kSelect:
        r = in(0).select(n.ints[0], n.ints[1]);
        break;
      case OpKind::kIndexSelect:
        r = index_select(in(0), n.ints[0], in(1));
        break;
      case OpKind::kMatmul:
        r = matmul(in(0), in(1));
        break;
      case OpKind::kRmsNorm:
        r = F::rms_norm(in(0), ints, n.in.size() > 1 ? in(1) : Tensor(), n.scalar);
        break;
      case OpKind::kLayerNorm: {
        size_t next = 1;
        const Tensor w = (n.fn & 1) ? in(next++) : Tensor();
        const Tensor b = (n.fn & 2) ? in(next++) : Tensor();
        r = F::layer_norm(in(0), ints, w, b, n.scalar);
        break;
      }
      case OpKind::kSoftmax:
        r = F::softmax(in(0), n.ints[0]);
        break;
      case OpKind::kLogSoftmax:
        r = F::log_softmax(in(0), n.ints[0]);
        break;
      case OpKind::kSwiglu:
        r = F::swiglu(in(0), in(1));
        break;
      case OpKind::kCat:
        r = cat({in(0), in(1)}, n.ints[0]);
        break;
    }
    v.push_back(std::move(r));
  }
  return v;
}

inline std::vector<Tensor> run(const Program& p, const std::vector<Tensor>& args) {
  const std::vector<Tensor> v = run_nodes(p, args);
  std::vector<Tensor> outs;
  for (int o : p.outputs) outs.push_back(v[static_cast<size_t>(o)]);
  return outs;
}

// The program as C++ (a reproducer): its arguments, the callable, what the test compares.
std::string source(const Program& p);

}  // namespace kiln::test
