// The spellings of an enum's values, one table per enum (e.g. net::kCodecNames),
// read both ways: the config reader and writer, the command-line parsers, error
// messages and the reference tables all use the same table, so a value is spelled
// once.
#pragma once
#include <cstddef>
#include <optional>
#include <string>
#include <string_view>

namespace spes {

template <class E>
struct EnumName {
  E value;
  const char* name;
};

template <class E, size_t N>
std::optional<E> enum_from_name(const EnumName<E> (&names)[N], std::string_view name) {
  for (const EnumName<E>& n : names)
    if (name == n.name) return n.value;
  return std::nullopt;
}

template <class E, size_t N>
const char* name_of(const EnumName<E> (&names)[N], E value) {
  for (const EnumName<E>& n : names)
    if (n.value == value) return n.name;
  return "?";
}

// The names in table order, each between `quote`s, joined by `sep`, the last by
// `last_sep`: ("\"", " ", " ") gives "a" "b" "c"; ("", ", ", " or ") gives a, b or c.
template <class E, size_t N>
std::string join_names(const EnumName<E> (&names)[N], std::string_view quote, std::string_view sep,
                       std::string_view last_sep) {
  std::string out;
  for (size_t i = 0; i < N; ++i) {
    if (i > 0) out += i + 1 == N ? last_sep : sep;
    out += quote;
    out += names[i].name;
    out += quote;
  }
  return out;
}

}  // namespace spes
