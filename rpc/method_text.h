// A decode method's text form, and the placement it reads. The text form is `name` or
// `name:field=value,field=value` (attention.proto, "A method's text form"): the CLI's --method, and
// the same text kvsparse.parse_method reads in Python. Read by reflection over kvsparse.v1.Method:
// `name` is a field of its oneof, each field a field of that message, each enum value its text_word
// option, and every field the text leaves out its text_default option. The proto is the one home of
// the fields, their words and their defaults; nothing here restates them.
#ifndef KVSPARSE_RPC_METHOD_TEXT_H_
#define KVSPARSE_RPC_METHOD_TEXT_H_

#include <cstdint>
#include <string>
#include <vector>

#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "kvsparse/v1/attention.pb.h"
#include "kvsparse/v1/tensor.pb.h"

namespace kvsparse::rpc {

// The method `text` names, every field set (the given values, else the defaults).
// INVALID_ARGUMENT listing every problem at once: an unknown name (with the names), unknown
// fields (with the method's fields), values that do not parse as their field's type or are not
// one of its words (with the words), a field given twice.
absl::StatusOr<v1::Method> MethodFromText(absl::string_view text);

// The text form of `m`: its name and the fields whose values differ from their defaults, so
// that MethodFromText(MethodText(m)) equals m with its unset fields at their defaults. A Method
// with no kind set is "dense".
std::string MethodText(const v1::Method& m);

// Every enum-valued parameter of m left UNSPECIFIED (0) set to its text_default: how the server
// reads a request built field by field (rpc/convert.cc), so that an enum's default has one home
// for the text form and the wire alike. Fields of other types keep their values (0 is a value
// there, read as each field's comment says).
void FillUnsetWords(v1::Method* m);

// The placement a sequence needs for method `m` (attention.proto's method_reads and value_reads,
// after FillUnsetWords): K on the device tier, key signatures (the method's bits, else
// `signature_bits`), SAAP's 32-bit buckets, or compressed keys of `compressed_key_bits`; the
// rest at its default (K and V in host memory).
v1::Placement PlacementFor(const v1::Method& m, uint32_t signature_bits = 32,
                           uint32_t compressed_key_bits = 2);

// The methods' names (Method's oneof fields), in field order.
std::vector<std::string> MethodNames();

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_METHOD_TEXT_H_
