// nn/json.h: the pull parser reads what its writers write, skips what the caller does not want,
// and rejects malformed documents with the byte offset. (Hostile safetensors headers, which go
// through the same reader, are in safetensors_test.cpp.)
#include "nn/json.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <string>
#include <vector>

namespace kiln::nn {
namespace {

TEST(JsonTest, ReadsTheShapeTheCallerExpects) {
  JsonReader r(R"( {"n": 3, "name": "tiny", "skip": {"a": [1, 2.5, null, true]},
                    "dims": [4, -5], "lr": 1e-3, "on": false} )");
  uint64_t n = 0;
  std::string name;
  std::vector<int64_t> dims;
  double lr = 0;
  bool on = true;
  r.begin_object();
  while (auto key = r.next_key()) {
    if (*key == "n") {
      n = r.read_uint64("n");
    } else if (*key == "name") {
      name = r.read_string();
    } else if (*key == "dims") {
      r.begin_array();
      while (r.next_element()) dims.push_back(r.read_int64("dim"));
    } else if (*key == "lr") {
      lr = r.read_double("lr");
    } else if (*key == "on") {
      on = r.read_bool("on");
    } else {
      r.skip_value();
    }
  }
  r.end_document();
  EXPECT_EQ(n, 3u);
  EXPECT_EQ(name, "tiny");
  EXPECT_EQ(dims, (std::vector<int64_t>{4, -5}));
  EXPECT_DOUBLE_EQ(lr, 1e-3);
  EXPECT_FALSE(on);
}

TEST(JsonTest, StringsRoundTripThroughTheWriter) {
  const std::string s = "quote \" backslash \\ tab \t newline \n bell \x07 caf\xc3\xa9";
  const std::string literal = json_string(s);
  EXPECT_EQ(literal.front(), '"');
  JsonReader r(literal);
  EXPECT_EQ(r.read_string(), s);
  r.end_document();
  EXPECT_TRUE(is_valid_utf8(s));
  EXPECT_FALSE(is_valid_utf8("\xc0\xaf"));  // an overlong '/'
}

TEST(JsonTest, ErrorsNameWhatAndWhere) {
  auto message = [](const std::string& text) -> std::string {
    try {
      JsonReader r(text);
      r.begin_object();
      while (auto key = r.next_key()) (void)r.read_uint64(*key);
      r.end_document();
    } catch (const JsonError& e) {
      return e.what();
    }
    return "";
  };
  EXPECT_NE(message(R"({"n": -1})").find("n is negative"), std::string::npos);
  EXPECT_NE(message(R"({"n": 1.5})").find("n is not an integer"), std::string::npos);
  EXPECT_NE(message(R"({"n": 1} x)").find("at byte"), std::string::npos);
  EXPECT_NE(message(R"({"n": 1)"), "");
  const std::string deep = std::string(JsonReader::kMaxDepth + 1, '[') + "]";
  JsonReader r(deep);
  EXPECT_THROW(r.skip_value(), JsonError);
}

// RFC 8259 lets readers keep the first or the last of two equal keys: kiln rejects the document,
// in the caller's objects and in skipped ones, at every depth; equal keys in sibling objects
// are fine.
TEST(JsonTest, DuplicateKeysAreErrors) {
  auto read_all = [](const std::string& text) {
    JsonReader r(text);
    r.begin_object();
    while (auto key = r.next_key()) r.skip_value();
    r.end_document();
  };
  EXPECT_NO_THROW(read_all(R"({"a": {"x": 1}, "b": {"x": 2}, "c": [{"x": 1}, {"x": 2}]})"));
  for (const std::string bad : {R"({"step": 1, "step": 2})", R"({"a": {"x": 1, "x": 1}})",
                                R"({"a": [{"y": 1, "y": 2}]})", R"({"k\u0065y": 1, "key": 2})"}) {
    try {
      read_all(bad);
      ADD_FAILURE() << "accepted " << bad;
    } catch (const JsonError& e) {
      EXPECT_NE(std::string(e.what()).find("duplicate key"), std::string::npos) << e.what();
    }
  }
  // The caller's own loop sees the same error.
  JsonReader r(R"({"n": 1, "n": 2})");
  r.begin_object();
  ASSERT_EQ(r.next_key(), "n");
  EXPECT_EQ(r.read_uint64("n"), 1u);
  try {
    r.next_key();
    ADD_FAILURE() << "second \"n\" accepted";
  } catch (const JsonError& e) {
    EXPECT_NE(std::string(e.what()).find("duplicate key \"n\""), std::string::npos) << e.what();
  }
}

}  // namespace
}  // namespace kiln::nn
