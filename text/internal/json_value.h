// kiln::text::internal::JsonValue: a small document tree over nn::JsonReader, for the parts of
// a tokenizer.json whose keys come in any order (normalizers, pre-tokenizers, decoders,
// post-processors, added tokens). The model's vocabulary and merges, which hold nearly all of
// the file, are read straight from the JsonReader instead (text/tokenizer_json.cpp).
//
//   nn::JsonReader r(text);
//   JsonValue v = JsonValue::read(r);
//   if (const JsonValue* t = v.find("type"); t && t->is_string()) ...
#pragma once

#include <cstdint>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "nn/json.h"

namespace kiln::text::internal {

struct JsonValue {
  enum class Kind { kNull, kBool, kNumber, kString, kArray, kObject };
  Kind kind = Kind::kNull;
  bool boolean = false;
  double number = 0;
  std::string string;
  std::vector<JsonValue> array;
  std::vector<std::pair<std::string, JsonValue>> object;  // in document order

  // Defined in json_value.cpp, where JsonValue is complete: clang with libstdc++ 12 rejects the
  // implicit ones, which it checks while `object`'s pair still holds an incomplete JsonValue.
  JsonValue();
  JsonValue(const JsonValue&);
  JsonValue(JsonValue&&) noexcept;
  JsonValue& operator=(const JsonValue&);
  JsonValue& operator=(JsonValue&&) noexcept;
  ~JsonValue();

  // Reads one value (of any kind, nested at most JsonReader::kMaxDepth deep).
  static JsonValue read(nn::JsonReader& r, int depth = 0);

  bool is_null() const { return kind == Kind::kNull; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_object() const { return kind == Kind::kObject; }
  bool is_array() const { return kind == Kind::kArray; }
  // The member named `key` of an object, or nullptr (also for non-objects).
  const JsonValue* find(std::string_view key) const;
};

}  // namespace kiln::text::internal
