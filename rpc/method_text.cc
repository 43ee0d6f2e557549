#include "rpc/method_text.h"

#include <cmath>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/ascii.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_format.h"
#include "absl/strings/str_join.h"
#include "absl/strings/str_split.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/message.h"

namespace kvsparse::rpc {
namespace {

namespace pb = google::protobuf;

const pb::OneofDescriptor& Kinds() { return *v1::Method::descriptor()->FindOneofByName("kind"); }

const std::string& Word(const pb::EnumValueDescriptor& v) {
  return v.options().GetExtension(v1::text_word);
}

std::vector<std::string> Words(const pb::EnumDescriptor& e) {
  std::vector<std::string> out;
  for (int i = 0; i < e.value_count(); ++i) {
    if (!Word(*e.value(i)).empty()) out.push_back(Word(*e.value(i)));
  }
  return out;
}

std::vector<std::string> FieldNames(const pb::Descriptor& d) {
  std::vector<std::string> out;
  for (int i = 0; i < d.field_count(); ++i) out.push_back(d.field(i)->name());
  return out;
}

template <typename T>
bool ParseNumber(absl::string_view text, T* out) {
  if constexpr (std::is_same_v<T, float>) {
    return absl::SimpleAtof(text, out) && std::isfinite(*out);
  } else if constexpr (std::is_same_v<T, double>) {
    return absl::SimpleAtod(text, out) && std::isfinite(*out);
  } else {
    return absl::SimpleAtoi(text, out);
  }
}

absl::Status Bad(const pb::FieldDescriptor& f, absl::string_view text, absl::string_view what) {
  return absl::InvalidArgumentError(absl::StrCat(f.name(), "='", text, "' is not ", what));
}

// A number field of `msg` from its text, through Reflection's setter of its type.
template <typename T>
absl::Status SetNumber(pb::Message& msg, const pb::FieldDescriptor& f, absl::string_view text,
                       absl::string_view what,
                       void (pb::Reflection::*set)(pb::Message*, const pb::FieldDescriptor*, T)
                           const) {
  T v{};
  if (!ParseNumber(text, &v)) return Bad(f, text, what);
  (msg.GetReflection()->*set)(&msg, &f, v);
  return absl::OkStatus();
}

// Field f of `msg` from its text; the reason (naming the field) where the text does not parse.
absl::Status SetField(pb::Message& msg, const pb::FieldDescriptor& f, absl::string_view text) {
  const pb::Reflection& r = *msg.GetReflection();
  switch (f.cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return SetNumber<uint32_t>(msg, f, text, "an unsigned integer", &pb::Reflection::SetUInt32);
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return SetNumber<int32_t>(msg, f, text, "an integer", &pb::Reflection::SetInt32);
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return SetNumber<float>(msg, f, text, "a finite number", &pb::Reflection::SetFloat);
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return SetNumber<double>(msg, f, text, "a finite number", &pb::Reflection::SetDouble);
    case pb::FieldDescriptor::CPPTYPE_BOOL: {
      const std::string t = absl::AsciiStrToLower(text);
      if (t != "true" && t != "false" && t != "1" && t != "0") {
        return Bad(f, text, "true, false, 1 or 0");
      }
      r.SetBool(&msg, &f, t == "true" || t == "1");
      return absl::OkStatus();
    }
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      const pb::EnumDescriptor& e = *f.enum_type();
      for (int i = 0; i < e.value_count(); ++i) {
        if (!Word(*e.value(i)).empty() && Word(*e.value(i)) == text) {
          r.SetEnum(&msg, &f, e.value(i));
          return absl::OkStatus();
        }
      }
      return Bad(f, text, absl::StrCat("one of ", absl::StrJoin(Words(e), ", ")));
    }
    default:
      return Bad(f, text, "a value the text form sets");
  }
}

// The fewest significant digits that read back as `v` (0.01, not 0.00999999978: what a person
// wrote; 9 digits always do).
std::string ShortestFloat(float v) {
  for (int digits = 1; digits < 9; ++digits) {
    const std::string s = absl::StrFormat("%.*g", digits, v);
    float back = 0;
    if (absl::SimpleAtof(s, &back) && back == v) return s;
  }
  return absl::StrFormat("%.9g", v);
}

// The value of field f of `msg` as the text form writes it ("" for an enum value without a
// word: UNSPECIFIED, which each field's comment reads as its default).
std::string FieldText(const pb::Message& msg, const pb::FieldDescriptor& f) {
  const pb::Reflection& r = *msg.GetReflection();
  switch (f.cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return absl::StrCat(r.GetUInt32(msg, &f));
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return absl::StrCat(r.GetInt32(msg, &f));
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return ShortestFloat(r.GetFloat(msg, &f));
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return absl::StrFormat("%.17g", r.GetDouble(msg, &f));
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return r.GetBool(msg, &f) ? "true" : "false";
    case pb::FieldDescriptor::CPPTYPE_ENUM:
      return Word(*r.GetEnum(msg, &f));
    default:
      return "";
  }
}

const pb::FieldDescriptor* KindNamed(absl::string_view name) {
  for (int i = 0; i < Kinds().field_count(); ++i) {
    if (Kinds().field(i)->name() == name) return Kinds().field(i);
  }
  return nullptr;
}

}  // namespace

std::vector<std::string> MethodNames() {
  std::vector<std::string> out;
  for (int i = 0; i < Kinds().field_count(); ++i) out.push_back(Kinds().field(i)->name());
  return out;
}

absl::StatusOr<v1::Method> MethodFromText(absl::string_view text) {
  const absl::string_view t = absl::StripAsciiWhitespace(text);
  const size_t colon = t.find(':');
  const std::string name(absl::StripAsciiWhitespace(t.substr(0, colon)));
  const pb::FieldDescriptor* kind = KindNamed(name);
  if (kind == nullptr) {
    return absl::InvalidArgumentError(
        absl::StrCat("unknown method '", name, "': one of ", absl::StrJoin(MethodNames(), ", ")));
  }
  v1::Method m;
  pb::Message& params = *m.GetReflection()->MutableMessage(&m, kind);
  const pb::Descriptor& d = *kind->message_type();
  std::vector<std::string> problems;
  for (int i = 0; i < d.field_count(); ++i) {
    const std::string& fallback = d.field(i)->options().GetExtension(v1::text_default);
    if (fallback.empty()) continue;
    if (absl::Status s = SetField(params, *d.field(i), fallback); !s.ok()) {
      problems.push_back(absl::StrCat("the proto's text_default: ", s.message()));
    }
  }
  std::set<std::string> seen;
  const absl::string_view rest = colon == absl::string_view::npos ? "" : t.substr(colon + 1);
  for (absl::string_view part : absl::StrSplit(rest, ',', absl::SkipWhitespace())) {
    part = absl::StripAsciiWhitespace(part);
    const size_t eq = part.find('=');
    const std::string key(absl::StripAsciiWhitespace(part.substr(0, eq)));
    const pb::FieldDescriptor* f = eq == absl::string_view::npos ? nullptr : d.FindFieldByName(key);
    if (f == nullptr) {
      problems.push_back(
          absl::StrCat("'", part, "' is not field=value of ", absl::StrJoin(FieldNames(d), ", ")));
    } else if (!seen.insert(key).second) {
      problems.push_back(absl::StrCat(key, " is given twice"));
    } else if (absl::Status s =
                   SetField(params, *f, absl::StripAsciiWhitespace(part.substr(eq + 1)));
               !s.ok()) {
      problems.push_back(std::string(s.message()));
    }
  }
  if (!problems.empty()) {
    return absl::InvalidArgumentError(absl::StrCat(name, ": ", absl::StrJoin(problems, "; ")));
  }
  return m;
}

// Each enum-valued parameter of every method and the number of its text_default's word, found
// once (FillUnsetWords runs on every Decode call the server and the op take).
const std::map<const pb::FieldDescriptor*, int>& EnumDefaults() {
  static const auto* defaults = [] {
    auto* out = new std::map<const pb::FieldDescriptor*, int>();
    for (int k = 0; k < Kinds().field_count(); ++k) {
      const pb::Descriptor& d = *Kinds().field(k)->message_type();
      for (int i = 0; i < d.field_count(); ++i) {
        const pb::FieldDescriptor& f = *d.field(i);
        if (f.enum_type() == nullptr) continue;
        const std::string& word = f.options().GetExtension(v1::text_default);
        for (int j = 0; j < f.enum_type()->value_count(); ++j) {
          if (!word.empty() && Word(*f.enum_type()->value(j)) == word) {
            (*out)[&f] = f.enum_type()->value(j)->number();
          }
        }
      }
    }
    return out;
  }();
  return *defaults;
}

void FillUnsetWords(v1::Method* m) {
  const pb::Reflection& r = *m->GetReflection();
  const pb::FieldDescriptor* kind = r.GetOneofFieldDescriptor(*m, &Kinds());
  if (kind == nullptr) return;
  pb::Message& params = *r.MutableMessage(m, kind);
  const pb::Descriptor& d = *kind->message_type();
  for (int i = 0; i < d.field_count(); ++i) {
    const pb::FieldDescriptor& f = *d.field(i);
    const auto fallback = EnumDefaults().find(&f);
    if (fallback != EnumDefaults().end() && params.GetReflection()->GetEnumValue(params, &f) == 0) {
      params.GetReflection()->SetEnumValue(&params, &f, fallback->second);
    }
  }
}

v1::Placement PlacementFor(const v1::Method& wire, uint32_t signature_bits,
                           uint32_t compressed_key_bits) {
  v1::Method m = wire;
  FillUnsetWords(&m);
  v1::Placement out;
  const pb::Reflection& r = *m.GetReflection();
  const pb::FieldDescriptor* kind = r.GetOneofFieldDescriptor(m, &Kinds());
  if (kind == nullptr) return out;  // dense
  const pb::Message& params = r.GetMessage(m, kind);
  const pb::Descriptor& d = *kind->message_type();
  std::string reads = d.options().GetExtension(v1::method_reads);
  for (int i = 0; i < d.field_count(); ++i) {
    const pb::FieldDescriptor& f = *d.field(i);
    if (f.cpp_type() != pb::FieldDescriptor::CPPTYPE_ENUM) continue;
    const std::string& value =
        params.GetReflection()->GetEnum(params, &f)->options().GetExtension(v1::value_reads);
    if (!value.empty()) reads = value;
  }
  if (reads == "keys_on_device") {
    out.set_k_tier(v1::TIER_DEVICE);
  } else if (reads == "signatures") {
    const pb::FieldDescriptor* bits = d.FindFieldByName("bits");
    const uint32_t own = bits == nullptr ? 0 : params.GetReflection()->GetUInt32(params, bits);
    out.set_signature_bits(own > 0 ? own : signature_bits);
  } else if (reads == "signatures_32") {
    out.set_signature_bits(32);
  } else if (reads == "compressed_keys") {
    out.set_compressed_key_bits(compressed_key_bits);
  }
  return out;
}

std::string MethodText(const v1::Method& m) {
  const pb::Reflection& r = *m.GetReflection();
  const pb::FieldDescriptor* kind = r.GetOneofFieldDescriptor(m, &Kinds());
  if (kind == nullptr) return "dense";
  const absl::StatusOr<v1::Method> defaults = MethodFromText(kind->name());
  if (!defaults.ok()) return kind->name();  // the proto's own defaults do not parse: tested
  const pb::Message& params = r.GetMessage(m, kind);
  const pb::Message& fallback = defaults->GetReflection()->GetMessage(*defaults, kind);
  std::vector<std::string> parts;
  const pb::Descriptor& d = *kind->message_type();
  for (int i = 0; i < d.field_count(); ++i) {
    const std::string value = FieldText(params, *d.field(i));
    if (!value.empty() && value != FieldText(fallback, *d.field(i))) {
      parts.push_back(absl::StrCat(d.field(i)->name(), "=", value));
    }
  }
  return parts.empty() ? kind->name() : absl::StrCat(kind->name(), ":", absl::StrJoin(parts, ","));
}

}  // namespace kvsparse::rpc
