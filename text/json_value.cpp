#include "text/internal/json_value.h"

namespace kiln::text::internal {

JsonValue::JsonValue() = default;
JsonValue::JsonValue(const JsonValue&) = default;
JsonValue::JsonValue(JsonValue&&) noexcept = default;
JsonValue& JsonValue::operator=(const JsonValue&) = default;
JsonValue& JsonValue::operator=(JsonValue&&) noexcept = default;
JsonValue::~JsonValue() = default;

JsonValue JsonValue::read(nn::JsonReader& r, int depth) {
  if (depth >= nn::JsonReader::kMaxDepth) {
    r.fail("JSON nested deeper than " + std::to_string(nn::JsonReader::kMaxDepth));
  }
  JsonValue v;
  switch (r.peek_kind()) {
    case '{':
      v.kind = Kind::kObject;
      r.begin_object();
      while (auto key = r.next_key()) {
        JsonValue member = read(r, depth + 1);
        v.object.emplace_back(std::move(*key), std::move(member));
      }
      break;
    case '[':
      v.kind = Kind::kArray;
      r.begin_array();
      while (r.next_element()) v.array.push_back(read(r, depth + 1));
      break;
    case '"':
      v.kind = Kind::kString;
      v.string = r.read_string();
      break;
    case 'n':
      v.kind = Kind::kNumber;
      v.number = r.read_double("number");
      break;
    case 't':
    case 'f':
      v.kind = Kind::kBool;
      v.boolean = r.read_bool("value");
      break;
    default:
      r.read_null();
      break;
  }
  return v;
}

const JsonValue* JsonValue::find(std::string_view key) const {
  for (const auto& [k, v] : object) {
    if (k == key) return &v;
  }
  return nullptr;
}

}  // namespace kiln::text::internal
