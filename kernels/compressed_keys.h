// Compressed keys: every key of a (sequence, kv head) kept on the decode worker's device in a
// few bits, so that the scores of every token can be approximated in one pass without the
// full-precision K (which stays in the store with V).
//
// Format (per-channel asymmetric quantization over groups of tokens, as KIVI quantizes keys):
//   tokens are grouped by index, group g = tokens [g * group, (g + 1) * group);
//   for a *closed* group (all `group` tokens present) and channel c:
//     lo[g][c]   = fp16(min_t k[t][c])                       (rounded to nearest)
//     step[g][c] = fp16 rounded up of (max_t k[t][c] - lo[g][c]) / (2^bits - 1)
//     code[t][c] = clamp(round((k[t][c] - lo[g][c]) / step[g][c]), 0, 2^bits - 1)  (0 if step 0)
//     k~[t][c]   = lo[g][c] + step[g][c] * code[t][c]       (fp32 arithmetic)
//     err[t]     = |k_t - k~_t|_2 as fp16 rounded up (+inf past fp16's range), so that
//                  |q.k - q.k~| <= |q| err holds for the stored value: the bound vAttention's
//                  budget can rely on
//   codes are packed little-end first into 32-bit words: channel c of token t at bit
//   (c * bits) % 32 of word (c * bits) / 32 of the token's d * bits / 32 words;
//   the tokens of the still-filling last group are kept exactly (the sequence's dtype) until
//   the group closes, then quantized as above (a group's quantization never changes after).
// Storage: one block per closed group (a page: appends never move a closed group), laid out
//   codes [group, d * bits / 32] u32 | lo [d] fp16 | step [d] fp16 | err [group] fp16,
// and the open group's exact rows, held in steps of 16 rows.
// bits is 1, 2, 4 or 8 and d * bits a multiple of 32. Bytes per token, amortised over a group:
//   d * bits / 8 (codes) + 4 d / group (lo and step, fp16) + 2 (err), plus the open group's
//   exact rows (fewer than group, rounded up to 16) per (sequence, kv head): at d = 128,
//   bits = 2, group = 128 that is 38 bytes per token, 7.4% of the 512 bytes of its bf16 K and V
//   rows (1 bit: 22 bytes, 4.3%).
#ifndef KVSPARSE_KERNELS_COMPRESSED_KEYS_H_
#define KVSPARSE_KERNELS_COMPRESSED_KEYS_H_

#include <cstddef>
#include <cstdint>
#include <memory>
#include <vector>

#include "absl/status/status.h"
#include "kernels/dtype.h"
#include "kernels/key_widths.h"

namespace kvsparse::kernels {

// Where a method's selection takes its scores from (top-k, S2ANTA): exact q . K over every
// full-precision key, or q . k~ over the compressed keys below.
enum class ScoreSource : uint8_t { kExact = 0, kCompressedKeys = 1 };

struct KeyCompression {
  int32_t bits = 2;            // per channel: 1, 2, 4 or 8
  int32_t group_tokens = 128;  // tokens sharing one lo / step per channel
  // Optional: the model channel each stored channel holds (kernels/key_widths.h: channels at
  // different widths in the same bytes); null: stored channel c is model channel c. Not owned:
  // it outlives every CompressedKeys made with it.
  const KeyChannelMap* map = nullptr;
};

// The group size every placement uses (one place: the wire carries bits only).
inline constexpr int32_t kKeyGroupTokens = 128;

// INVALID_ARGUMENT naming the field when bits is not 1, 2, 4 or 8, d * bits is not a multiple
// of 32, the group is not positive, or a map is not one of d channels (or comes with 8 bits).
[[nodiscard]] absl::Status ValidateKeyCompression(const KeyCompression& c, int32_t head_dim);

// Bytes of one closed group's block.
size_t KeyGroupBytes(const KeyCompression& c, int32_t head_dim);

// Bytes CompressedKeys holds for `tokens` tokens of one (sequence, kv head): the closed groups'
// blocks and the open group's exact rows (`row_bytes` each, in steps of 16 rows).
size_t CompressedKeyBytes(const KeyCompression& c, int32_t head_dim, size_t row_bytes,
                          uint64_t tokens);

// Quantizes one closed group: `rows` holds its c.group_tokens keys ([group, head_dim] of the
// dtype), `block` receives KeyGroupBytes(c, head_dim) bytes in the layout above (with a map, of
// its stored channels: kernels/key_widths.h; err over the model's channels). What
// CompressedKeys does as a group fills; a holder that keeps the blocks elsewhere (the GPU
// worker's device) calls it directly, so both hold the same bits.
void CompressKeyGroup(const KeyCompression& c, int32_t head_dim, DType dtype, const void* rows,
                      uint8_t* block);

// A read-only view of one (sequence, kv head)'s compressed keys.
struct CompressedKeysView {
  int32_t bits = 0;
  int32_t group = 0;
  int32_t head_dim = 0;
  DType dtype = DType::kBf16;              // of the exact tail rows
  int64_t length = 0;                      // tokens held
  int64_t closed = 0;                      // tokens [0, closed) quantized (a multiple of group)
  const uint8_t* const* groups = nullptr;  // [closed / group] blocks (layout above)
  const uint8_t* tail = nullptr;  // exact rows of tokens [closed, length): [length - closed, d]
  const KeyChannelMap* map = nullptr;  // KeyCompression::map (null: the identity)

  int32_t words() const { return head_dim * bits / 32; }
  // Group g's parts. REQUIRES: g < closed / group.
  const uint32_t* codes(int64_t g) const { return reinterpret_cast<const uint32_t*>(groups[g]); }
  const uint16_t* lo(int64_t g) const {
    return reinterpret_cast<const uint16_t*>(groups[g] + static_cast<size_t>(group) * words() * 4);
  }
  const uint16_t* step(int64_t g) const { return lo(g) + head_dim; }
  const uint16_t* err(int64_t g) const { return lo(g) + 2 * head_dim; }
  // Bytes a pass over every token's compressed key reads (codes, scales, errors, tail rows).
  size_t bytes_read() const;
};

// The compressed keys of one (sequence, kv head), appended token by token. Thread-compatible.
class CompressedKeys {
 public:
  // REQUIRES: ValidateKeyCompression(c, head_dim).ok().
  CompressedKeys(KeyCompression c, int32_t head_dim, DType dtype);

  CompressedKeys(CompressedKeys&&) = default;
  CompressedKeys& operator=(CompressedKeys&&) = default;

  // Appends one token's key (head_dim elements of the dtype); closes and quantizes the group
  // when it fills.
  void Append(const void* row);
  CompressedKeysView view() const;
  int64_t length() const { return length_; }
  // Bytes held: CompressedKeyBytes(length()), what the holder accounts for.
  size_t bytes() const;
  // bytes() after `tokens` more appends (a holder reserves them first).
  size_t bytes_after(uint64_t tokens) const;

 private:
  void CloseGroup();

  KeyCompression c_;
  int32_t d_;
  DType dtype_;
  size_t row_bytes_;
  int32_t words_;
  int64_t length_ = 0, closed_ = 0;
  std::vector<std::unique_ptr<uint8_t[]>> blocks_;  // one per closed group
  std::vector<const uint8_t*> block_ptrs_;          // the view's table of them
  std::vector<uint8_t> tail_;  // exact rows of the open group, capacity in steps of 16 rows
};

// The stored error norm of token t: |q.k_t - q.k~_t| <= |q| times it. For the exact tail 0, or
// with a map that leaves channels out the norm of the tail row's left-out channels (fp16
// rounded up, as stored ones are).
float KeyErrorBound(const CompressedKeysView& v, int64_t t);

// The dequantized key k~_t (t < closed; a left-out channel 0) or the exact key (t >= closed),
// head_dim floats.
void DecompressKey(const CompressedKeysView& v, int64_t t, float* out);

// scale * q . k~_t for every token t < v.length (the tail's exact rows over the channels the
// map keeps: every channel without one), fp32: out [v.length]. q: head_dim floats. With a map
// the stored channels are scored against q through it (q'_v = q[channel[v]]).
void ApproximateScores(const CompressedKeysView& v, const float* q, float scale, float* out);

// The smallest float >= x: a bound computed in double, kept a bound as a float.
float FloatAtLeast(double x);

// Upper bounds of the exact logits from the compressed keys' scores: upper[t] >= scale q . k_t
// (and >= that logit as computed in float) for every token t < v.length, where approx[t] =
// ApproximateScores(v, q, scale)[t]: s~_t + scale |q| err_t (the stored error norm) + the float
// rounding of s~_t, at most (d + 2) 2^-24 scale sum_c |q_c| |k~_c| with |k~_c| <= max(|lo_c|,
// |lo_c + levels step_c|) over the token's group, doubled for safety; the open group's rows are
// exact (err 0: only the rounding of their computed logit). +inf where err_t is.
void UpperScores(const CompressedKeysView& v, const float* q, float scale, const float* approx,
                 double* upper);

// log sum of e^{upper[t]} over the tokens t < n not in `kept` (ascending, distinct); -inf when
// every token is kept, +inf when an upper score is.
double LogSumExpOutside(const double* upper, int64_t n, const std::vector<int32_t>& kept);

// A certified upper bound on the share of the softmax's mass a selection leaves out, from the
// log-sum-exp of the exact logits it kept (log_kept) and of upper bounds of the logits it left
// out (log_out, LogSumExpOutside): out / (kept + out) is increasing in out, so e^{log_out}
// / (e^{log_kept} + e^{log_out}) bounds the true share. Rounded up to a float: 0 when nothing
// was left out (log_out = -inf), 1 when an upper score is infinite.
float MissedMassBound(double log_kept, double log_out);

}  // namespace kvsparse::kernels

#endif  // KVSPARSE_KERNELS_COMPRESSED_KEYS_H_
