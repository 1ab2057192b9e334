// FSDPModule's state dicts and sharded checkpoints (dist/fsdp.h): full tensors gathered from the
// shards and scattered back, this rank's shards, one safetensors file per rank read at any world
// size. The sharding itself is dist/fsdp.cpp, the gathers dist/fsdp_collectives.cpp.
#include <cstdio>
#include <filesystem>
#include <sstream>
#include <unordered_map>

#include "autograd/grad_mode.h"
#include "dist/fsdp.h"
#include "nn/safetensors.h"
#include "tensor/error.h"
#include "tensor/ops.h"

namespace kiln::dist {
namespace {

int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

Shape parse_csv(const std::string& csv) {
  Shape out;
  std::stringstream ss(csv);
  for (std::string part; std::getline(ss, part, ',');) out.push_back(std::stoll(part));
  return out;
}

std::string shape_csv(IntArrayRef shape) {
  std::string s;
  for (size_t d = 0; d < shape.size(); ++d) s += (d ? "," : "") + std::to_string(shape[d]);
  return s;
}

}  // namespace

// --- State dicts --------------------------------------------------------------------------------

std::vector<Tensor> FSDPModule::gather_full(ScalarType dtype) {
  std::vector<Tensor> out;
  if (params_.empty()) return out;
  NoGradGuard no_grad;
  Tensor packed = packed_shard().to(dtype);
  Tensor buffer = empty({pg_->size() * packed_}, packed.options());
  pg_->all_gather_into_tensor(buffer, packed)->wait();
  const Tensor rows = buffer.view({pg_->size(), packed_});
  for (const Param& p : params_) {
    out.push_back(rows.narrow(1, p.offset, p.shard)
                      .reshape({-1})
                      .narrow(0, 0, p.numel)
                      .contiguous()
                      .view(p.shape));
  }
  return out;
}

std::map<std::string, Tensor> FSDPModule::full_state_dict(bool rank0_only) {
  std::map<std::string, Tensor> out = module_->state_dict();
  std::unordered_map<const TensorImpl*, std::string> name_of;
  for (const auto& item : module_->named_parameters()) name_of[item.value().impl()] = item.key();
  for (FSDPModule* u : subtree()) {
    const auto fulls = u->gather_full(u->dtype_);
    for (size_t i = 0; i < fulls.size(); ++i)
      out[name_of.at(u->params_[i].param.impl())] = fulls[i];
  }
  if (rank0_only && pg_->rank() != 0) return {};
  return out;
}

void FSDPModule::load_full_state_dict(const std::map<std::string, Tensor>& state_dict) {
  std::unordered_map<const TensorImpl*, std::pair<FSDPModule*, size_t>> owner;
  for (FSDPModule* u : subtree()) {
    for (size_t i = 0; i < u->params_.size(); ++i) owner[u->params_[i].param.impl()] = {u, i};
  }
  const auto mine = module_->state_dict();
  const auto named = module_->named_parameters();
  std::vector<std::string> problems;
  for (const auto& [name, t] : mine) {
    auto it = state_dict.find(name);
    if (it == state_dict.end()) {
      problems.push_back("missing '" + name + "'");
      continue;
    }
    Shape want(t.sizes().begin(), t.sizes().end());
    if (const Tensor* p = named.find(name)) {
      if (auto o = owner.find(p->impl()); o != owner.end()) {
        want = o->second.first->params_[o->second.second].shape;
      }
    }
    if (Shape(it->second.sizes().begin(), it->second.sizes().end()) != want) {
      problems.push_back("'" + name + "' has shape " + shape_str(it->second.sizes()) +
                         ", the model's is " + shape_str(want));
    }
  }
  for (const auto& [name, t] : state_dict) {
    if (!mine.contains(name)) problems.push_back("unexpected '" + name + "'");
  }
  if (!problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += (all.empty() ? "" : "; ") + p;
    KILN_FAIL("[FSDPModule::load_full_state_dict] the state dict does not fit ", module_->name(),
              ": ", all);
  }
  NoGradGuard no_grad;
  const int rank = pg_->rank();
  for (const auto& [name, t] : mine) {
    const Tensor& src = state_dict.at(name);
    const Tensor* p = named.find(name);
    auto o = p == nullptr ? owner.end() : owner.find(p->impl());
    if (o == owner.end()) {
      Tensor dst = t;
      dst.copy_(src);
      continue;
    }
    FSDPModule& u = *o->second.first;
    const Param& q = u.params_[o->second.second];
    Tensor shard = u.unsharded_ ? q.sharded : q.param.detach();
    shard.zero_();
    const int64_t begin = std::min<int64_t>(rank * q.shard, q.numel);
    const int64_t len = std::min<int64_t>(q.shard, q.numel - begin);
    if (len > 0) shard.narrow(0, 0, len).copy_(src.reshape({-1}).narrow(0, begin, len));
  }
  for (FSDPModule* u : subtree()) u->refresh_full();
}

std::map<std::string, Tensor> FSDPModule::sharded_state_dict() const {
  std::map<std::string, Tensor> out = module_->state_dict();
  std::unordered_map<const TensorImpl*, std::string> name_of;
  for (const auto& item : module_->named_parameters()) name_of[item.value().impl()] = item.key();
  for (FSDPModule* u : const_cast<FSDPModule*>(this)->subtree()) {
    for (const Param& p : u->params_) {
      out[name_of.at(p.param.impl())] = u->unsharded_ ? p.sharded : p.param.detach();
    }
  }
  return out;
}

void FSDPModule::load_sharded_state_dict(const std::map<std::string, Tensor>& state_dict) {
  const auto mine = sharded_state_dict();
  const int world = pg_->size();
  std::vector<std::string> problems;
  for (const auto& [name, t] : mine) {
    auto it = state_dict.find(name);
    if (it == state_dict.end()) {
      problems.push_back("missing '" + name + "'");
    } else if (it->second.sizes() != t.sizes()) {
      problems.push_back("'" + name + "' has shape " + shape_str(it->second.sizes()) +
                         ", this rank's is " + shape_str(t.sizes()));
    }
  }
  for (const auto& [name, t] : state_dict) {
    if (!mine.contains(name)) problems.push_back("unexpected '" + name + "'");
  }
  if (!problems.empty()) {
    std::string all;
    for (const auto& p : problems) all += (all.empty() ? "" : "; ") + p;
    KILN_FAIL("[FSDPModule::load_sharded_state_dict] the state dict does not fit ", module_->name(),
              " sharded over ", world, " ranks (shards of another world size ",
              "do not load here: use load_full_state_dict or load_sharded_checkpoint): ", all);
  }
  NoGradGuard no_grad;
  for (const auto& [name, t] : mine) {
    Tensor dst = t;
    dst.copy_(state_dict.at(name));
  }
  for (FSDPModule* u : subtree()) u->refresh_full();
}

namespace {
std::string shard_file(const std::string& dir, int rank, int world) {
  return dir + "/shard-" + std::to_string(rank) + "-of-" + std::to_string(world) + ".safetensors";
}
}  // namespace

void FSDPModule::save_sharded_checkpoint(const std::string& dir) const {
  std::error_code ec;
  std::filesystem::create_directories(dir, ec);
  KILN_CHECK(!ec, "[FSDPModule::save_sharded_checkpoint] cannot create ", dir, ": ", ec.message());
  const int rank = pg_->rank(), world = pg_->size();
  std::map<std::string, Tensor> tensors = sharded_state_dict();
  SafetensorsMetadata meta{{"fsdp_world_size", std::to_string(world)},
                           {"fsdp_rank", std::to_string(rank)}};
  std::unordered_map<const TensorImpl*, std::string> name_of;
  for (const auto& item : module_->named_parameters()) name_of[item.value().impl()] = item.key();
  for (FSDPModule* u : const_cast<FSDPModule*>(this)->subtree()) {
    for (const Param& p : u->params_)
      meta["shape:" + name_of.at(p.param.impl())] = shape_csv(p.shape);
  }
  save_safetensors(tensors, shard_file(dir, rank, world), meta);
  pg_->barrier()->wait();  // every file is in place when any rank returns
}

void FSDPModule::load_sharded_checkpoint(const std::string& dir) {
  const char* op = "[FSDPModule::load_sharded_checkpoint]";
  int old_world = 0;
  std::error_code ec;
  for (const auto& e : std::filesystem::directory_iterator(dir, ec)) {
    const std::string f = e.path().filename().string();
    int r = 0, w = 0;
    char tail[16] = {};
    if (std::sscanf(f.c_str(), "shard-%d-of-%d.%15s", &r, &w, tail) == 3 && r == 0 &&
        std::string(tail) == "safetensors") {
      old_world = w;
    }
  }
  KILN_CHECK(!ec, op, " cannot read ", dir, ": ", ec.message());
  KILN_CHECK(old_world > 0, op, " ", dir, " holds no shard-0-of-N.safetensors (not a sharded ",
             "checkpoint)");
  std::vector<SafetensorsFile> files;
  for (int k = 0; k < old_world; ++k) {
    const std::string path = shard_file(dir, k, old_world);
    KILN_CHECK(std::filesystem::exists(path), op, " ", path, " is missing: the checkpoint was ",
               "written by ", old_world, " ranks and needs all their files");
    files.emplace_back(path);
  }
  std::unordered_map<const TensorImpl*, std::pair<FSDPModule*, size_t>> owner;
  for (FSDPModule* u : subtree()) {
    for (size_t i = 0; i < u->params_.size(); ++i) owner[u->params_[i].param.impl()] = {u, i};
  }
  const auto named = module_->named_parameters();
  // Everything that is not a sharded parameter is whole in every file: take rank 0's.
  std::map<std::string, Tensor> whole;
  for (const auto& [name, t] : module_->state_dict()) {
    const Tensor* p = named.find(name);
    if (p != nullptr && owner.contains(p->impl())) continue;
    KILN_CHECK(files[0].contains(name), op, " ", files[0].name(), " has no '", name, "'");
    whole[name] = files[0].read(name);  // copied with pread: a truncated file is an error
  }
  NoGradGuard no_grad;
  const int rank = pg_->rank();
  for (const auto& item : named) {
    auto o = owner.find(item.value().impl());
    if (o == owner.end()) continue;
    FSDPModule& u = *o->second.first;
    const Param& q = u.params_[o->second.second];
    const auto& meta = files[0].metadata();
    auto m = meta.find("shape:" + item.key());
    KILN_CHECK(m != meta.end(), op, " ", files[0].name(), " has no '", item.key(), "'");
    const Shape saved = parse_csv(m->second);
    KILN_CHECK(saved == q.shape, op, " '", item.key(), "' has shape ", shape_str(saved), " in ",
               dir, ", the model's is ", shape_str(q.shape));
    const int64_t old_shard = ceil_div(q.numel, old_world);
    Tensor shard = u.unsharded_ ? q.sharded : q.param.detach();
    shard.zero_();
    const int64_t begin = std::min<int64_t>(rank * q.shard, q.numel);
    const int64_t end = std::min<int64_t>(begin + q.shard, q.numel);
    for (int k = 0; k < old_world && begin < end; ++k) {
      const int64_t lo = std::max<int64_t>(begin, k * old_shard);
      const int64_t hi = std::min<int64_t>(end, (k + 1) * old_shard);
      if (lo >= hi) continue;
      Tensor src = files[k].read(item.key());
      KILN_CHECK(src.numel() == old_shard, op, " '", item.key(), "' in ", files[k].name(), " has ",
                 src.numel(), " elements, expected ", old_shard);
      shard.narrow(0, lo - begin, hi - lo).copy_(src.narrow(0, lo - k * old_shard, hi - lo));
    }
  }
  for (const auto& [name, t] : module_->state_dict()) {
    auto it = whole.find(name);
    if (it == whole.end()) continue;
    Tensor dst = t;
    dst.copy_(it->second);
  }
  for (FSDPModule* u : subtree()) u->refresh_full();
}

}  // namespace kiln::dist
