#include "engine/methods/method_unit.h"

#include "absl/strings/str_cat.h"

namespace kvsparse::engine {

absl::Status CheckCompressedKeys(const char* method, const SequenceDesc& desc, uint32_t min_bits,
                                 const char* alternative, const char* why) {
  const uint32_t bits = desc.placement.compressed_key_bits;
  if (bits == 0) {
    return absl::FailedPreconditionError(
        absl::StrCat(method,
                     " needs compressed keys: create the sequence with "
                     "placement.compressed_key_bits",
                     alternative != nullptr ? absl::StrCat(" (or ", alternative, ")") : ""));
  }
  if (bits < min_bits) {
    return absl::FailedPreconditionError(absl::StrCat(
        method, " is not served over ", bits, "-bit keys (sequence '", desc.sequence_id,
        "'): ", why, "; create the sequence with placement.compressed_key_bits >= ", min_bits,
        ", or use top_k over these keys"));
  }
  return absl::OkStatus();
}

absl::Status CheckSignatures(const Method& m, int32_t bits, const char* method,
                             const SequenceDesc& desc, const SignatureMaker& signatures) {
  const uint32_t sig_bits = desc.placement.signature_bits;
  if (sig_bits == 0) {
    return absl::FailedPreconditionError(absl::StrCat(
        method, " needs key signatures: create the sequence with placement.signature_bits"));
  }
  if (bits != 0 && static_cast<uint32_t>(bits) != sig_bits) {
    return absl::InvalidArgumentError(absl::StrCat(
        method, ": bits ", bits, " but the sequence keeps ", sig_bits, "-bit signatures"));
  }
  if (signatures.saap()) {
    return absl::FailedPreconditionError(
        absl::StrCat(method,
                     ": this server keeps SAAP buckets as key signatures (--saap_weights), not bit "
                     "signatures"));
  }
  if (m.learned_signatures != signatures.learned()) {
    return absl::FailedPreconditionError(
        absl::StrCat(method, ": this server keeps ", signatures.learned() ? "learned" : "SimHash",
                     " signatures (--hash_weights), the request asked for ",
                     m.learned_signatures ? "learned" : "SimHash"));
  }
  if (const kernels::LearnedHashWeights* learned = signatures.config().learned.get();
      learned != nullptr) {
    const kvstore::ModelShape& s = desc.shape;
    if (learned->num_layers < static_cast<int32_t>(s.num_layers) ||
        learned->num_q_heads != static_cast<int32_t>(s.num_q_heads) ||
        learned->head_dim() != static_cast<int32_t>(s.head_dim) ||
        learned->bits() != static_cast<int32_t>(sig_bits) ||
        (learned->num_key_mlps != static_cast<int32_t>(s.num_kv_heads) &&
         learned->num_key_mlps != static_cast<int32_t>(s.num_q_heads))) {
      return absl::FailedPreconditionError(
          "the server's learned hash weights do not fit this sequence's shape or bits");
    }
  }
  return absl::OkStatus();
}

}  // namespace kvsparse::engine
