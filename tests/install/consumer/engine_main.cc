// Uses the installed kvsparse engine in process: a store, a row source over it and a decode
// engine; appends two tokens and decodes one dense step, whose output must be the average of the
// two V rows when the query scores both keys alike.
#include <cstdio>
#include <vector>

#include "engine/decode_engine.h"
#include "kvstore/store.h"

int main() {
  namespace kv = kvsparse::kvstore;
  namespace en = kvsparse::engine;
  auto fail = [](const char* what, const absl::Status& s) {
    std::printf("engine_consumer: %s: %s\n", what, s.ToString().c_str());
    return 1;
  };
  auto store = kv::Store::Create(kv::StoreOptions());
  if (!store.ok()) return fail("store", store.status());
  const kv::ModelShape shape{1, 1, 1, 8, kvsparse::kernels::DType::kFp32};
  if (auto s = (*store)->CreateSequence("s", shape, kv::Placement()); !s.ok()) {
    return fail("create", s.status());
  }
  // Two tokens with equal keys: the output is the mean of their V rows, 2 3 4 5 ... 9.
  const std::vector<float> k(16, 0.f);
  std::vector<float> v(16);
  for (int i = 0; i < 8; ++i) {
    v[i] = static_cast<float>(i + 1);
    v[8 + i] = static_cast<float>(i + 3);
  }
  kv::AppendRequest r;
  r.sequence_id = "s";
  r.num_tokens = 2;
  r.dtype = shape.dtype;
  r.num_kv_heads = 1;
  r.head_dim = 8;
  r.k = {reinterpret_cast<const uint8_t*>(k.data()), k.size() * 4};
  r.v = {reinterpret_cast<const uint8_t*>(v.data()), v.size() * 4};
  if (auto s = (*store)->Append(r); !s.ok()) return fail("append", s.status());
  auto source = en::NewLocalRowSource(store->get());
  en::DecodeEngine engine(en::EngineOptions(), source.get());
  const std::vector<float> q(8, 1.f);
  en::DecodeCall call;
  call.sequence_ids = {"s"};
  call.q_dtype = shape.dtype;
  call.q = {reinterpret_cast<const uint8_t*>(q.data()), q.size() * 4};
  auto result = engine.Decode(call);
  if (!result.ok()) return fail("decode", result.status());
  const float* out = reinterpret_cast<const float*>(result->output.data());
  bool ok = true;
  for (int i = 0; i < 8; ++i) ok = ok && out[i] == static_cast<float>(i + 2);
  std::printf("engine_consumer: dense output %g %g ... %g (backend %s): %s\n", out[0], out[1],
              out[7], engine.backend(), ok ? "as expected" : "WRONG");
  return ok ? 0 : 1;
}
