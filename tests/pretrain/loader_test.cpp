// The shard loader (pretrain/loader.h): windows and targets, the seeded order (a permutation per
// epoch), disjoint ranks, and the resume/rescale property: whatever the sequence of world sizes,
// batch sizes and restarts (through the JSON state), the job reads every global sequence once,
// in the order of a single uninterrupted rank. Bad states and shard sets get clear errors.
#include "pretrain/loader.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <map>
#include <random>
#include <set>
#include <vector>

#include "pretrain_test_util.h"
#include "tensor/ops.h"
#include "test_util.h"

namespace kiln::pretrain {
namespace {

class LoaderTest : public test::TempDirTest {
 protected:
  // Three shards of counting tokens: 1000 + 1, 2000 + 1 (each starting far apart) and a short
  // one, so that each window's first token names it.
  std::shared_ptr<const ShardSet> three_shards() {
    test::write_counting_shard(file("s0.tokens"), 0, 101);
    test::write_counting_shard(file("s1.tokens"), 100000, 201);
    test::write_counting_shard(file("s2.tokens"), 200000, 15);
    return std::make_shared<ShardSet>(ShardSet::open(dir().string()));
  }
};

TEST(PermutationTest, IsABijectionThatDependsOnTheSeed) {
  for (uint64_t n : {1, 2, 3, 5, 16, 17, 1000, 4097}) {
    Permutation p(n, 7);
    std::set<uint64_t> seen;
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t v = p(i);
      ASSERT_LT(v, n);
      seen.insert(v);
    }
    EXPECT_EQ(seen.size(), n) << "n = " << n;
  }
  Permutation a(1000, 1), b(1000, 2);
  int same = 0, fixed = 0;
  for (uint64_t i = 0; i < 1000; ++i) same += a(i) == b(i), fixed += a(i) == i;
  EXPECT_LT(same, 20);
  EXPECT_LT(fixed, 20);
  EXPECT_KILN_ERROR(a(1000), "permutation index 1000 out of [0, 1000)");
}

TEST_F(LoaderTest, WindowsAreSeqPlusOneTokensTargetsShiftedNoneCrossesAShard) {
  auto shards = three_shards();
  EXPECT_EQ(shards->size(), 3u);
  EXPECT_EQ(shards->num_tokens(), 101 + 201 + 15);
  // seq 10: (101 - 1) / 10 = 10 windows, 20, and 1 from the short shard = 31; 10% held out = 3.
  ShardLoader loader(shards, {.seq_len = 10, .batch_size = 4, .seed = 3});
  EXPECT_EQ(loader.num_train_sequences(), 28);
  EXPECT_EQ(loader.num_val_sequences(), 3);
  for (int step = 0; step < 7; ++step) {
    auto [x, y] = loader.next();
    ASSERT_EQ(x.sizes(), (std::vector<int64_t>{4, 10}));
    const int64_t* px = x.data_ptr<int64_t>();
    const int64_t* py = y.data_ptr<int64_t>();
    for (int b = 0; b < 4; ++b) {
      const int64_t first = px[b * 10];
      // Windows start at multiples of seq_len inside their shard.
      EXPECT_EQ((first % 100000) % 10, 0) << first;
      for (int t = 0; t < 10; ++t) {
        EXPECT_EQ(px[b * 10 + t], first + t);
        EXPECT_EQ(py[b * 10 + t], first + t + 1);
      }
    }
  }
  std::vector<int64_t> w(11);
  loader.read_window(30, w.data());  // the last window: the short shard's only one
  EXPECT_EQ(w.front(), 200000);
  EXPECT_EQ(w.back(), 200010);
}

TEST_F(LoaderTest, AnEpochVisitsEveryTrainingWindowOnceInASeededOrder) {
  auto shards = three_shards();
  ShardLoader a(shards, {.seq_len = 10, .seed = 3});
  ShardLoader b(shards, {.seq_len = 10, .seed = 4});
  const int64_t t = a.num_train_sequences();
  std::vector<int64_t> ea, ea2, eb;
  for (int64_t g = 0; g < t; ++g) {
    ea.push_back(a.window_of(static_cast<uint64_t>(g)));
    ea2.push_back(a.window_of(static_cast<uint64_t>(g + t)));
    eb.push_back(b.window_of(static_cast<uint64_t>(g)));
  }
  std::vector<int64_t> sorted = ea;
  std::sort(sorted.begin(), sorted.end());
  for (int64_t i = 0; i < t; ++i) EXPECT_EQ(sorted[static_cast<size_t>(i)], i);  // no val window
  EXPECT_TRUE(std::is_permutation(ea.begin(), ea.end(), ea2.begin()));
  EXPECT_NE(ea, ea2);  // the next epoch is shuffled again
  EXPECT_NE(ea, eb);   // another seed, another order
  ShardLoader a2(shards, {.seq_len = 10, .seed = 3});
  for (int64_t g = 0; g < t; ++g) EXPECT_EQ(a2.window_of(static_cast<uint64_t>(g)), ea[g]);
}

TEST_F(LoaderTest, RanksReadDisjointPartsOfEachGlobalStep) {
  auto shards = three_shards();
  std::vector<ShardLoader> ranks;
  for (int64_t r = 0; r < 3; ++r) {
    ranks.emplace_back(
        shards,
        LoaderOptions{.seq_len = 10, .batch_size = 2, .rank = r, .world_size = 3, .seed = 9});
  }
  std::set<int64_t> firsts;
  for (int step = 0; step < 4; ++step) {  // 4 steps x 6 sequences = 24 of the 28 windows
    for (auto& l : ranks) {
      auto [x, y] = l.next();
      for (int b = 0; b < 2; ++b) firsts.insert(x.data_ptr<int64_t>()[b * 10]);
    }
  }
  EXPECT_EQ(firsts.size(), 24u);
  for (auto& l : ranks) EXPECT_EQ(l.position(), 24u);
}

// The property of the issue: a job that stops and resumes, each time with another number of
// ranks and another batch size, reads the global sequences 0, 1, 2, ... exactly once each, with
// the same windows as one uninterrupted rank, across epoch boundaries.
TEST_F(LoaderTest, ResumeWithAnotherWorldSizeNeitherRepeatsNorSkips) {
  auto shards = three_shards();
  ShardLoader reference(shards, {.seq_len = 10, .seed = 5});
  std::mt19937 rng(123);
  for (int trial = 0; trial < 20; ++trial) {
    std::map<uint64_t, int64_t> read;  // global sequence -> first token read for it
    std::string saved = LoaderState{.seed = 5,
                                    .seq_len = 10,
                                    .train_sequences = reference.num_train_sequences(),
                                    .data_fingerprint = shards->data_fingerprint()}
                            .to_json();
    for (int segment = 0; segment < 5; ++segment) {
      const int64_t world = 1 + static_cast<int64_t>(rng() % 5);
      const int64_t batch = 1 + static_cast<int64_t>(rng() % 4);
      const int steps = 1 + static_cast<int>(rng() % 6);
      std::vector<ShardLoader> ranks;
      for (int64_t r = 0; r < world; ++r) {
        ranks.emplace_back(
            shards,
            LoaderOptions{
                .seq_len = 10, .batch_size = batch, .rank = r, .world_size = world, .seed = 5});
        ranks.back().load_state(LoaderState::from_json(saved, "state"));
      }
      for (int s = 0; s < steps; ++s) {
        for (auto& l : ranks) {
          const std::vector<uint64_t> ids = l.next_sequence_ids();
          auto [x, y] = l.next();
          for (size_t b = 0; b < ids.size(); ++b) {
            ASSERT_FALSE(read.contains(ids[b])) << "sequence " << ids[b] << " read twice";
            read[ids[b]] = x.data_ptr<int64_t>()[b * 10];
          }
        }
      }
      // Every rank is at the same place; any of them saves it.
      for (auto& l : ranks) ASSERT_EQ(l.position(), ranks[0].position());
      saved = ranks[rng() % ranks.size()].state().to_json();
    }
    // No gap: the sequences read are exactly 0 .. n-1, and each is the reference's window.
    ASSERT_FALSE(read.empty());
    EXPECT_EQ(read.rbegin()->first + 1, read.size()) << "a sequence was skipped";
    std::vector<int64_t> w(11);
    for (const auto& [g, first] : read) {
      reference.read_window(reference.window_of(g), w.data());
      ASSERT_EQ(first, w[0]) << "sequence " << g;
    }
    EXPECT_EQ(LoaderState::from_json(saved, "s").position, read.size());
  }
}

TEST_F(LoaderTest, ValidationWindowsAreTheTailAndNeverTrainedOn) {
  auto shards = three_shards();
  ShardLoader loader(
      shards,
      {.seq_len = 10, .batch_size = 4, .seed = 1, .val_fraction = 0.2, .max_val_sequences = 5});
  EXPECT_EQ(loader.num_val_sequences(), 5);  // floor(31 * 0.2) = 6, capped at 5
  std::set<int64_t> val;
  for (int64_t i = 0; i < 3; ++i) {
    auto [x, y] = loader.validation_batch(i, 2);
    for (int b = 0; b < 2; ++b) val.insert(x.data_ptr<int64_t>()[b * 10]);
    EXPECT_EQ(y.data_ptr<int64_t>()[0], x.data_ptr<int64_t>()[1]);
  }
  EXPECT_EQ(val.size(), 5u);  // 6 rows wrap around the 5 windows
  EXPECT_TRUE(val.contains(200000));
  for (int64_t g = 0; g < 2 * loader.num_train_sequences(); ++g) {
    EXPECT_LT(loader.window_of(static_cast<uint64_t>(g)), 26);
  }
  ShardLoader none(shards, {.seq_len = 10, .val_fraction = 0});
  EXPECT_KILN_ERROR(none.validation_batch(0, 1), "no validation sequences");
}

TEST_F(LoaderTest, StatesOfOtherDataAreRefused) {
  auto shards = three_shards();
  ShardLoader loader(shards, {.seq_len = 10, .batch_size = 2, .seed = 1});
  loader.next();
  const LoaderState st = loader.state();
  EXPECT_EQ(st.position, 2u);
  EXPECT_EQ(LoaderState::from_json(st.to_json(), "x"), st);

  ShardLoader other_seed(shards, {.seq_len = 10, .seed = 2});
  EXPECT_KILN_ERROR(other_seed.load_state(st), "the saved position is for seed 1, not 2");
  ShardLoader other_seq(shards, {.seq_len = 12, .seed = 1});
  EXPECT_KILN_ERROR(other_seq.load_state(st), "for seq_len 10, not 12");
  test::write_counting_shard(file("extra.tokens"), 0, 50);
  auto more = std::make_shared<ShardSet>(ShardSet::open(dir().string()));
  ShardLoader other_data(more, {.seq_len = 10, .seed = 1});
  EXPECT_KILN_ERROR(other_data.load_state(st), "the saved position is in other data");
  other_data.load_state(st, /*allow_other_data=*/true);
  EXPECT_EQ(other_data.position(), 2u);

  EXPECT_KILN_ERROR(LoaderState::from_json("{\"position\": 1}", "ckpt/trainer_state.json"),
                    "ckpt/trainer_state.json: the loader state has no \"seed\"");
  EXPECT_KILN_ERROR(LoaderState::from_json("{\"position\": -1}", "f"), "f: ");
  EXPECT_KILN_ERROR(LoaderState::from_json("{\"position\": 1, \"position\": 2}", "f"),
                    "duplicate key \"position\"");  // the JSON reader's own check (nn/json.h)
  EXPECT_KILN_ERROR(LoaderState::from_json("{\"cursor\": 1}", "f"), "unknown loader state field");
  EXPECT_KILN_ERROR(
      LoaderState::from_json("{\"position\": 1, \"seed\": 1, \"seq_len\": 0, \"train_sequences\": "
                             "1, \"data_fingerprint\": \"0000000000000000\"}",
                             "f"),
      "seq_len and train_sequences must be positive");
  EXPECT_KILN_ERROR(LoaderState::from_json("[", "f"), "f: ");
}

TEST_F(LoaderTest, ShardSetErrors) {
  EXPECT_KILN_ERROR(ShardSet::open(file("nothing")), "nothing: no such file or directory");
  EXPECT_KILN_ERROR(ShardSet::open(dir().string()), "a directory without token shards");
  test::write_counting_shard(file("a.tokens"), 0, 100, 1000);
  test::write_counting_shard(file("b.tokens"), 0, 100, 2000);
  EXPECT_KILN_ERROR(ShardSet::open(dir().string()), "b.tokens was written by another tokenizer");
  {
    ShardWriter w(file("c.tokens"), {.vocab_size = 1000, .tokenizer_fingerprint = 77});
    w.append_document(std::vector<int64_t>{1, 2, 3});
    w.finish();
  }
  EXPECT_KILN_ERROR(ShardSet::open(file("a.tokens") + "," + file("c.tokens")),
                    "c.tokens was written by another tokenizer");
  const ShardSet one = ShardSet::open(file("a.tokens"));
  auto shared = std::make_shared<ShardSet>(one);
  EXPECT_KILN_ERROR(ShardLoader(shared, {.seq_len = 100}),
                    "no training sequence of seq_len + 1 = 101 tokens");
  EXPECT_KILN_ERROR(ShardLoader(shared, {.seq_len = 10, .rank = 2, .world_size = 2}),
                    "rank 2 is outside a world of 2");
}

}  // namespace
}  // namespace kiln::pretrain
