// dist_worker SCENARIO: one rank of a multi-process test (tests/dist/*_test.cpp start it through
// spawn.h or `kiln run`). Reads RANK, WORLD_SIZE, ... from the environment, runs the scenario and
// exits 0 when every check held; a failed check prints what differed and exits 1.
#include <signal.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <functional>
#include <iostream>
#include <map>
#include <set>
#include <string>
#include <thread>

#include "dist/dist.h"
#include "kiln.h"
#include "worker_util.h"

namespace {

using namespace kiln;
using namespace kiln::dist;
using std::chrono::milliseconds;
using test::error_of;
using test::expect_close;
using test::expect_global_loss;
using test::expect_grads_close;
using test::expect_weights_close;
using test::short_timeout;

// Every collective of ProcessGroup, checked against values each rank can compute itself.
void collectives() {
  auto pg = init_process_group("gloo", short_timeout(10000));
  const int r = pg->rank(), n = pg->size();
  WCHECK(n >= 2, "needs 2 or more ranks, got ", n);
  const double tri = n * (n + 1) / 2.0;  // 1 + 2 + ... + n

  // all_reduce: every op, several dtypes; rank r holds (r + 1) * [1, 2, 3, 4, 5].
  Tensor base = arange(1, 6, kDouble);
  for (ScalarType dt : {kFloat, kDouble, kInt64, kInt32}) {
    Tensor t = (base * (r + 1)).to(dt);
    pg->all_reduce(t)->wait();
    expect_close(t, base * tri, 1e-6, "all_reduce sum");
    t = (base * (r + 1)).to(dt);
    pg->all_reduce(t, ReduceOp::kMax)->wait();
    expect_close(t, base * n, 0, "all_reduce max");
    t = (base * (r + 1)).to(dt);
    pg->all_reduce(t, ReduceOp::kMin)->wait();
    expect_close(t, base, 0, "all_reduce min");
    t = (base * (r + 1)).to(dt);
    pg->all_reduce(t, ReduceOp::kProduct)->wait();
    double fact = 1;
    for (int i = 1; i <= n; ++i) fact *= i;
    expect_close(t, base.pow(n) * fact, 1e-6, "all_reduce product");
  }
  // uint8 (bytes on the wire, summed in uint8; small enough here not to wrap).
  Tensor bytes = (base * (r + 1)).to(kByte);
  pg->all_reduce(bytes)->wait();
  expect_close(bytes, base * tri, 0, "all_reduce uint8 sum");
  bytes = (base * (r + 1)).to(kByte);
  pg->all_reduce(bytes, ReduceOp::kMax)->wait();
  expect_close(bytes, base * n, 0, "all_reduce uint8 max");
  Tensor avg = base * (r + 1);
  pg->all_reduce(avg, ReduceOp::kAvg)->wait();
  expect_close(avg, base * (tri / n), 1e-12, "all_reduce avg");
  Tensor bf = (base * (r + 1)).to(kBFloat16);
  pg->all_reduce(bf)->wait();
  expect_close(bf, base * tri, 1e-2, "all_reduce bfloat16");
  Tensor flag = full({3}, r == 1 ? 1 : 0, kInt64).to(kBool);
  pg->all_reduce(flag, ReduceOp::kMax)->wait();
  WCHECK(flag.all().item<bool>(), "bool max (or)");
  flag = full({3}, r == 1 ? 1 : 0, kInt64).to(kBool);
  pg->all_reduce(flag, ReduceOp::kMin)->wait();
  WCHECK(!flag.any().item<bool>(), "bool min (and)");
  // A non-contiguous tensor (a transposed view) is reduced in place through its view.
  Tensor m = (arange(0, 6, kDouble).view({2, 3}) * (r + 1));
  Tensor mt = m.t();
  pg->all_reduce(mt)->wait();
  expect_close(m, arange(0, 6, kDouble).view({2, 3}) * tri, 0, "all_reduce of a view");
  std::string e = error_of([&] {
    Tensor i = ones({2}, kInt64);
    pg->all_reduce(i, ReduceOp::kAvg);
  });
  WCHECK(e.find("kAvg needs a floating-point tensor") != std::string::npos, e);

  // broadcast from the last rank.
  Tensor b = full({2, 2}, r, kFloat);
  pg->broadcast(b, n - 1)->wait();
  expect_close(b, full({2, 2}, n - 1, kFloat), 0, "broadcast");
  e = error_of([&] { pg->broadcast(b, n); });
  WCHECK(e.find("[broadcast] root " + std::to_string(n) + " is outside") != std::string::npos, e);

  // all_gather into one tensor and into a list.
  Tensor mine = full({2, 3}, r, kFloat) + arange(0, 6, kFloat).view({2, 3});
  Tensor gathered = empty({2 * n, 3}, kFloat);
  pg->all_gather_into_tensor(gathered, mine)->wait();
  for (int q = 0; q < n; ++q) {
    expect_close(gathered.narrow(0, 2 * q, 2),
                 full({2, 3}, q, kFloat) + arange(0, 6, kFloat).view({2, 3}), 0,
                 "all_gather_into_tensor");
  }
  std::vector<Tensor> list;
  for (int q = 0; q < n; ++q) list.push_back(empty({2, 3}, kFloat));
  pg->all_gather(list, mine)->wait();
  for (int q = 0; q < n; ++q) {
    expect_close(list[q], full({2, 3}, q, kFloat) + arange(0, 6, kFloat).view({2, 3}), 0,
                 "all_gather");
  }
  e = error_of([&] {
    Tensor wrong = empty({2 * n + 1, 3}, kFloat);
    pg->all_gather_into_tensor(wrong, mine);
  });
  WCHECK(e.find("[all_gather_into_tensor] the output has") != std::string::npos, e);

  // Coalesced gathers (FSDP's per-parameter gathers): into views of one buffer, the gap
  // between them untouched, two dtypes, one Work.
  {
    Tensor buf = full({n * 5 + 3 + n * 2}, -1.0, kFloat);
    std::vector<Tensor> outs{buf.narrow(0, 0, n * 5), buf.narrow(0, n * 5 + 3, n * 2),
                             empty({n, 1}, kInt64)};
    std::vector<Tensor> ins{arange(0, 5, kFloat) + 10 * r, full({2}, -r - 1.0, kFloat),
                            full({1}, r * 3, kInt64)};
    auto w = pg->all_gather_into_tensor_coalesced(outs, ins);
    w->wait();
    WCHECK(w->is_completed(), "the coalesced Work is done after wait()");
    for (int q = 0; q < n; ++q) {
      expect_close(buf.narrow(0, 5 * q, 5), arange(0, 5, kFloat) + 10 * q, 0, "coalesced 0");
      expect_close(buf.narrow(0, n * 5 + 3 + 2 * q, 2), full({2}, -q - 1.0, kFloat), 0,
                   "coalesced 1");
      expect_close(outs[2][q], full({1}, q * 3, kInt64), 0, "coalesced int64");
    }
    expect_close(buf.narrow(0, n * 5, 3), full({3}, -1.0, kFloat), 0, "the gap");
    e = error_of([&] {
      std::vector<Tensor> one{empty({n * 5}, kFloat)};
      pg->all_gather_into_tensor_coalesced(one, ins);
    });
    WCHECK(e.find("[all_gather_into_tensor_coalesced] 1 outputs for 3 inputs") != std::string::npos,
           e);
  }

  // reduce_scatter: rank r's input chunk q is (r + 1) * (q + 1) * ones(3).
  Tensor in = empty({n * 3}, kDouble);
  std::vector<Tensor> inputs;
  for (int q = 0; q < n; ++q) {
    in.narrow(0, 3 * q, 3).fill_((r + 1) * (q + 1));
    inputs.push_back(full({3}, (r + 1) * (q + 1), kDouble));
  }
  Tensor out = empty({3}, kDouble);
  pg->reduce_scatter_tensor(out, in)->wait();
  expect_close(out, full({3}, tri * (r + 1), kDouble), 0, "reduce_scatter_tensor");
  Tensor out2 = empty({3}, kDouble);
  pg->reduce_scatter(out2, inputs, ReduceOp::kAvg)->wait();
  expect_close(out2, full({3}, tri * (r + 1) / n, kDouble), 1e-12, "reduce_scatter avg");

  // send/recv around a ring, both posted before either is waited for.
  Tensor msg = full({4}, 100 + r, kFloat);
  Tensor got = empty({4}, kFloat);
  auto s = pg->send(msg, (r + 1) % n, /*tag=*/7);
  auto rv = pg->recv(got, (r + n - 1) % n, /*tag=*/7);
  s->wait();
  rv->wait();
  expect_close(got, full({4}, 100 + (r + n - 1) % n, kFloat), 0, "recv");

  // Several collectives in flight at once, waited for in reverse order.
  std::vector<Tensor> ts;
  std::vector<std::shared_ptr<Work>> works;
  for (int i = 0; i < 8; ++i) {
    ts.push_back(full({1000}, i + r, kFloat));
    works.push_back(pg->all_reduce(ts.back()));
  }
  for (int i = 7; i >= 0; --i) {
    works[i]->wait();
    WCHECK(works[i]->is_completed() && works[i]->is_success(), "work ", i);
    expect_close(ts[i], full({1000}, n * i + tri - n, kFloat), 0, "async all_reduce");
    WCHECK(works[i]->result().at(0).is_same(ts[i]), "result() is the reduced tensor");
  }
  pg->barrier()->wait();
  std::cout << "rank " << r << ": collectives ok\n";
}

// A rank that never joins the collective: the others time out with a clear error.
void collective_timeout() {
  auto pg = init_process_group("gloo", short_timeout(1000));
  if (pg->rank() == 0) {
    Tensor t = ones({4});
    auto w = pg->all_reduce(t);
    // Work::wait with its own, shorter bound; then the group's timeout ends the collective.
    const std::string e1 = error_of([&] { w->wait(milliseconds(100)); });
    WCHECK(e1.find("[all_reduce] Work::wait timed out after 100 ms") != std::string::npos, e1);
    const std::string e2 = error_of([&] { w->wait(); });
    std::cout << "rank 0 error: " << e2 << "\n";
    WCHECK(e2.find("[all_reduce] rank 0 of 2: timed out after 1000 ms") != std::string::npos, e2);
    WCHECK(w->is_completed() && !w->is_success() && w->exception() != nullptr, "failed work");
  }
  // Rank 1 stays alive (without joining) until rank 0 has seen its errors.
  if (pg->rank() == 1) std::this_thread::sleep_for(milliseconds(2500));
}

// Rank 1 exits right after joining: rank 0's collective fails instead of hanging.
void peer_exits() {
  auto pg = init_process_group("gloo", short_timeout(5000));
  if (pg->rank() == 1) ::_exit(3);
  Tensor t = ones({1 << 16});
  const std::string e = error_of([&] { pg->all_reduce(t)->wait(); });
  std::cout << "rank 0 error: " << e << "\n";
  WCHECK(e.find("[all_reduce] rank 0 of 2") != std::string::npos, e);
}

// Rank 1 is killed (SIGKILL) in the middle of a run of all_reduces: under `kiln run`, the
// launcher names it and stops the others.
void killed_mid_step() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  for (int step = 0; step < 100000; ++step) {
    Tensor t = ones({1000});
    pg->all_reduce(t)->wait();
    if (step == 5 && pg->rank() == 1) ::raise(SIGKILL);
  }
}

// --- DDP -----------------------------------------------------------------------------------

struct MlpImpl : nn::Module {
  MlpImpl() {
    fc1 = register_module("fc1", nn::Linear(8, 16));
    fc2 = register_module("fc2", nn::Linear(16, 4));
    scale = register_buffer("scale", ones({4}));
  }
  Tensor forward(const Tensor& x) { return fc2(fc1(x).tanh()) * scale; }
  nn::Linear fc1{nullptr}, fc2{nullptr};
  Tensor scale;
};
KILN_MODULE(Mlp);

Mlp make_mlp(uint64_t seed) {
  manual_seed(seed);
  Mlp m;
  m->to(kDouble);
  return m;
}

Tensor mse(const Tensor& out, const Tensor& y) { return (out - y).square().mean(); }

// KILN_TEST_BUCKET_VIEW=0 runs a scenario with DDPOptions::gradient_as_bucket_view off.
bool bucket_view_from_env() {
  const char* v = std::getenv("KILN_TEST_BUCKET_VIEW");
  return v == nullptr || std::string(v) != "0";
}

// DDP over the ranks == one process on the global batch: losses and weights after every step,
// with several buckets, SGD with momentum, and in the last steps two micro-batches accumulated
// under no_sync(). Ranks start from different weights and buffers: DDP takes rank 0's.
void ddp_equivalence() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 3, global = local * n;

  Mlp ref = make_mlp(100);  // rank 0's initial weights
  Mlp model = make_mlp(100 + r);
  model->scale.fill_(r + 1);  // a buffer that differs: rank 0's (ones) wins
  DDPOptions opts;
  opts.bucket_cap_mb = 600.0 / (1 << 20);  // 600 bytes: several buckets
  opts.gradient_as_bucket_view = bucket_view_from_env();
  DistributedDataParallel ddp(model, pg, opts);
  WCHECK(ddp.reducer().bucket_indices().size() >= 3, "expected several buckets, got ",
         ddp.reducer().bucket_indices().size());
  WCHECK(ddp.reducer().bucket_indices().front().front() == 3, "the last parameter comes first");
  for (auto& [a, b] : std::vector<std::pair<Tensor, Tensor>>{{ddp->fc1->weight, ref->fc1->weight},
                                                             {ddp->fc2->bias, ref->fc2->bias}}) {
    expect_close(a, b, 0, "initial weights are rank 0's");
  }
  expect_close(ddp->scale, ones({4}), 0, "buffers are rank 0's");

  auto sgd = [](Mlp& m) {
    return optim::SGD(m->parameters(), optim::SGDOptions(0.1).momentum(0.9));
  };
  optim::SGD opt = sgd(model), ref_opt = sgd(ref);
  manual_seed(7);  // the same global batches on every rank
  for (int step = 0; step < 5; ++step) {
    const bool accumulate = step >= 3;
    const int micro = accumulate ? 2 : 1;
    std::vector<Tensor> xs, ys;
    for (int k = 0; k < micro; ++k) {
      xs.push_back(randn({global, 8}, kDouble));
      ys.push_back(randn({global, 4}, kDouble));
    }
    opt.zero_grad();
    ref_opt.zero_grad();
    double loss_sum = 0, ref_sum = 0;
    for (int k = 0; k < micro; ++k) {
      Tensor x = xs[k].narrow(0, r * local, local), y = ys[k].narrow(0, r * local, local);
      if (k + 1 < micro) {
        auto guard = ddp.no_sync();
        Tensor loss = mse(ddp(x), y);
        loss.backward();
        loss_sum += loss.item<double>();
      } else {
        Tensor loss = mse(ddp(x), y);
        loss.backward();
        loss_sum += loss.item<double>();
      }
      Tensor ref_loss = mse(ref(xs[k]), ys[k]);
      ref_loss.backward();
      ref_sum += ref_loss.item<double>();
    }
    // The mean of the ranks' losses is the global batch's loss.
    expect_global_loss(*pg, loss_sum, ref_sum, step);
    const auto p = ddp->parameters(), q = ref->parameters();
    expect_grads_close(p, q, 1e-12, "step " + std::to_string(step) + ": ");
    opt.step();
    ref_opt.step();
    expect_weights_close(p, q, 1e-12, "after step " + std::to_string(step) + ": ");
  }
  std::cout << "rank " << r << ": ddp == one process\n";
}

// After a compiled DDP step and one process's step on the global batch: the mean of the ranks'
// losses is the one process's loss, and the weights are its weights.
void expect_step_equals_one_process(ProcessGroup& pg, int step, const Tensor& loss,
                                    const Tensor& ref_loss, const std::vector<Tensor>& weights,
                                    const std::vector<Tensor>& ref_weights) {
  Tensor l = loss.clone();
  pg.all_reduce(l, ReduceOp::kAvg)->wait();
  WCHECK(std::abs(l.item<double>() - ref_loss.item<double>()) < 1e-12, "step ", step, ": loss ",
         l.item<double>(), " vs one process ", ref_loss.item<double>());
  expect_weights_close(weights, ref_weights, 1e-12, "after step " + std::to_string(step) + ": ");
}

// A compiled training step under DDP (issue 23 point 7): zero_grad, forward, backward and the
// SGD update traced into one program whose trace holds the buckets' all-reduces and their waits
// (dist/collective_ops.h), the first started before the backward's last product (overlap). It
// equals one process on the global batch, step after step, with the buffer broadcast traced too.
void ddp_compiled() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 3, global = local * n;
  Mlp ref = make_mlp(100);
  Mlp model = make_mlp(100 + r);
  DDPOptions opts;
  opts.bucket_cap_mb = 600.0 / (1 << 20);  // several buckets
  opts.gradient_as_bucket_view = bucket_view_from_env();
  DistributedDataParallel ddp(model, pg, opts);
  auto sgd = [](Mlp& m) {
    return optim::SGD(m->parameters(), optim::SGDOptions(0.1).momentum(0.9));
  };
  optim::SGD opt = sgd(model), ref_opt = sgd(ref);
  auto step = kiln::compile([&](const Tensor& x, const Tensor& y) {
    opt.zero_grad();
    Tensor loss = mse(ddp(x), y);
    loss.backward();
    opt.step();
    return loss.detach();
  });
  manual_seed(7);
  for (int i = 0; i < 4; ++i) {
    const Tensor xs = randn({global, 8}, kDouble), ys = randn({global, 4}, kDouble);
    const Tensor loss = step(xs.narrow(0, r * local, local).contiguous(),
                             ys.narrow(0, r * local, local).contiguous());
    ref_opt.zero_grad();
    const Tensor ref_loss = mse(ref(xs), ys);
    ref_loss.backward();
    ref_opt.step();
    expect_step_equals_one_process(*pg, i, loss, ref_loss, ddp->parameters(), ref->parameters());
  }
  std::string reasons;
  for (const std::string& why : step.stats().recompile_reasons) reasons += "\n  " + why;
  // Traced twice: SGD's momentum buffers are made by the first call (state that outlives it).
  WCHECK(step.stats().misses == 2, "two compilations, got ", step.stats().misses, reasons);
  const std::string listing = step.traces().back().str();
  const size_t first_reduce = listing.find("dist_all_reduce_(");
  const size_t last_mm = listing.rfind(" mm(");
  WCHECK(first_reduce != std::string::npos && listing.find("dist_wait_(") != std::string::npos,
         "the trace holds the all-reduces and their waits:\n", listing);
  WCHECK(first_reduce < last_mm, "the first all-reduce starts before the backward's last mm:\n",
         listing);
  size_t reduces = 0;
  for (size_t at = listing.find("dist_all_reduce_("); at != std::string::npos;
       at = listing.find("dist_all_reduce_(", at + 1)) {
    ++reduces;
  }
  WCHECK(reduces == ddp.reducer().bucket_indices().size(), reduces, " all-reduces for ",
         ddp.reducer().bucket_indices().size(), " buckets");
  // From the first traced backward's ready order, before the second call's forward.
  WCHECK(ddp.reducer().buckets_rebuilt(), "the buckets were not rebuilt");
  std::cout << "rank " << r << ": compiled ddp == one process (" << reduces << " buckets)\n";
}

// A parameter left out of the loss is reported by the next forward, by name.
void ddp_unused_parameter() {
  auto pg = init_process_group("gloo", short_timeout(10000));
  Mlp model = make_mlp(1);
  DistributedDataParallel ddp(model, pg);
  Tensor x = randn({2, 8}, kDouble);
  // fc2 is skipped: its parameters get no gradient.
  Tensor loss = ddp->fc1(x).square().mean();
  loss.backward();
  const std::string e = error_of([&] { ddp(x); });
  WCHECK(e.find("[DistributedDataParallel] the last backward produced gradients for only 2 of 4 "
                "parameters") != std::string::npos,
         e);
  WCHECK(e.find("or set DDPOptions::find_unused_parameters") != std::string::npos, e);
  WCHECK(e.find("no gradient reached 'fc2.weight', 'fc2.bias'") != std::string::npos, e);
  // The reducer starts over: a full iteration works.
  Tensor ok = ddp(x).square().mean();
  ok.backward();
  pg->barrier()->wait();
}

// find_unused_parameters: a branch that only some ranks take. Rank 0 skips fc2 in every step,
// the others use it: fc2's gradient is the average over the ranks (zeros from rank 0) and equals
// one process on the global batch where rank 0's rows skip fc2. A parameter no rank uses keeps
// an undefined grad.
struct BranchyImpl : nn::Module {
  BranchyImpl() {
    fc1 = register_module("fc1", nn::Linear(4, 4));
    fc2 = register_module("fc2", nn::Linear(4, 4));
    never = register_module("never", nn::Linear(4, 4));
  }
  Tensor forward(const Tensor& x, bool use_fc2) {
    Tensor h = fc1(x).tanh();
    return use_fc2 ? fc2(h) : h;
  }
  nn::Linear fc1{nullptr}, fc2{nullptr}, never{nullptr};
};
KILN_MODULE(Branchy);

void ddp_find_unused() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  auto make = [] {
    manual_seed(5);
    Branchy m;
    m->to(kDouble);
    return m;
  };
  Branchy model = make(), ref = make();
  DDPOptions opts;
  opts.find_unused_parameters = true;
  opts.bucket_cap_mb = 100.0 / (1 << 20);  // a bucket per parameter or two
  opts.gradient_as_bucket_view = bucket_view_from_env();
  DistributedDataParallel ddp(model, pg, opts);
  optim::SGD opt(model->parameters(), 0.1), ref_opt(ref->parameters(), 0.1);
  manual_seed(9);
  for (int step = 0; step < 3; ++step) {
    Tensor x = randn({2 * n, 4}, kDouble);
    opt.zero_grad();
    ref_opt.zero_grad();
    Tensor mine = x.narrow(0, 2 * r, 2);
    ddp(mine, r != 0).square().mean().backward();
    // One process: the mean over the ranks of each rank's mean loss.
    Tensor total = zeros({}, kDouble);
    for (int q = 0; q < n; ++q) total = total + ref(x.narrow(0, 2 * q, 2), q != 0).square().mean();
    (total / n).backward();
    const auto p = model->named_parameters();
    const auto q = ref->named_parameters();
    for (size_t i = 0; i < p.size(); ++i) {
      const std::string name = p.items()[i].key();
      const Tensor& g = p.items()[i].value().grad();
      const Tensor& want = q.items()[i].value().grad();
      if (name.rfind("never.", 0) == 0 || (n == 1 && name.rfind("fc2.", 0) == 0)) {
        WCHECK(!g.defined(), name, ": no rank used it, its grad stays undefined");
        continue;
      }
      WCHECK(g.defined(), name, ": grad undefined");
      expect_close(g, want, 1e-12, name + " step " + std::to_string(step));
    }
    opt.step();
    ref_opt.step();
  }
  std::cout << "rank " << r << ": find_unused_parameters ok\n";
}

// Parameters of two dtypes go to separate buckets; the gradients still equal one process.
struct TwoDtypesImpl : nn::Module {
  TwoDtypesImpl() {
    a = register_module("a", nn::Linear(3, 2));
    b = register_module("b", nn::Linear(3, 2));
    b->to(kDouble);
  }
  Tensor forward(const Tensor& x) {
    return a(x.to(kFloat)).to(kDouble).square().mean() + b(x).square().mean();
  }
  nn::Linear a{nullptr}, b{nullptr};
};
KILN_MODULE(TwoDtypes);

void ddp_two_dtypes() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  manual_seed(11);
  TwoDtypes model;
  manual_seed(11);
  TwoDtypes ref;
  DistributedDataParallel ddp(model, pg);
  const auto buckets = ddp.reducer().bucket_indices();
  WCHECK(buckets.size() == 2, "one bucket per dtype, got ", buckets.size());
  manual_seed(12);
  Tensor x = randn({2 * n, 3}, kDouble);
  ddp(x.narrow(0, 2 * r, 2)).backward();
  Tensor total = zeros({}, kDouble);
  for (int q = 0; q < n; ++q) total = total + ref(x.narrow(0, 2 * q, 2));
  (total / n).backward();
  const auto p = model->parameters(), q = ref->parameters();
  for (size_t i = 0; i < p.size(); ++i) {
    WCHECK(p[i].grad().dtype() == p[i].dtype(), "gradient dtype");
    expect_close(p[i].grad(), q[i].grad(), p[i].dtype() == kFloat ? 1e-5 : 1e-12,
                 "gradient " + std::to_string(i));
  }
}

// The grads of a bucket of several parameters are views into one buffer, in bucket order (each
// slot starts on a 64-byte boundary, dist/ddp.cpp).
void expect_bucket_views(const DistributedDataParallel<Mlp>& ddp, const std::string& when) {
  const auto p = ddp->parameters();
  for (const auto& bucket : ddp.reducer().bucket_indices()) {
    for (size_t j = 0; j + 1 < bucket.size(); ++j) {
      const Tensor& a = p[bucket[j]].grad();
      const Tensor& b = p[bucket[j + 1]].grad();
      WCHECK(a.defined() && b.defined(), when, ": a grad is undefined");
      const auto gap =
          static_cast<const char*>(b.data_ptr()) - static_cast<const char*>(a.data_ptr());
      const auto bytes = static_cast<std::ptrdiff_t>(a.nbytes());
      WCHECK(gap >= bytes && gap < bytes + 64, when, ": the grads of parameters ", bucket[j],
             " and ", bucket[j + 1], " are not neighbours in one bucket (", gap, " bytes apart)");
    }
  }
}

// gradient_as_bucket_view == one process, through every way a gradient can come: zero_grad()
// to undefined and to zeros, accumulation under no_sync() in both cases, and gradients the user
// set to a tensor of another layout and dtype. Buckets: fc2's two parameters share one, fc1's
// are alone in theirs (reduced in their own grad()).
void ddp_bucket_view() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 2, global = local * n;
  Mlp ref = make_mlp(3), model = make_mlp(3 + r);
  DDPOptions opts;
  opts.bucket_cap_mb = 600.0 / (1 << 20);
  DistributedDataParallel ddp(model, pg, opts);
  WCHECK(ddp.reducer().bucket_indices() == (std::vector<std::vector<size_t>>{{3, 2}, {1}, {0}}),
         "unexpected initial buckets");
  auto sgd = [](Mlp& m) {
    return optim::SGD(m->parameters(), optim::SGDOptions(0.05).momentum(0.9));
  };
  optim::SGD opt = sgd(model), ref_opt = sgd(ref);
  auto p = model->parameters();
  const auto q = ref->parameters();
  std::vector<const void*> ptrs;
  manual_seed(21);
  for (int step = 0; step < 6; ++step) {
    const bool to_none = step % 2 == 0;
    const int micro = step >= 2 ? 2 : 1;
    opt.zero_grad(to_none);
    ref_opt.zero_grad(to_none);
    if (step == 5) {
      // Gradients the user set: fc1.weight (alone in its bucket) transposed and in f32,
      // fc2.weight (sharing a bucket) transposed: both made the bucket's again.
      p[0].mutable_grad() = zeros({8, 16}, kFloat).t();
      p[2].mutable_grad() = zeros({16, 4}, kDouble).t();
    }
    for (int k = 0; k < micro; ++k) {
      Tensor x = randn({global, 8}, kDouble), y = randn({global, 4}, kDouble);
      auto loss = [&] {
        return mse(ddp(x.narrow(0, r * local, local)), y.narrow(0, r * local, local)) / micro;
      };
      if (k + 1 < micro) {
        auto guard = ddp.no_sync();
        loss().backward();
      } else {
        loss().backward();
      }
      (mse(ref(x), y) / micro).backward();
    }
    const std::string when = "step " + std::to_string(step);
    for (size_t i = 0; i < p.size(); ++i) {
      WCHECK(p[i].grad().dtype() == kDouble && p[i].grad().is_contiguous(), when,
             ": grad of parameter ", i, " is not the parameter's dtype, contiguous");
      // fc1.weight's f32 gradient of step 5 holds f32 sums.
      expect_close(p[i].grad(), q[i].grad(), step == 5 && i == 0 ? 1e-6 : 1e-12,
                   when + ": gradient " + std::to_string(i));
    }
    WCHECK(ddp.reducer().buckets_rebuilt(), when, ": the buckets were not rebuilt");
    expect_bucket_views(ddp, when);
    // After the rebuild (step 0) the buckets' grads stay where they are.
    std::vector<const void*> now;
    for (const auto& bucket : ddp.reducer().bucket_indices()) {
      if (bucket.size() > 1) now.push_back(p[bucket[0]].grad().data_ptr());
    }
    WCHECK(step == 0 || now == ptrs, when, ": a bucket's grads moved");
    ptrs = now;
    opt.step();
    ref_opt.step();
    for (size_t i = 0; i < p.size(); ++i) {
      expect_close(p[i], q[i], step == 5 ? 1e-6 : 1e-12, when + ": weight " + std::to_string(i));
    }
  }
  std::cout << "rank " << r << ": gradient_as_bucket_view == one process\n";
}

// The buckets follow the order in which the first synchronised backward produced the
// gradients, rank 0's on every rank. Rank 0 runs the layers as l3(l1(l2(x))) (gradients ready:
// l3, l1, l2), the others as l3(l2(l1(x))) (l3, l2, l1: registration order reversed, the initial
// buckets'); each bucket holds one layer. Training equals one process before and after.
struct ChainImpl : nn::Module {
  ChainImpl() {
    l1 = register_module("l1", nn::Linear(4, 4));
    l2 = register_module("l2", nn::Linear(4, 4));
    l3 = register_module("l3", nn::Linear(4, 4));
  }
  Tensor forward(const Tensor& x, bool l2_first) {
    return l3(l2_first ? l1(l2(x).tanh()).tanh() : l2(l1(x).tanh()).tanh());
  }
  nn::Linear l1{nullptr}, l2{nullptr}, l3{nullptr};
};
KILN_MODULE(Chain);

void ddp_rebuild_buckets() {
  auto pg = init_process_group("gloo", short_timeout(20000));
  const int r = pg->rank(), n = pg->size();
  auto make = [] {
    manual_seed(13);
    Chain m;
    m->to(kDouble);
    return m;
  };
  Chain model = make(), ref = make();
  DDPOptions opts;
  opts.bucket_cap_mb = 160.0 / (1 << 20);  // a layer: 16 + 4 doubles
  opts.gradient_as_bucket_view = bucket_view_from_env();
  DistributedDataParallel ddp(model, pg, opts);
  // Parameters: l1.weight 0, l1.bias 1, l2.weight 2, l2.bias 3, l3.weight 4, l3.bias 5.
  auto layers = [&] {
    std::vector<std::set<size_t>> out;
    for (const auto& b : ddp.reducer().bucket_indices()) out.emplace_back(b.begin(), b.end());
    return out;
  };
  using Layout = std::vector<std::set<size_t>>;
  WCHECK(layers() == (Layout{{4, 5}, {2, 3}, {0, 1}}), "initial buckets: reverse registration");
  WCHECK(!ddp.reducer().buckets_rebuilt(), "rebuilt before any backward");
  optim::SGD opt(model->parameters(), optim::SGDOptions(0.1).momentum(0.9));
  optim::SGD ref_opt(ref->parameters(), optim::SGDOptions(0.1).momentum(0.9));
  manual_seed(14);
  for (int step = 0; step < 4; ++step) {
    Tensor x = randn({2 * n, 4}, kDouble);
    opt.zero_grad(step != 2);
    ref_opt.zero_grad(step != 2);
    ddp(x.narrow(0, 2 * r, 2), r == 0).square().mean().backward();
    Tensor total = zeros({}, kDouble);
    for (int k = 0; k < n; ++k) total = total + ref(x.narrow(0, 2 * k, 2), k == 0).square().mean();
    (total / n).backward();
    WCHECK(ddp.reducer().buckets_rebuilt(), "not rebuilt after the first backward");
    WCHECK(layers() == (Layout{{4, 5}, {0, 1}, {2, 3}}),
           "buckets after the first backward: rank 0's ready order (l3, l1, l2)");
    const auto p = model->parameters(), q = ref->parameters();
    expect_grads_close(p, q, 1e-12, "step " + std::to_string(step) + ": ");
    opt.step();
    ref_opt.step();
    expect_weights_close(p, q, 1e-12, "step " + std::to_string(step) + ": ");
  }
  std::cout << "rank " << r << ": buckets rebuilt in rank 0's ready order\n";
}

// The largest |got - want| over the elements, computed on the device.
double max_error(const Tensor& got, const Tensor& want) {
  return (got.to(kDouble) - want.to(kDouble)).abs().max().item<double>();
}

// i % m for i in [0, len), as f32 on `dev`.
Tensor index_mod(int64_t len, double m, const Device& dev) {
  const Tensor i = arange(0, len, TensorOptions(kDouble).device(dev));
  return (i - (i / m).floor() * m).to(kFloat);
}

// ProcessGroupNCCL's large all-reduces (4 MiB and more, sum or average of floating-point
// tensors): through the copy engines where the ranks' GPUs share a host (dist/peer_all_reduce.h),
// else NCCL's. Against values each rank computes itself, exactly where the sums are exact; in
// more pieces than the staging has slots (each slot reused); several in flight at once, as DDP's
// buckets are; misaligned data (the kernel's element path); and against NCCL's kernels (a second
// group with Options::peer_all_reduce off) on random data.
void large_all_reduces(const std::shared_ptr<ProcessGroup>& pg, const Device& dev) {
  const int r = pg->rank(), n = pg->size();
  auto* nccl = dynamic_cast<ProcessGroupNCCL*>(pg.get());
  WCHECK(nccl != nullptr, "not an NCCL group");
  const double tri = n * (n - 1) / 2.0;
  const TensorOptions on(dev);
  // bf16, exact: x[i] = i % 13 + r + it, summed: n (i % 13 + it) + tri (all below 256). 3.2 x the
  // largest piece (16M elements), four times: 16 pieces through 8 slots.
  const int64_t big = 3 * (int64_t{16} << 20) + 12345;
  const Tensor pattern = index_mod(big, 13, dev);
  for (int it = 0; it < 4; ++it) {
    Tensor t = (pattern + (r + it)).to(kBFloat16);
    pg->all_reduce_beside_compute(t)->wait();
    WCHECK(max_error(t, pattern * n + (tri + n * it)) == 0, "large bf16 all_reduce, round ", it,
           ": off by ", max_error(t, pattern * n + (tri + n * it)));
  }
  if (r == 0) std::cout << "large all_reduce path: " << nccl->large_all_reduce_path() << "\n";
  // Six 25 MiB buckets in flight, then waited for, f32 average.
  std::vector<Tensor> buckets;
  std::vector<std::shared_ptr<Work>> works;
  const int64_t bucket = int64_t{25} << 18;
  const Tensor ramp = index_mod(bucket, 1000, dev);
  for (int k = 0; k < 6; ++k) {
    buckets.push_back(ramp * (r + 1) + k);
    works.push_back(pg->all_reduce_beside_compute(buckets.back(), ReduceOp::kAvg));
  }
  for (int k = 0; k < 6; ++k) {
    works[k]->wait();
    const Tensor want = ramp * ((tri + n) / n) + k;
    WCHECK(max_error(buckets[k], want) <= 1e-6 * 1000, "bucket ", k, " average off by ",
           max_error(buckets[k], want));
  }
  // Misaligned (4 bytes past an aligned address), odd length, f32 and f16 sums.
  for (ScalarType dt : {kFloat, kHalf}) {
    const int64_t len = (int64_t{4} << 20) / 2 + 7;
    Tensor storage = zeros({len + 1}, on.dtype(dt));
    Tensor t = storage.narrow(0, 1, len);
    const Tensor ones_to = index_mod(len, 5, dev);
    t.copy_(ones_to + r);
    pg->all_reduce_beside_compute(t)->wait();
    WCHECK(max_error(t, ones_to * n + tri) == 0, "misaligned ", dt, " all_reduce off by ",
           max_error(t, ones_to * n + tri));
    WCHECK(storage[0].item<double>() == 0, "misaligned ", dt, ": the element before was written");
  }
  // Against NCCL's kernels on random bf16 data: both within bf16 rounding of the f64 sum.
  ProcessGroupNCCL::Options ring_options;
  ring_options.device_index = dev.index();
  ring_options.peer_all_reduce = false;
  ProcessGroupNCCL ring(pg->store(), r, n, ring_options);
  manual_seed(1000 + r);
  const Tensor x = randn({int64_t{20} << 20}).to(dev);
  Tensor sum64 = x.to(kDouble);
  ring.all_reduce(sum64)->wait();
  Tensor a = x.to(kBFloat16), c = x.to(kBFloat16);
  pg->all_reduce_beside_compute(a)->wait();
  ring.all_reduce_beside_compute(c)->wait();
  WCHECK(ring.large_all_reduce_path().rfind("nccl: ", 0) == 0, "the ring group took ",
         ring.large_all_reduce_path());
  const double scale = sum64.abs().max().item<double>();
  WCHECK(max_error(a, sum64) <= 0.02 * scale, "bf16 sum off by ", max_error(a, sum64));
  WCHECK(max_error(c, sum64) <= 0.02 * scale, "NCCL's bf16 sum off by ", max_error(c, sum64));
  // The copy engines round once, NCCL's ring once per hop: no further from the f64 sum.
  const double ce = (a.to(kDouble) - sum64).abs().mean().item<double>();
  const double nc = (c.to(kDouble) - sum64).abs().mean().item<double>();
  if (r == 0) {
    std::cout << "bf16 all_reduce mean error: " << ce << " (this group), " << nc << " (NCCL)\n";
  }
  if (nccl->large_all_reduce_path() == "copy engines") {
    WCHECK(ce <= nc * 1.01, "copy-engine bf16 sum error ", ce, " above NCCL's ", nc);
  }
  // Bus bandwidth (nccl-tests' convention: algbw * 2 (n - 1) / n), and the host's time to queue
  // one call.
  for (int64_t mib : {4, 16, 256, 1024}) {
    Tensor t = ones({mib << 18}, on.dtype(kFloat));
    for (bool beside : {true, false}) {
      auto call = [&] { return beside ? pg->all_reduce_beside_compute(t) : pg->all_reduce(t); };
      for (int w = 0; w < 3; ++w) call()->wait();
      cuda::synchronize();
      cuda::Event start(true), stop(true);
      constexpr int kIters = 10;
      double host_us = 0;
      start.record();
      for (int it = 0; it < kIters; ++it) {
        const auto t0 = std::chrono::steady_clock::now();
        auto work = call();
        host_us += std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - t0)
                       .count();
        work->wait();
      }
      stop.record();
      stop.synchronize();
      const double ms = start.elapsed_time(stop) / kIters;
      const double algbw = static_cast<double>(mib << 20) / (ms * 1e-3) / 1e9;
      if (r == 0) {
        std::cout << (beside ? "all_reduce_beside_compute" : "all_reduce               ") << " "
                  << mib << " MiB f32 on " << n << " GPUs: " << ms << " ms, busbw "
                  << algbw * 2.0 * (n - 1) / n << " GB/s, host " << host_us / kIters << " us a call"
                  << std::endl;
      }
    }
  }
  ring.barrier()->wait();
}

// The NCCL backend across ranks, one GPU each (run on a machine with N GPUs through
// `kiln run --nproc-per-node N dist_worker nccl_collectives`): the collectives in f32, bf16 and
// f64 against values each rank computes itself, the large all-reduces (large_all_reduces, with
// all_reduce bus bandwidth from 4 MiB to 1 GiB in nccl-tests' convention, CUDA events, printed
// by rank 0), and DDP on CUDA against one process on the global batch.
void nccl_collectives() {
  auto pg = init_process_group("nccl", short_timeout(120000));
  const int r = pg->rank(), n = pg->size();
  WCHECK(n >= 2, "needs 2 or more ranks, got ", n);
  const char* local = std::getenv("LOCAL_RANK");
  const Device dev(kCUDA, local != nullptr ? std::atoi(local) : 0);
  const double tri = n * (n + 1) / 2.0;
  const Tensor base = arange(1, 6, kDouble);
  for (ScalarType dt : {kFloat, kBFloat16, kDouble}) {
    Tensor t = (base * (r + 1)).to(dt).to(dev);
    pg->all_reduce(t)->wait();
    expect_close(t, base * tri, dt == kBFloat16 ? 1e-2 : 1e-6, "nccl all_reduce sum");
    t = (base * (r + 1)).to(dt).to(dev);
    pg->all_reduce(t, ReduceOp::kMax)->wait();
    expect_close(t, base * n, 0, "nccl all_reduce max");
  }
  Tensor avg = (base * (r + 1)).to(kFloat).to(dev);
  pg->all_reduce(avg, ReduceOp::kAvg)->wait();
  expect_close(avg, base * (tri / n), 1e-6, "nccl all_reduce avg");
  large_all_reduces(pg, dev);
  Tensor b = full({4}, r + 7.0, TensorOptions(kFloat).device(dev));
  pg->broadcast(b, 1)->wait();
  expect_close(b, full({4}, 8.0), 0, "nccl broadcast from rank 1");
  Tensor gathered = empty({n * 3}, TensorOptions(kFloat).device(dev));
  pg->all_gather_into_tensor(gathered,
                             full({3}, static_cast<double>(r), TensorOptions(kFloat).device(dev)))
      ->wait();
  expect_close(gathered, (arange(0, 3 * n, kDouble) / 3).floor(), 0, "nccl all_gather_into_tensor");
  {
    // Coalesced: one NCCL group, into views of one buffer (the gap untouched), bf16 and f32.
    const TensorOptions f32 = TensorOptions(kFloat).device(dev);
    Tensor buf = full({n * 4 + 2 + n * 3}, -1.0, f32);
    std::vector<Tensor> outs{buf.narrow(0, 0, n * 4), buf.narrow(0, n * 4 + 2, n * 3),
                             empty({n * 2}, TensorOptions(kBFloat16).device(dev))};
    std::vector<Tensor> ins{(arange(0, 4, kFloat) + 10 * r).to(dev), full({3}, -r - 1.0, f32),
                            full({2}, r + 0.5, TensorOptions(kBFloat16).device(dev))};
    pg->all_gather_into_tensor_coalesced(outs, ins)->wait();
    for (int q = 0; q < n; ++q) {
      expect_close(buf.narrow(0, 4 * q, 4), arange(0, 4, kFloat) + 10 * q, 0, "nccl coalesced 0");
      expect_close(buf.narrow(0, n * 4 + 2 + 3 * q, 3), full({3}, -q - 1.0), 0, "nccl coalesced 1");
      expect_close(outs[2].narrow(0, 2 * q, 2), full({2}, q + 0.5), 0, "nccl coalesced bf16");
    }
    expect_close(buf.narrow(0, n * 4, 2), full({2}, -1.0), 0, "nccl coalesced: the gap");
  }
  std::vector<Tensor> list;
  for (int q = 0; q < n; ++q) list.push_back(empty({2}, TensorOptions(kFloat).device(dev)));
  pg->all_gather(list, full({2}, r * 10.0, TensorOptions(kFloat).device(dev)))->wait();
  for (int q = 0; q < n; ++q) expect_close(list[q], full({2}, q * 10.0), 0, "nccl all_gather list");
  Tensor rs = empty({2}, TensorOptions(kFloat).device(dev));
  pg->reduce_scatter_tensor(rs, (arange(0, 2 * n, kDouble) * (r + 1)).to(kFloat).to(dev))->wait();
  expect_close(rs, arange(2 * r, 2 * r + 2, kDouble) * tri, 1e-6, "nccl reduce_scatter_tensor");
  pg->barrier()->wait();

  // DDP on CUDA == one process on the global batch (f64: exact up to summation order).
  const int64_t per_rank = 3, global = per_rank * n;
  Mlp ref = make_mlp(100), model = make_mlp(100 + r);
  ref->to(dev);
  model->to(dev);
  DistributedDataParallel ddp(model, pg);
  manual_seed(7);
  const Tensor x = randn({global, 8}, kDouble).to(dev), y = randn({global, 4}, kDouble).to(dev);
  mse(ddp(x.narrow(0, r * per_rank, per_rank)), y.narrow(0, r * per_rank, per_rank)).backward();
  mse(ref(x), y).backward();
  expect_grads_close(model->parameters(), ref->parameters(), 1e-12, "nccl DDP ");

  // DDP whose first bucket (8 MiB) goes through the copy engines (all_reduce_beside_compute)
  // and whose last one through NCCL's kernels: == one process, two steps.
  {
    auto wide = [&](uint64_t seed) {
      manual_seed(seed);
      nn::Sequential m(nn::Linear(512, 2048), nn::Tanh(), nn::Linear(2048, 512));
      m->to(kDouble);
      m->to(dev);
      return m;
    };
    nn::Sequential wref = wide(300), wmodel = wide(300 + r);
    DDPOptions o;
    o.bucket_cap_mb = 9;
    DistributedDataParallel wddp(wmodel, pg, o);
    manual_seed(8);  // the same batch on every rank
    const Tensor wx = randn({global, 512}, kDouble).to(dev);
    const Tensor wy = randn({global, 512}, kDouble).to(dev);
    for (int step = 0; step < 2; ++step) {
      for (auto& q : wmodel->parameters()) q.mutable_grad() = Tensor();
      for (auto& q : wref->parameters()) q.mutable_grad() = Tensor();
      mse(wddp(wx.narrow(0, r * per_rank, per_rank)), wy.narrow(0, r * per_rank, per_rank))
          .backward();
      mse(wref->forward(wx), wy).backward();
      expect_grads_close(wmodel->parameters(), wref->parameters(), 1e-12,
                         "wide DDP step " + std::to_string(step) + ": ");
    }
    WCHECK(wddp.reducer().bucket_indices().size() == 2,
           "wide DDP: ", wddp.reducer().bucket_indices().size(), " buckets, expected 2");
  }

  pg->barrier()->wait();
}

// The NCCL watchdog (2 GPUs, `kiln run --nproc-per-node 2 dist_worker nccl_peer_absent`): rank
// 1 issues no collective for 20 s, so rank 0's first all_reduce blocks on the host connecting to
// it; the watchdog aborts the communicator after the group's 3 s timeout, and the call fails
// with an error that names the op and the timeout instead of hanging.
void nccl_peer_absent() {
  auto pg = init_process_group("nccl", short_timeout(3000));
  const char* local = std::getenv("LOCAL_RANK");
  const Device dev(kCUDA, local != nullptr ? std::atoi(local) : 0);
  if (pg->rank() != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(20));
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  const std::string e = error_of([&] {
    Tensor t = ones({1024}, TensorOptions().device(dev));
    pg->all_reduce(t)->wait(Milliseconds(3000));
  });
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WCHECK(
      e.find("[all_reduce]") != std::string::npos && e.find("within 3000 ms") != std::string::npos,
      "expected a timeout naming all_reduce, got: ", e);
  WCHECK(s < 15, "the timeout took ", s, " s");
  std::cout << "rank 0: all_reduce without its peer failed after " << s << " s: " << e << "\n";
}

// The copy-engine all-reduce's watchdog (2 GPUs, `kiln run --nproc-per-node 2 dist_worker
// peer_all_reduce_absent`): after one all_reduce_beside_compute together, rank 1 skips the next
// one for 12 s. Rank 0's streams would wait for its flags forever; the watchdog releases them
// after the group's 3 s timeout, so the host's synchronisation returns, and the group's next call
// fails naming the release.
void peer_all_reduce_absent() {
  auto pg = init_process_group("nccl", short_timeout(3000));
  auto* nccl = dynamic_cast<ProcessGroupNCCL*>(pg.get());
  const char* local = std::getenv("LOCAL_RANK");
  const Device dev(kCUDA, local != nullptr ? std::atoi(local) : 0);
  Tensor t = ones({int64_t{4} << 20}, TensorOptions().device(dev));  // 16 MiB
  pg->all_reduce_beside_compute(t)->wait();
  WCHECK(max_error(t, full({t.numel()}, 2.0, TensorOptions().device(dev))) == 0,
         "the first all-reduce");
  if (nccl->large_all_reduce_path() != "copy engines") {
    std::cout << "rank " << pg->rank() << ": skipped, " << nccl->large_all_reduce_path() << "\n";
    return;
  }
  if (pg->rank() != 0) {
    std::this_thread::sleep_for(std::chrono::seconds(12));
    return;
  }
  const auto t0 = std::chrono::steady_clock::now();
  pg->all_reduce_beside_compute(t)->wait();  // the current stream waits, the host does not
  cuda::synchronize();                       // returns once the watchdog has released the waits
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  WCHECK(s >= 2.5 && s < 10, "the release took ", s, " s");
  const std::string e = error_of([&] { pg->all_reduce_beside_compute(t)->wait(); });
  WCHECK(e.find("released after an earlier timeout") != std::string::npos,
         "expected the released group's error, got: ", e);
  std::cout << "rank 0: released after " << s << " s; then: " << e << std::endl;
}

// A tied embedding and LM head: the table's lookup through gathered_embedding, its dense use
// the logits.
struct TiedImpl : nn::Module {
  TiedImpl() {
    table = register_parameter("table", randn({11, 4}, kDouble) * 0.5);
    proj = register_module("proj", nn::Linear(4, 4));
    proj->to(kDouble);
  }
  Tensor table;
  nn::Linear proj{nullptr};
};
KILN_MODULE(Tied);

Tensor tied_loss(Tied& m, const Tensor& h, const Tensor& y) {
  Tensor logits = matmul(m->proj(h).tanh(), m->table.t());  // [B, T, V]
  return nn::functional::cross_entropy(logits.reshape({-1, logits.size(2)}), y.reshape({-1}));
}

Tied seeded_tied(uint64_t seed) {
  manual_seed(seed);
  return Tied();
}

DDPOptions tied_options() {
  DDPOptions opts;
  opts.bucket_cap_mb = 300.0 / (1 << 20);
  opts.gradient_as_bucket_view = bucket_view_from_env();
  return opts;
}

optim::SGD tied_sgd(Tied& m) {
  return optim::SGD(m->parameters(), optim::SGDOptions(0.1).momentum(0.9));
}

// A Tied model under DDP over Gloo, and the same model (same seed) for one process on the
// global batch, each with SGD and momentum; several buckets (the table shares one, so that its
// averaged gradient is a bucket view when views are on).
struct TiedDdp {
  explicit TiedDdp(uint64_t seed)
      : pg(init_process_group("gloo", short_timeout(20000))),
        ref(seeded_tied(seed)),
        model(seeded_tied(seed)),
        ddp(model, pg, tied_options()),
        opt(tied_sgd(model)),
        ref_opt(tied_sgd(ref)) {}
  std::shared_ptr<ProcessGroup> pg;
  Tied ref, model;
  DistributedDataParallel<Tied> ddp;
  optim::SGD opt, ref_opt;
};

// DDP with gathered_embedding == one process with kiln::embedding on the global batch: losses
// and gradients after every step, with two micro-batches accumulated under no_sync() in the last
// steps.
void ddp_gathered_embedding() {
  TiedDdp t(200);
  auto& [pg, ref, model, ddp, opt, ref_opt] = t;
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 2, global = local * n, T = 5;
  manual_seed(9);  // the same global batches on every rank
  for (int step = 0; step < 5; ++step) {
    const int micro = step >= 3 ? 2 : 1;
    opt.zero_grad();
    ref_opt.zero_grad();
    double loss_sum = 0, ref_sum = 0;
    for (int k = 0; k < micro; ++k) {
      Tensor idx = randint(0, 11, {global, T}, kInt64), y = randint(0, 11, {global, T}, kInt64);
      Tensor my_idx = idx.narrow(0, r * local, local), my_y = y.narrow(0, r * local, local);
      auto pass = [&] {
        Tensor loss = ddp.run([&] {
          Tensor h = ddp.gathered_embedding(ddp->table, my_idx);
          WCHECK(h.grad_fn() != nullptr && h.grad_fn()->name() == "GatheredEmbeddingBackward",
                 "the lookup's node is ", h.grad_fn() ? h.grad_fn()->name() : "none");
          return tied_loss(model, h, my_y);
        });
        loss.backward();
        loss_sum += loss.item<double>();
      };
      if (k + 1 < micro) {
        auto guard = ddp.no_sync();
        pass();
      } else {
        pass();
      }
      Tensor ref_loss = tied_loss(ref, embedding(ref->table, idx), y);
      ref_loss.backward();
      ref_sum += ref_loss.item<double>();
    }
    expect_global_loss(*pg, loss_sum, ref_sum, step);
    expect_grads_close(ddp->parameters(), ref->parameters(), 1e-12,
                       "step " + std::to_string(step) + ": ");
    opt.step();
    ref_opt.step();
  }
  const std::string e = error_of([&] {
    ddp.gathered_embedding(ones({3, 4}, kDouble), ones({2}, kInt64));
  });
  WCHECK(e.find("is not a parameter of the module") != std::string::npos, e);
}

// A compiled DDP training step on GPUs over NCCL (GpuDdpTest runs it at 1 and 2 ranks, `kiln run
// --nproc-per-node 4 dist_worker ddp_compiled_nccl` at 4). The model has buckets of 4 MiB (the
// copy engines' all-reduce where the GPUs reach each other) and smaller ones (NCCL's), the
// embedding's rows gathered (DDP's all-gather), AdamW. Step after step it equals eager DDP on the
// same batches; the ranks' weights stay equal; the program measures how it runs (op by op, or as
// CUDA graphs whose all-reduces start after each launch, the same collectives) and says which it
// kept.
struct WideImpl : nn::Module {
  WideImpl() {
    table = register_parameter("table", randn({64, 512}) * 0.5);
    fc1 = register_module("fc1", nn::Linear(512, 2048));  // 4 MiB weights
    fc2 = register_module("fc2", nn::Linear(2048, 512));
  }
  Tensor table;
  nn::Linear fc1{nullptr}, fc2{nullptr};
};
KILN_MODULE(Wide);

void ddp_compiled_nccl() {
  auto pg = init_process_group("nccl", short_timeout(60000));
  const int r = pg->rank(), n = pg->size();
  const char* local = std::getenv("LOCAL_RANK");
  const Device dev(kCUDA, local != nullptr ? std::atoi(local) : 0);
  const int64_t B = 2, T = 64;
  DDPOptions opts;
  opts.bucket_cap_mb = 4.5;
  struct Replica {
    Wide model;
    std::unique_ptr<DistributedDataParallel<Wide>> ddp;
    std::unique_ptr<optim::AdamW> opt;
  };
  auto replica = [&] {
    manual_seed(300 + r);  // DDP broadcasts rank 0's
    Replica m;
    m.model->to(dev);
    m.ddp = std::make_unique<DistributedDataParallel<Wide>>(m.model, pg, opts);
    m.opt = std::make_unique<optim::AdamW>(m.model->parameters(), optim::AdamWOptions(1e-3));
    return m;
  };
  Replica a = replica(), b = replica();
  auto step_of = [&](Replica& m) {
    return [&m](const Tensor& idx, const Tensor& y) {
      m.opt->zero_grad();
      Tensor loss = m.ddp->run([&] {
        Tensor h = m.ddp->gathered_embedding(m.model->table, idx);
        Tensor logits = matmul(m.model->fc2(m.model->fc1(h).relu()), m.model->table.t());
        return nn::functional::cross_entropy(logits.reshape({-1, logits.size(2)}), y.reshape({-1}));
      });
      loss.backward();
      m.opt->step();
      return loss.detach();
    };
  };
  auto compiled = kiln::compile(step_of(a));
  auto eager = step_of(b);
  manual_seed(11 + r);  // each rank its own batches
  // Two traces (the buckets rebuilt), then the measurement of how the program runs: 3 runs op
  // by op, a capture and 3 replays of CUDA graphs (the all-reduces started after each launch of
  // the graph of the backward, their waits between graphs); equal to eager DDP all along, and
  // after it.
  for (int i = 0; i < 12; ++i) {
    const Tensor idx = randint(0, 64, {B, T}, kInt64).to(dev);
    const Tensor y = randint(0, 64, {B, T}, kInt64).to(dev);
    const Tensor la = compiled(idx, y), lb = eager(idx, y);
    expect_close(la.cpu(), lb.cpu(), 1e-5, "step " + std::to_string(i) + ": the loss");
  }
  const auto pa = a.model->parameters(), pb = b.model->parameters();
  for (size_t k = 0; k < pa.size(); ++k) {
    expect_close(pa[k].cpu(), pb[k].cpu(), 1e-4, "weight " + std::to_string(k));
    Tensor first = pa[k].clone();
    pg->broadcast(first, 0)->wait();
    WCHECK(max_error(pa[k], first) == 0, "rank ", r, "'s weight ", k, " differs from rank 0's by ",
           max_error(pa[k], first));
  }
  const auto& st = compiled.stats();
  const bool graphs = st.cuda_graph == "replaying" && st.graph_captures == 1 &&
                      st.graph_reason.find("measured") != std::string::npos;
  const bool op_by_op = st.cuda_graph == "off" && st.graph_captures == 1 &&
                        st.graph_reason.rfind("op by op measured faster", 0) == 0;
  WCHECK(st.misses == 2 && (graphs || op_by_op), st.misses,
         " compilations, graphs: ", st.cuda_graph, " (", st.graph_reason, "), ", st.graph_captures,
         " captures");
  if (r == 0) {
    auto* nccl = dynamic_cast<ProcessGroupNCCL*>(pg.get());
    std::cout << "compiled ddp == eager ddp over nccl (" << n
              << " ranks, large all-reduces: " << (nccl ? nccl->large_all_reduce_path() : "?")
              << ")\n";
  }
}

// gathered_embedding in a compiled step (Gloo, CPU): the trace holds the rows' all-gathers and
// their addition to the table's gradient after the table's all-reduce, which takes the LM
// head's part alone; step after step the compiled step equals one process on the global batch.
void ddp_compiled_gathered_embedding() {
  TiedDdp t(201);
  auto& [pg, ref, model, ddp, opt, ref_opt] = t;
  const int r = pg->rank(), n = pg->size();
  const int64_t local = 2, global = local * n, T = 5;
  auto step = kiln::compile([&](const Tensor& idx, const Tensor& y) {
    opt.zero_grad();
    Tensor loss =
        ddp.run([&] { return tied_loss(model, ddp.gathered_embedding(ddp->table, idx), y); });
    loss.backward();
    opt.step();
    return loss.detach();
  });
  manual_seed(10);  // the same global batches on every rank
  for (int i = 0; i < 4; ++i) {
    Tensor idx = randint(0, 11, {global, T}, kInt64), y = randint(0, 11, {global, T}, kInt64);
    const Tensor loss = step(idx.narrow(0, r * local, local).contiguous(),
                             y.narrow(0, r * local, local).contiguous());
    ref_opt.zero_grad();
    const Tensor ref_loss = tied_loss(ref, embedding(ref->table, idx), y);
    ref_loss.backward();
    ref_opt.step();
    expect_step_equals_one_process(*pg, i, loss, ref_loss, ddp->parameters(), ref->parameters());
  }
  WCHECK(step.stats().misses == 2, "two compilations, got ", step.stats().misses);
  const std::string listing = step.traces().back().str();
  const size_t last_reduce = listing.rfind("dist_all_reduce_(");
  const size_t gather = listing.find("dist_all_gather_(");
  const size_t add = listing.find("index_add");
  WCHECK(
      last_reduce != std::string::npos && gather != std::string::npos && add != std::string::npos,
      "the trace holds the all-reduces, the rows' all-gathers and their addition:\n", listing);
  // The table's all-reduce (of the LM head's part) does not wait for the lookup's rows: they
  // are gathered and added after it, the only index_add of the step.
  WCHECK(last_reduce < gather && gather < add,
         "the rows are gathered and added after the "
         "all-reduces:\n",
         listing);
  // The buckets were rebuilt from the first traced backward's ready order.
  WCHECK(ddp.reducer().buckets_rebuilt(), "the buckets were not rebuilt");
  // With gradient_as_bucket_view the table is alone in its bucket: its gradient, all-reduced in
  // place, takes the rows itself (compiler/passes.h, fold_index_add), not a copy of it.
  if (bucket_view_from_env()) {
    std::string folded;
    for (const compiler::Trace& trace : step.traces()) {
      if (trace.stage == "fold_index_add") folded = trace.str();
    }
    WCHECK(folded.find("index_add_(") != std::string::npos,
           "the rows go into the all-reduced gradient in place:\n", folded);
  }
  if (r == 0) std::cout << "compiled gathered_embedding == one process\n";
}

// Ranks with different models are refused by the constructor.
void ddp_mismatch() {
  auto pg = init_process_group("gloo", short_timeout(10000));
  manual_seed(1);
  nn::Linear model(4, pg->rank() == 0 ? 3 : 5);
  const std::string e = error_of([&] { DistributedDataParallel ddp(model, pg); });
  WCHECK(e.find("[DistributedDataParallel] the ranks hold different models") != std::string::npos,
         e);
}

const test::Scenarios& scenarios() {
  static const test::Scenarios m = {
      {"collectives", collectives},
      {"collective_timeout", collective_timeout},
      {"peer_exits", peer_exits},
      {"killed_mid_step", killed_mid_step},
      {"ddp_equivalence", ddp_equivalence},
      {"ddp_unused_parameter", ddp_unused_parameter},
      {"ddp_mismatch", ddp_mismatch},
      {"ddp_find_unused", ddp_find_unused},
      {"nccl_collectives", nccl_collectives},
      {"nccl_peer_absent", nccl_peer_absent},
      {"peer_all_reduce_absent", peer_all_reduce_absent},
      {"ddp_two_dtypes", ddp_two_dtypes},
      {"ddp_bucket_view", ddp_bucket_view},
      {"ddp_rebuild_buckets", ddp_rebuild_buckets},
      {"ddp_compiled", ddp_compiled},
      {"ddp_gathered_embedding", ddp_gathered_embedding},
      {"ddp_compiled_nccl", ddp_compiled_nccl},
      {"ddp_compiled_gathered_embedding", ddp_compiled_gathered_embedding},
  };
  return m;
}

}  // namespace

int main(int argc, char** argv) {
  return kiln::test::run_worker("dist_worker", scenarios(), argc, argv);
}
