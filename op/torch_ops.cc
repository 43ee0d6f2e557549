// torch.ops.kvsparse: the decode engine in the caller's process, over torch tensors (SALE's
// prefill ops: op/sale_ops.cc). On a CUDA
// device the engine reads q from, and writes the output to, the caller's CUDA tensors, ordered on
// the caller's current stream (q and the output never pass through host memory). The store is
// the process's pinned host arena (engine/embedded.h), or a kvsparse-server store in another
// process (engine_create's store_target: sequences through the C++ client, rows through the
// store's Gather RPC, which the GPU backend stages for the kernels). Python's kvsparse.torch.ops
// wraps these ops (and registers their fake implementations for torch.compile).
//
// Engines are named by an integer handle (kvsparse::engine_create), sequences by their ids.
// Failures raise RuntimeError("kvsparse <CODE>: <message>"), which kvsparse.torch.ops turns into
// the kvsparse exception of that code.
#include <ATen/ATen.h>
#include <torch/library.h>
#if __has_include(<ATen/cuda/CUDAContext.h>)
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#define KVSPARSE_TORCH_CUDA 1
#endif

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <vector>

#include "absl/status/status.h"
#include "absl/strings/match.h"
#include "absl/strings/str_cat.h"
#include "engine/embedded.h"
#include "engine/engine_settings.h"
#include "engine/gpu_mode.h"
#include "engine/gpu_shape.h"
#include "engine/signatures.h"
#include "kernels/dtype.h"
#include "kernels/hash_signatures.h"
#include "kernels/saap.h"
#include "op/op_engine.h"
#include "op/torch_args.h"

namespace kvsparse::torch_ops {
namespace {

namespace en = kvsparse::engine;
namespace kv = kvsparse::kvstore;
using kernels::DType;

// ---- Arguments (errors: op/torch_args.h) ----------------------------------------------------

DType DTypeNamed(const std::string& name) {
  DType d;
  if (!kernels::DTypeFromName(name.c_str(), &d)) {
    Invalid("dtype must be bf16, fp16 or fp32, got " + name);
  }
  return d;
}

kv::Tier TierNamed(const std::string& name) {
  if (name == "host") return kv::Tier::kHost;
  if (name == "device") return kv::Tier::kDevice;
  Invalid("tier must be host or device, got " + name);
}

// The engine's method from the op's `method` string: a serialized kvsparse.v1.Method in base64,
// decoded and defaulted by the same codec as the server's (rpc::FromProto, op_engine.h).
en::Method MethodOf(const std::string& wire) {
  absl::StatusOr<en::Method> m = MethodFromWire(wire);
  if (!m.ok()) Raise(m.status());
  return *std::move(m);
}

// ---- Engines --------------------------------------------------------------------------------

std::mutex engines_mu;
std::map<int64_t, std::shared_ptr<OpEngine>> engines;  // guarded by engines_mu
int64_t next_engine = 1;                               // guarded by engines_mu

std::shared_ptr<OpEngine> Find(int64_t handle) {
  std::lock_guard<std::mutex> lock(engines_mu);
  auto it = engines.find(handle);
  if (it == engines.end()) {
    Raise(absl::NotFoundError(absl::StrCat("no kvsparse engine ", handle, " (destroyed?)")));
  }
  return it->second;
}

// store_target empty: the store in this process (store_capacity, capacity_policy and huge_pages
// are its); otherwise the kvsparse-server store at that address, over TLS when store_tls_ca is
// given (store_tls_cert + store_tls_key: this side's certificate) and with store_token as the
// bearer token when given. gpu_capacity and resident_capacity 0, gpu_row_cache NaN: the
// engine's defaults (engine::EngineSettings, as kvsparse-server's flags).
int64_t EngineCreate(const std::string& gpu, int64_t device, int64_t store_capacity,
                     const std::string& capacity_policy, int64_t gpu_capacity, double gpu_row_cache,
                     int64_t resident_capacity, bool huge_pages, const std::string& store_target,
                     const std::string& hash_weights, const std::string& saap_weights,
                     const std::string& store_tls_ca, const std::string& store_tls_cert,
                     const std::string& store_tls_key, const std::string& store_token,
                     const std::string& key_widths) {
  en::EmbeddedOptions o;
  if (store_capacity <= 0 || gpu_capacity < 0 || resident_capacity < 0 || device < 0) {
    Invalid(
        "store_capacity must be positive, gpu_capacity and resident_capacity >= 0 (0: the "
        "default) and the device non-negative");
  }
  // The engine's settings, read as kvsparse-server's flags are (engine::EngineOptionsFrom).
  en::EngineSettings settings;
  settings.gpu = gpu;
  settings.options.gpu.device = static_cast<int>(device);
  if (!std::isnan(gpu_row_cache)) settings.options.gpu.row_cache = gpu_row_cache;  // NaN: default
  if (resident_capacity > 0) {
    settings.options.resident_capacity_bytes = static_cast<size_t>(resident_capacity);
  }
  settings.gpu_capacity = static_cast<uint64_t>(gpu_capacity);  // 0: the resident capacity
  settings.hash_weights = hash_weights;
  settings.saap_weights = saap_weights;
  settings.key_widths = key_widths;
  absl::StatusOr<en::EngineOptions> engine_options = en::EngineOptionsFrom(settings, "");
  Check(engine_options.status());
  o.engine = *std::move(engine_options);
  o.store.capacity_bytes = static_cast<size_t>(store_capacity);
  absl::StatusOr<kv::CapacityPolicy> policy = kv::ParseCapacityPolicy(capacity_policy);
  Check(policy.status());
  o.store.policy = *policy;
  o.host.huge_pages = huge_pages;
  rpc::StoreConnectionOptions store;
  store.target = store_target;
  store.tls.ca = store_tls_ca;
  store.tls.cert = store_tls_cert;
  store.tls.key = store_tls_key;
  store.rows.token = store_token;
  absl::StatusOr<std::unique_ptr<OpEngine>> engine =
      store_target.empty() ? NewLocalOpEngine(std::move(o)) : NewRemoteOpEngine(store, o);
  Check(engine.status());
  std::lock_guard<std::mutex> lock(engines_mu);
  const int64_t handle = next_engine++;
  engines[handle] = std::move(*engine);
  return handle;
}

void ReleaseEnginePlans(int64_t engine);

void EngineDestroy(int64_t handle) {
  ReleaseEnginePlans(handle);  // a plan holds its engine's sequences
  std::shared_ptr<OpEngine> e;
  {
    std::lock_guard<std::mutex> lock(engines_mu);
    auto it = engines.find(handle);
    if (it == engines.end()) return;
    e = std::move(it->second);
    engines.erase(it);
  }
}

// "cuda:<device>" or "cpu".
std::string EngineBackend(int64_t handle) {
  std::shared_ptr<OpEngine> e = Find(handle);
  return e->device() >= 0 ? absl::StrCat("cuda:", e->device()) : std::string("cpu");
}

// A model shape from the op's arguments, each in [0, 2^20] (the engine checks the rest).
kv::ModelShape ShapeOf(int64_t layers, int64_t q_heads, int64_t kv_heads, int64_t head_dim,
                       const std::string& dtype) {
  for (int64_t x : {layers, q_heads, kv_heads, head_dim}) {
    if (x < 0 || x > (1 << 20)) Invalid("model shape out of range");
  }
  return kv::ModelShape{static_cast<uint32_t>(layers), static_cast<uint32_t>(q_heads),
                        static_cast<uint32_t>(kv_heads), static_cast<uint32_t>(head_dim),
                        DTypeNamed(dtype)};
}

// Why the GPU kernels do not take sequences of this shape (engine::GpuTakesShape: every reason,
// "; " between them), or "" where they do; no engine needed.
std::string GpuShapeRefusal(int64_t num_q_heads, int64_t num_kv_heads, int64_t head_dim,
                            const std::string& dtype) {
  if (num_q_heads <= 0 || num_kv_heads <= 0 || head_dim <= 0) {
    Invalid("heads and head dim must be in [1, 2^20]");
  }
  const absl::Status taken =
      en::GpuTakesShape(ShapeOf(1, num_q_heads, num_kv_heads, head_dim, dtype));
  return taken.ok() ? std::string() : std::string(taken.message());
}

// [GPU memory the GPU backend holds for sequences, its capacity, store bytes used, store
// capacity, the CPU engine's resident bytes].
std::vector<int64_t> EngineMemory(int64_t handle) {
  std::shared_ptr<OpEngine> e = Find(handle);
  const en::DecodeBackend* b = e->engine().device_backend();
  absl::StatusOr<std::pair<uint64_t, uint64_t>> store = e->StoreBytes();
  Check(store.status());
  return {b != nullptr ? static_cast<int64_t>(b->resident_bytes()) : 0,
          b != nullptr ? static_cast<int64_t>(b->resident_capacity()) : 0,
          static_cast<int64_t>(store->first), static_cast<int64_t>(store->second),
          static_cast<int64_t>(e->engine().resident().bytes())};
}

// The reasons the GPU backend refused decode calls since the last call, each once per engine
// (OpEngine::NoteRefusal): the Python package warns with them.
std::vector<std::string> EngineRefusals(int64_t handle) { return Find(handle)->TakeRefusals(); }

// ---- Sequences --------------------------------------------------------------------------------

void CreateSequence(int64_t handle, const std::string& id, int64_t layers, int64_t q_heads,
                    int64_t kv_heads, int64_t head_dim, const std::string& dtype,
                    const std::string& k_tier, const std::string& v_tier, int64_t signature_bits,
                    int64_t compressed_key_bits) {
  std::shared_ptr<OpEngine> e = Find(handle);
  for (int64_t x : {signature_bits, compressed_key_bits}) {
    if (x < 0 || x > (1 << 20)) Invalid("signature bits out of range");
  }
  const kv::ModelShape shape = ShapeOf(layers, q_heads, kv_heads, head_dim, dtype);
  kv::Placement placement;
  placement.k_tier = TierNamed(k_tier);
  placement.v_tier = TierNamed(v_tier);
  placement.signature_bits = static_cast<uint32_t>(signature_bits);
  placement.compressed_key_bits = static_cast<uint32_t>(compressed_key_bits);
  Check(e->Create(id, shape, placement));
}

// A new sequence holding the first num_tokens tokens of `source` (a prompt's common prefix), their
// whole pages shared in the store. The source may be held by a step plan: its rows below its
// lengths never change. With source_placement the fork reads as the source is placed; otherwise
// as the tiers and bits given.
void ForkSequence(int64_t handle, const std::string& source, const std::string& id,
                  int64_t num_tokens, bool source_placement, const std::string& k_tier,
                  const std::string& v_tier, int64_t signature_bits, int64_t compressed_key_bits) {
  std::shared_ptr<OpEngine> e = Find(handle);
  if (num_tokens < 0) Invalid("num_tokens must not be negative");
  std::optional<kv::Placement> placement;
  if (!source_placement) {
    for (int64_t x : {signature_bits, compressed_key_bits}) {
      if (x < 0 || x > (1 << 20)) Invalid("signature bits out of range");
    }
    placement.emplace();
    placement->k_tier = TierNamed(k_tier);
    placement->v_tier = TierNamed(v_tier);
    placement->signature_bits = static_cast<uint32_t>(signature_bits);
    placement->compressed_key_bits = static_cast<uint32_t>(compressed_key_bits);
  }
  Check(e->Fork(source, id, static_cast<uint64_t>(num_tokens), placement));
}

// FAILED_PRECONDITION for a sequence a step plan holds (drops, appends and other plans wait for
// its release).
void RefuseHeld(OpEngine& e, const std::string& id) {
  if (e.engine().Held(id)) {
    Raise(absl::FailedPreconditionError(
        absl::StrCat("sequence '", id, "' is held by a step plan: release the plan first")));
  }
}

void DropSequence(int64_t handle, const std::string& id) {
  std::shared_ptr<OpEngine> e = Find(handle);
  RefuseHeld(*e, id);  // a plan's steps write its pages
  Check(e->Drop(id));
  e->engine().Forget(id);  // its GPU state too, at once
}

std::vector<int64_t> SequenceLengths(int64_t handle, const std::string& id) {
  absl::StatusOr<std::vector<uint64_t>> lengths = Find(handle)->Lengths(id);
  Check(lengths.status());
  return std::vector<int64_t>(lengths->begin(), lengths->end());
}

// K and V of tokens [0, count) of one layer, [Hkv, count, d] each on the CPU in the sequence's
// dtype (a prompt's earlier chunks, for attention computed outside kvsparse). OUT_OF_RANGE past
// the layer's length.
std::tuple<at::Tensor, at::Tensor> ReadRows(int64_t handle, const std::string& id, int64_t layer,
                                            int64_t count) {
  std::shared_ptr<OpEngine> e = Find(handle);
  const absl::Time deadline = absl::Now() + absl::Seconds(60);
  absl::StatusOr<en::SequenceDesc> d = e->source().Describe(id, deadline);
  Check(d.status());
  const kv::ModelShape& s = d->shape;
  if (layer < 0 || layer >= static_cast<int64_t>(s.num_layers)) Invalid("layer out of range");
  if (count < 0 || static_cast<uint64_t>(count) > d->layer_lengths[layer]) {
    Raise(absl::OutOfRangeError(
        absl::StrCat("the layer holds ", d->layer_lengths[layer], " tokens, not ", count)));
  }
  const int64_t hkv = s.num_kv_heads;
  const at::ScalarType type = s.dtype == DType::kBf16   ? at::kBFloat16
                              : s.dtype == DType::kFp16 ? at::kHalf
                                                        : at::kFloat;
  at::Tensor k = at::empty({hkv, count, static_cast<int64_t>(s.head_dim)}, type);
  at::Tensor v = at::empty_like(k);
  if (count == 0) return {k, v};
  std::vector<uint32_t> tokens(static_cast<size_t>(count));
  for (uint32_t t = 0; t < tokens.size(); ++t) tokens[t] = t;
  std::vector<en::RowRequest> heads(static_cast<size_t>(hkv));
  for (uint32_t j = 0; j < heads.size(); ++j) heads[j] = {j, tokens};
  Check(e->source()
            .Gather(id, static_cast<uint32_t>(layer), kv::RowKind::kKV, heads,
                    static_cast<uint8_t*>(k.data_ptr()), static_cast<uint8_t*>(v.data_ptr()),
                    deadline)
            .status());
  return {k, v};
}

// A contiguous host copy of t: CUDA tensors through pinned staging from torch's caching host
// allocator (a device-to-host copy at the link's speed, with no fresh pinning per call).
at::Tensor ToHost(const at::Tensor& t) {
  if (!t.is_cuda()) return t.contiguous();
  at::Tensor host = at::empty(t.sizes(), t.options().device(at::kCPU).pinned_memory(true));
  host.copy_(t);
  return host;
}

// Appends k, v ([tokens, Hkv, d], any device) to one layer; expected_length < 0: not checked.
void Append(int64_t handle, const std::string& id, int64_t layer, const at::Tensor& k,
            const at::Tensor& v, int64_t expected_length) {
  std::shared_ptr<OpEngine> e = Find(handle);
  if (k.dim() != 3 || !k.sizes().equals(v.sizes()) || k.scalar_type() != v.scalar_type()) {
    Invalid("k and v must be [tokens, kv_heads, head_dim] of one shape and dtype");
  }
  if (layer < 0 || layer > (1 << 20)) Invalid("layer out of range");
  RefuseHeld(*e, id);  // its next rows belong to the plan's steps
  const at::Tensor kh = ToHost(k), vh = ToHost(v);
  kv::AppendRequest r;
  r.sequence_id = id;
  r.first_layer = static_cast<uint32_t>(layer);
  r.num_layers = 1;
  r.num_tokens = static_cast<uint64_t>(k.size(0));
  r.dtype = DTypeOf(k, "k");
  r.num_kv_heads = static_cast<uint32_t>(k.size(1));
  r.head_dim = static_cast<uint32_t>(k.size(2));
  r.k = {static_cast<const uint8_t*>(kh.data_ptr()), static_cast<size_t>(kh.nbytes())};
  r.v = {static_cast<const uint8_t*>(vh.data_ptr()), static_cast<size_t>(vh.nbytes())};
  if (expected_length >= 0) r.expected_length = static_cast<uint64_t>(expected_length);
  Check(e->Append(r));
}

// ---- Decode ---------------------------------------------------------------------------------

// Per kv head of each sequence: rows selected, rows fetched, rows found in the row cache, bytes
// read from host memory, from the device and from another process, dense-equivalent bytes, and
// Bernoulli qK^T's K-feature reads per head and for the group's mean query (HeadStats).
constexpr int64_t kStatColumns = 9;

at::Tensor StatsTensor(const en::DecodeResult& r) {
  at::Tensor stats = at::empty({static_cast<int64_t>(r.heads.size()), kStatColumns}, at::kLong);
  int64_t* s = stats.data_ptr<int64_t>();
  for (const en::HeadStats& h : r.heads) {
    const uint64_t values[kStatColumns] = {h.rows_selected,
                                           h.rows_fetched,
                                           h.rows_cached,
                                           h.bytes[static_cast<int>(kv::Tier::kHost)],
                                           h.bytes[static_cast<int>(kv::Tier::kDevice)],
                                           h.bytes[static_cast<int>(kv::Tier::kRemote)],
                                           h.dense_equivalent_bytes,
                                           h.key_features_head,
                                           h.key_features_group};
    for (uint64_t x : values) *s++ = static_cast<int64_t>(x);
  }
  return stats;
}

// Per query head of each sequence (row b * H + h): the relative error the call's method states
// for its output (HeadStats), NaN where it states none: column 0 S2ANTA's standard error from its
// own draws (HeadStats::standard_error), column 1 vAttention's promised epsilon at 1 - delta
// (HeadStats::epsilon), column 2 top-k's certified bound on the attention mass it leaves out
// (HeadStats::missed_mass_bound). `rows`: B * H.
constexpr int64_t kErrorColumns = 3;

at::Tensor ErrorsTensor(const en::DecodeResult& r, int64_t rows) {
  at::Tensor errors =
      at::full({rows, kErrorColumns}, std::numeric_limits<float>::quiet_NaN(), at::kFloat);
  if (r.heads.empty() || rows % static_cast<int64_t>(r.heads.size()) != 0) return errors;
  const int64_t group = rows / static_cast<int64_t>(r.heads.size());
  float* e = errors.data_ptr<float>();
  for (size_t i = 0; i < r.heads.size(); ++i) {
    const en::HeadStats& h = r.heads[i];
    for (int64_t g = 0; g < group; ++g) {
      float* row = e + (static_cast<int64_t>(i) * group + g) * kErrorColumns;
      if (static_cast<size_t>(g) < h.standard_error.size()) row[0] = h.standard_error[g];
      if (static_cast<size_t>(g) < h.epsilon.size()) row[1] = h.epsilon[g];
      if (static_cast<size_t>(g) < h.missed_mass_bound.size()) row[2] = h.missed_mass_bound[g];
    }
  }
  return errors;
}

// A decode call's output, its statistics (StatsTensor) and, when asked for, its stated errors
// (ErrorsTensor; undefined otherwise: the plain decode and the eager steps build none).
struct Decoded {
  at::Tensor out, stats, errors;
};

Decoded DecodedOf(at::Tensor out, const en::DecodeResult& r, int64_t rows, bool with_errors) {
  return {std::move(out), StatsTensor(r), with_errors ? ErrorsTensor(r, rows) : at::Tensor()};
}

// One decode call (call: layer, sequences, method, seeds and scale set) over torch tensors: on
// the GPU backend when q is on its device and it takes the call, else on the CPU engine.
Decoded DecodeWith(OpEngine* e, en::DecodeCall call, const at::Tensor& q_in,
                   const std::optional<at::Tensor>& new_k, const std::optional<at::Tensor>& new_v,
                   bool with_errors = false) {
  if (q_in.dim() != 3) Invalid("q must be [B, H, d]");
  if (new_k.has_value() != new_v.has_value()) Invalid("new_k and new_v come together");
  call.q_dtype = DTypeOf(q_in, "q");
  if (q_in.size(0) > (1 << 20)) Invalid("q: batch out of range");  // the engine checks it is B
  call.q_batch = static_cast<uint32_t>(q_in.size(0));
  call.q_heads = static_cast<uint32_t>(q_in.size(1));
  call.q_dim = static_cast<uint32_t>(q_in.size(2));
  at::Tensor nk, nv;
  if (new_k.has_value()) {  // appended to the host store: to host memory
    nk = ToHost(*new_k);
    nv = ToHost(*new_v);
    if (nk.scalar_type() != nv.scalar_type()) Invalid("new_k and new_v: one dtype");
    call.new_kv_dtype = DTypeOf(nk, "new_k");
    call.new_k = {static_cast<const uint8_t*>(nk.data_ptr()), static_cast<size_t>(nk.nbytes())};
    call.new_v = {static_cast<const uint8_t*>(nv.data_ptr()), static_cast<size_t>(nv.nbytes())};
  }
#if KVSPARSE_TORCH_CUDA
  if (q_in.is_cuda() && e->device() == q_in.get_device()) {
    // q and the output stay on the device, on the caller's stream; q as the kernels read it (a
    // view off a 16-byte boundary would fault them: copied).
    const at::Tensor q = Aligned16(q_in);
    at::Tensor out = at::empty_like(q);
    call.q_device = q.data_ptr();
    call.out_device = out.data_ptr();
    call.stream = at::cuda::getCurrentCUDAStream(q.get_device()).stream();
    absl::StatusOr<en::DecodeResult> r = e->engine().Decode(call);
    if (r.ok()) return DecodedOf(out, *r, q.size(0) * q.size(1), with_errors);
    // Refused before anything was appended: the method runs on the CPU engine (below), said
    // once per engine and reason (a model whose GQA group the kernels do not take, a placement
    // the backend does not read; engine_refusals) so that a slow step is not a mystery.
    if (!absl::IsFailedPrecondition(r.status()) ||
        !absl::StartsWith(r.status().message(), en::kNotOnBackend)) {
      Raise(r.status());
    }
    e->NoteRefusal(r.status().message());
    call.q_device = nullptr;
    call.out_device = nullptr;
    call.stream = nullptr;
  }
#endif
  const at::Tensor qh = q_in.to(at::kCPU).contiguous();
  call.q = {static_cast<const uint8_t*>(qh.data_ptr()), static_cast<size_t>(qh.nbytes())};
  absl::StatusOr<en::DecodeResult> r = e->engine().Decode(call);
  Check(r.status());
  at::Tensor out = at::empty(q_in.sizes(), qh.options());
  std::memcpy(out.data_ptr(), r->output.data(), r->output.size());
  return DecodedOf(out.to(q_in.device()), *r, q_in.size(0) * q_in.size(1), with_errors);
}

Decoded DecodeCalled(int64_t handle, int64_t layer, const std::vector<std::string>& sequence_ids,
                     const at::Tensor& q_in, const std::optional<at::Tensor>& new_k,
                     const std::optional<at::Tensor>& new_v, const std::string& method,
                     int64_t seed, double scale, bool with_errors) {
  std::shared_ptr<OpEngine> e = Find(handle);
  if (layer < 0 || layer > (1 << 20)) Invalid("layer out of range");  // scale: the engine's rule
  en::DecodeCall call;
  call.layer = static_cast<uint32_t>(layer);
  call.sequence_ids = sequence_ids;
  call.method = MethodOf(method);
  call.seed = static_cast<uint64_t>(seed);
  call.scale = static_cast<float>(scale);
  return DecodeWith(e.get(), std::move(call), q_in, new_k, new_v, with_errors);
}

std::tuple<at::Tensor, at::Tensor> Decode(int64_t handle, int64_t layer,
                                          const std::vector<std::string>& sequence_ids,
                                          const at::Tensor& q_in,
                                          const std::optional<at::Tensor>& new_k,
                                          const std::optional<at::Tensor>& new_v,
                                          const std::string& method, int64_t seed, double scale) {
  Decoded d =
      DecodeCalled(handle, layer, sequence_ids, q_in, new_k, new_v, method, seed, scale, false);
  return {std::move(d.out), std::move(d.stats)};
}

// decode with the errors its method states (ErrorsTensor) as a third output.
std::tuple<at::Tensor, at::Tensor, at::Tensor> DecodeWithErrors(
    int64_t handle, int64_t layer, const std::vector<std::string>& sequence_ids,
    const at::Tensor& q_in, const std::optional<at::Tensor>& new_k,
    const std::optional<at::Tensor>& new_v, const std::string& method, int64_t seed, double scale) {
  Decoded d =
      DecodeCalled(handle, layer, sequence_ids, q_in, new_k, new_v, method, seed, scale, true);
  return {std::move(d.out), std::move(d.stats), std::move(d.errors)};
}

// ---- Step plans (engine/static_step.h) ------------------------------------------------------

// A plan of decode steps over a fixed batch: captured (the GPU backend's static step: every
// layer's call can be recorded in a CUDA graph) or, where the engine cannot capture the method,
// placement or device, eager (each layer's call an ordinary decode call that appends the step's
// token at its position and draws as a captured step would).
struct StepPlan {
  std::shared_ptr<OpEngine> engine;
  int64_t engine_handle = 0;
  std::unique_ptr<en::StaticStep> captured;  // null: eager
  std::string eager_reason;
  en::StaticStepRequest request;
  // An eager plan's last step's statistics in a captured plan's layout ([layers, kStatBlocks,
  // B * H] int32; block 0: rows fetched, block 3: of them found in the row cache, per (sequence,
  // kv head) in the first B * Hkv entries), sized at its first step.
  std::mutex eager_mu;
  at::Tensor eager_stats;  // guarded by eager_mu
};

std::mutex plans_mu;
std::map<int64_t, std::shared_ptr<StepPlan>> plans;  // guarded by plans_mu
int64_t next_plan = 1;                               // guarded by plans_mu

std::shared_ptr<StepPlan> FindPlan(int64_t engine, int64_t handle) {
  std::lock_guard<std::mutex> lock(plans_mu);
  auto it = plans.find(handle);
  if (it == plans.end() || it->second->engine_handle != engine) {
    Raise(absl::NotFoundError(
        absl::StrCat("no step plan ", handle, " of engine ", engine, " (released?)")));
  }
  return it->second;
}

// Per-sequence bounds (StaticStepRequest::bounds) from the op's list: empty, or one per sequence
// in 0 .. max_tokens.
std::vector<uint64_t> BoundsOf(const std::vector<int64_t>& bounds, size_t sequences,
                               int64_t max_tokens) {
  if (!bounds.empty() && bounds.size() != sequences) Invalid("bounds: none, or one per sequence");
  std::vector<uint64_t> out;
  for (int64_t b : bounds) {
    if (b < 0 || b > max_tokens) Invalid("a bound lies in 0 (max_tokens) .. max_tokens");
    out.push_back(static_cast<uint64_t>(b));
  }
  return out;
}

int64_t PlanSteps(int64_t handle, const std::vector<std::string>& sequence_ids,
                  const std::string& method, int64_t max_tokens, int64_t seed, double scale,
                  const std::string& dtype, bool eager, bool warm_pages, bool layer_graphs,
                  const std::vector<int64_t>& bounds) {
  std::shared_ptr<OpEngine> e = Find(handle);
  if (max_tokens <= 0 || max_tokens > (int64_t{1} << 30)) {  // scale: the engine's rule
    Invalid("max_tokens (1 .. 2^30) out of range");
  }
  auto plan = std::make_shared<StepPlan>();
  plan->engine = e;
  plan->engine_handle = handle;
  en::StaticStepRequest& r = plan->request;
  r.sequence_ids = sequence_ids;
  r.method = MethodOf(method);
  r.max_tokens = static_cast<uint64_t>(max_tokens);
  r.seed = static_cast<uint64_t>(seed);
  r.scale = static_cast<float>(scale);
  r.dtype = DTypeNamed(dtype);
  r.warm_pages = warm_pages;
  r.layer_graphs = layer_graphs;
  r.bounds = BoundsOf(bounds, sequence_ids.size(), max_tokens);
  for (const std::string& id : sequence_ids) RefuseHeld(*e, id);  // one plan per sequence
  if (eager) {
    plan->eager_reason = "eager steps asked for";
  } else if (e->device() < 0) {
    plan->eager_reason = "no GPU backend";
  } else {
    absl::StatusOr<std::unique_ptr<en::StaticStep>> s = e->engine().PlanStatic(r);
    if (s.ok()) {
      plan->captured = std::move(*s);
    } else if (absl::IsFailedPrecondition(s.status())) {  // not capturable: eager calls
      plan->eager_reason = std::string(s.status().message());
    } else {
      Raise(s.status());
    }
  }
  if (plan->captured == nullptr) {  // eager: the sequences must exist
    for (const std::string& id : sequence_ids) Check(e->Lengths(id).status());
  }
  std::lock_guard<std::mutex> lock(plans_mu);
  const int64_t id = next_plan++;
  plans[id] = std::move(plan);
  return id;
}

// Moves a plan to other sequences, as many (StaticStep::Rebind): a captured plan binds them in
// its device memory, so that graphs recorded from its calls replay over them (rows written
// since the last commit_steps are dropped: commit first); an eager plan's calls name them from
// now on. Not concurrently with the plan's steps.
void RebindSteps(int64_t engine, int64_t handle, const std::vector<std::string>& sequence_ids,
                 const std::vector<int64_t>& bounds) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  en::StaticStepRequest& r = p->request;
  if (sequence_ids.size() != r.sequence_ids.size()) {
    Invalid(absl::StrCat("a plan of ", r.sequence_ids.size(), " sequences rebinds to as many"));
  }
  std::vector<uint64_t> b = BoundsOf(bounds, sequence_ids.size(), r.max_tokens);
#if KVSPARSE_TORCH_CUDA
  if (p->captured != nullptr) {
    Check(p->captured->Rebind(sequence_ids, b,
                              at::cuda::getCurrentCUDAStream(p->engine->device()).stream()));
    r.sequence_ids = sequence_ids;
    r.bounds = std::move(b);
    return;
  }
#endif
  for (const std::string& id : sequence_ids) {
    RefuseHeld(*p->engine, id);
    Check(p->engine->Lengths(id).status());
  }
  r.sequence_ids = sequence_ids;
  r.bounds = std::move(b);
}

// "captured", or "eager: <why>".
std::string StepPlanMode(int64_t engine, int64_t handle) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  return p->captured != nullptr ? std::string("captured") : "eager: " + p->eager_reason;
}

// Device bytes a captured plan holds beside the engine's sequences (0 for an eager plan).
int64_t StepDeviceBytes(int64_t engine, int64_t handle) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  return p->captured != nullptr ? static_cast<int64_t>(p->captured->device_bytes()) : 0;
}

void ReleaseSteps(int64_t engine, int64_t handle) {
  std::shared_ptr<StepPlan> p;
  {
    std::lock_guard<std::mutex> lock(plans_mu);
    auto it = plans.find(handle);
    if (it == plans.end() || it->second->engine_handle != engine) return;
    p = std::move(it->second);
    plans.erase(it);
  }
}

void ReleaseEnginePlans(int64_t engine) {
  std::vector<std::shared_ptr<StepPlan>> gone;
  std::lock_guard<std::mutex> lock(plans_mu);
  for (auto it = plans.begin(); it != plans.end();) {
    if (it->second->engine_handle == engine) {
      gone.push_back(std::move(it->second));
      it = plans.erase(it);
    } else {
      ++it;
    }
  }
}

// An eager step's per-(sequence, kv head) figures (StatsTensor's rows) into the plan's
// statistics in a captured plan's layout (StepPlan::eager_stats).
void NoteEagerStats(StepPlan* p, int64_t layer, int64_t layers, int64_t heads,
                    const at::Tensor& stats) {
  const int64_t B = static_cast<int64_t>(p->request.sequence_ids.size());
  std::lock_guard<std::mutex> lock(p->eager_mu);
  if (!p->eager_stats.defined()) {
    p->eager_stats = at::zeros({layers, en::StaticStep::kStatBlocks, B * heads}, at::kInt);
  }
  if (layer >= p->eager_stats.size(0) || stats.size(0) > B * heads) return;
  int32_t* block =
      p->eager_stats.data_ptr<int32_t>() + layer * en::StaticStep::kStatBlocks * B * heads;
  const int64_t* s = stats.data_ptr<int64_t>();
  for (int64_t i = 0; i < stats.size(0); ++i) {  // columns: StatsTensor's
    block[i] = static_cast<int32_t>(s[i * kStatColumns + 1]);
    block[3 * B * heads + i] = static_cast<int32_t>(s[i * kStatColumns + 2]);
  }
}

// One layer of a planned step into `out` (undefined: a new tensor): q [B, H, d], new_k / new_v
// [B, Hkv, d], positions [B] int64 (each sequence's length before the step). Returns the output
// [B, H, d].
at::Tensor StepDecodeTo(int64_t engine, int64_t handle, int64_t layer, const at::Tensor& q,
                        const at::Tensor& new_k, const at::Tensor& new_v,
                        const at::Tensor& positions, at::Tensor out) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  const en::StaticStepRequest& r = p->request;
  const int64_t B = static_cast<int64_t>(r.sequence_ids.size());
  if (layer < 0 || layer > (1 << 20)) Invalid("layer out of range");
  if (q.dim() != 3 || q.size(0) != B || new_k.dim() != 3 || new_k.size(0) != B ||
      !new_k.sizes().equals(new_v.sizes())) {
    Invalid(absl::StrCat("q must be [", B, ", H, d] and new_k, new_v [", B, ", Hkv, d]"));
  }
  if (positions.dim() != 1 || positions.size(0) != B || positions.scalar_type() != at::kLong) {
    Invalid(absl::StrCat("positions must be [", B, "] int64"));
  }
  if (out.defined() && (!out.is_contiguous() || !out.sizes().equals(q.sizes()) ||
                        out.scalar_type() != q.scalar_type() || out.device() != q.device())) {
    Invalid("out must be contiguous, of q's shape, dtype and device");
  }
#if KVSPARSE_TORCH_CUDA
  if (p->captured != nullptr) {
    const int dev = p->engine->device();
    for (const at::Tensor* t : {&q, &new_k, &new_v, &positions}) {
      if (!t->is_cuda() || t->get_device() != dev) {
        Invalid(absl::StrCat("a captured step's tensors live on cuda:", dev));
      }
    }
    if (q.scalar_type() != new_k.scalar_type() || new_k.scalar_type() != new_v.scalar_type() ||
        DTypeOf(q, "q") != r.dtype) {
      Invalid("q, new_k and new_v: the plan's dtype");
    }
    const en::StaticStep& st = *p->captured;  // the kernels read exactly the plan's shapes
    if (q.size(1) != int64_t{st.num_q_heads()} || q.size(2) != int64_t{st.head_dim()} ||
        new_k.size(1) != int64_t{st.num_kv_heads()} || new_k.size(2) != int64_t{st.head_dim()}) {
      Invalid(absl::StrCat("the plan's sequences take q [", B, ", ", st.num_q_heads(), ", ",
                           st.head_dim(), "] and new_k, new_v [", B, ", ", st.num_kv_heads(), ", ",
                           st.head_dim(), "]"));
    }
    // As the kernels read them: contiguous, 16-byte aligned (copied where not); the caller's out
    // must be so already, since the step writes into it.
    const at::Tensor qc = Aligned16(q), kc = Aligned16(new_k), vc = Aligned16(new_v);
    const at::Tensor pc = positions.contiguous();
    if (!out.defined()) out = at::empty_like(qc);
    if (!OnA16ByteBoundary(out)) {
      Invalid("out must start on a 16-byte boundary (the kernels write 16 bytes at a time)");
    }
    Check(p->captured->Enqueue(static_cast<uint32_t>(layer), qc.data_ptr(), kc.data_ptr(),
                               vc.data_ptr(), pc.data_ptr<int64_t>(), out.data_ptr(),
                               at::cuda::getCurrentCUDAStream(dev).stream()));
    return out;
  }
#endif
  // Eager: the step's token goes in at the end of each sequence's layer.
  const at::Tensor pos = positions.to(at::kCPU).contiguous();
  en::DecodeCall call;
  call.layer = static_cast<uint32_t>(layer);
  call.sequence_ids = r.sequence_ids;
  call.method = r.method;
  call.seed = r.seed + (static_cast<uint64_t>(layer) << 32);  // as a captured step draws
  call.scale = r.scale;
  int64_t layers = 0;
  for (int64_t b = 0; b < B; ++b) {
    const int64_t at = pos.data_ptr<int64_t>()[b];
    absl::StatusOr<std::vector<uint64_t>> lengths = p->engine->Lengths(r.sequence_ids[b]);
    Check(lengths.status());
    layers = static_cast<int64_t>(lengths->size());
    if (static_cast<size_t>(layer) >= lengths->size() || at < 0 ||
        static_cast<uint64_t>(at) != (*lengths)[layer] ||
        static_cast<uint64_t>(at) >= r.max_tokens) {
      Raise(absl::OutOfRangeError(absl::StrCat(
          "sequence '", r.sequence_ids[b], "': an eager step appends at the layer's length (",
          static_cast<size_t>(layer) < lengths->size() ? (*lengths)[layer] : 0,
          ") below max_tokens, not at ", at)));
    }
    call.seed_offsets.push_back(static_cast<uint64_t>(at));
  }
  Decoded d = DecodeWith(p->engine.get(), std::move(call), q, new_k, new_v);
  NoteEagerStats(p.get(), layer, layers, q.size(1), d.stats);
  if (!out.defined()) return d.out;
  out.copy_(d.out);
  return out;
}

at::Tensor StepDecode(int64_t engine, int64_t handle, int64_t layer, const at::Tensor& q,
                      const at::Tensor& new_k, const at::Tensor& new_v,
                      const at::Tensor& positions) {
  return StepDecodeTo(engine, handle, layer, q, new_k, new_v, positions, at::Tensor());
}

// step_decode writing into out (a contiguous [B, H, d] of q's dtype and device): the caller's
// buffer, no allocation or copy after the step.
void StepDecodeInto(int64_t engine, int64_t handle, int64_t layer, const at::Tensor& q,
                    const at::Tensor& new_k, const at::Tensor& new_v, const at::Tensor& positions,
                    at::Tensor out) {
  StepDecodeTo(engine, handle, layer, q, new_k, new_v, positions, out);
}

// A captured plan's layer graphs (StaticStepRequest::layer_graphs): [recorded, replayed]; an
// eager plan's [0, 0].
std::vector<int64_t> StepGraphCounts(int64_t engine, int64_t handle) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  if (p->captured == nullptr) return {0, 0};
  const en::StaticStep::LayerGraphCounts c = p->captured->layer_graph_counts();
  return {static_cast<int64_t>(c.recorded), static_cast<int64_t>(c.replayed)};
}

// Commits the rows the steps wrote (captured; eager steps are committed as they run); returns
// each sequence's length.
std::vector<int64_t> CommitSteps(int64_t engine, int64_t handle) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  std::vector<int64_t> out;
#if KVSPARSE_TORCH_CUDA
  if (p->captured != nullptr) {
    absl::StatusOr<std::vector<uint64_t>> n =
        p->captured->Commit(at::cuda::getCurrentCUDAStream(p->engine->device()).stream());
    Check(n.status());
    for (uint64_t x : *n) out.push_back(static_cast<int64_t>(x));
    return out;
  }
#endif
  for (const std::string& id : p->request.sequence_ids) {
    absl::StatusOr<std::vector<uint64_t>> lengths = p->engine->Lengths(id);
    Check(lengths.status());
    out.push_back(static_cast<int64_t>(lengths->empty() ? 0 : (*lengths)[0]));
  }
  return out;
}

// A plan's last step's statistics [layers, 4, B * H] int32 (rows read per (sequence, kv head) in
// the first B * Hkv entries of block 0; of them, for the methods that use the row cache, those
// found there in block 3): a captured plan's on its device, copied on the current stream without
// a synchronisation; an eager plan's in host memory (empty before its first step).
at::Tensor StepStats(int64_t engine, int64_t handle) {
  std::shared_ptr<StepPlan> p = FindPlan(engine, handle);
  if (p->captured == nullptr) {
    std::lock_guard<std::mutex> lock(p->eager_mu);
    if (p->eager_stats.defined()) return p->eager_stats.clone();
    return at::zeros({0, en::StaticStep::kStatBlocks, 0}, at::kInt);
  }
#if KVSPARSE_TORCH_CUDA
  en::StaticStep& s = *p->captured;
  const int dev = p->engine->device();
  at::Tensor stats = at::empty({static_cast<int64_t>(s.num_layers()), en::StaticStep::kStatBlocks,
                                static_cast<int64_t>(s.batch()) * s.num_q_heads()},
                               at::TensorOptions().dtype(at::kInt).device(at::kCUDA, dev));
  Check(s.CopyStats(stats.data_ptr<int32_t>(), at::cuda::getCurrentCUDAStream(dev).stream()));
  return stats;
#else
  Raise(absl::InternalError("built without CUDA"));
#endif
}

}  // namespace

TORCH_LIBRARY(kvsparse, m) {
  m.def(
      "engine_create(str gpu, int device, int store_capacity, str capacity_policy, "
      "int gpu_capacity, float gpu_row_cache, int resident_capacity, bool huge_pages, "
      "str store_target, str hash_weights, str saap_weights, str store_tls_ca, "
      "str store_tls_cert, str store_tls_key, str store_token, str key_widths) -> int",
      &EngineCreate);
  m.def("engine_destroy(int engine) -> ()", &EngineDestroy);
  m.def("engine_backend(int engine) -> str", &EngineBackend);
  m.def("engine_memory(int engine) -> int[]", &EngineMemory);
  m.def("engine_refusals(int engine) -> str[]", &EngineRefusals);
  m.def("gpu_shape_refusal(int num_q_heads, int num_kv_heads, int head_dim, str dtype) -> str",
        &GpuShapeRefusal);
  m.def(
      "create_sequence(int engine, str sequence_id, int num_layers, int num_q_heads, "
      "int num_kv_heads, int head_dim, str dtype, str k_tier, str v_tier, "
      "int signature_bits, int compressed_key_bits=0) -> ()",
      &CreateSequence);
  m.def(
      "fork_sequence(int engine, str source_id, str sequence_id, int num_tokens, "
      "bool source_placement, str k_tier, str v_tier, int signature_bits, "
      "int compressed_key_bits) -> ()",
      &ForkSequence);
  m.def("drop_sequence(int engine, str sequence_id) -> ()", &DropSequence);
  m.def("sequence_lengths(int engine, str sequence_id) -> int[]", &SequenceLengths);
  m.def("read_rows(int engine, str sequence_id, int layer, int count) -> (Tensor, Tensor)",
        &ReadRows);
  m.def(
      "append(int engine, str sequence_id, int layer, Tensor k, Tensor v, int expected_length) "
      "-> ()");
  m.def(
      "decode(int engine, int layer, str[] sequence_ids, Tensor q, Tensor? new_k, Tensor? new_v, "
      "str method, int seed, float scale) -> (Tensor, Tensor)");
  m.def(
      "decode_with_errors(int engine, int layer, str[] sequence_ids, Tensor q, Tensor? new_k, "
      "Tensor? new_v, str method, int seed, float scale) -> (Tensor, Tensor, Tensor)");
  m.def(
      "plan_steps(int engine, str[] sequence_ids, str method, int max_tokens, "
      "int seed, float scale, str dtype, bool eager=False, bool warm_pages=True, "
      "bool layer_graphs=True, int[] bounds=[]) -> int",
      &PlanSteps);
  m.def("rebind_steps(int engine, int plan, str[] sequence_ids, int[] bounds=[]) -> ()",
        &RebindSteps);
  m.def("step_plan_mode(int engine, int plan) -> str", &StepPlanMode);
  m.def("step_device_bytes(int engine, int plan) -> int", &StepDeviceBytes);
  m.def("release_steps(int engine, int plan) -> ()", &ReleaseSteps);
  m.def("commit_steps(int engine, int plan) -> int[]", &CommitSteps);
  m.def("step_stats(int engine, int plan) -> Tensor", &StepStats);
  m.def("step_graph_counts(int engine, int plan) -> int[]", &StepGraphCounts);
  m.def(
      "step_decode(int engine, int plan, int layer, Tensor q, Tensor new_k, Tensor new_v, "
      "Tensor positions) -> Tensor");
  m.def(
      "step_decode_into(int engine, int plan, int layer, Tensor q, Tensor new_k, Tensor new_v, "
      "Tensor positions, Tensor(a!) out) -> ()");
}

// The tensor ops by device, so that torch.compile sees them as opaque (their fake
// implementations are registered in Python, kvsparse/torch/ops.py).
TORCH_LIBRARY_IMPL(kvsparse, CPU, m) {
  m.impl("append", &Append);
  m.impl("decode", &Decode);
  m.impl("decode_with_errors", &DecodeWithErrors);
  m.impl("step_decode", &StepDecode);
  m.impl("step_decode_into", &StepDecodeInto);
}
TORCH_LIBRARY_IMPL(kvsparse, CUDA, m) {
  m.impl("append", &Append);
  m.impl("decode", &Decode);
  m.impl("decode_with_errors", &DecodeWithErrors);
  m.impl("step_decode", &StepDecode);
  m.impl("step_decode_into", &StepDecodeInto);
}

}  // namespace kvsparse::torch_ops
