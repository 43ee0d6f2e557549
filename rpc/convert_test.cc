#include "rpc/convert.h"

#include <functional>
#include <string>
#include <vector>

#include "gmock/gmock.h"
#include "gtest/gtest.h"

namespace kvsparse::rpc {
namespace {

TEST(ConvertTest, TensorSizeMustMatchShapeAndDtype) {
  v1::Tensor t;
  t.set_dtype(v1::DTYPE_BF16);
  t.add_shape(2);
  t.add_shape(3);
  t.set_data(std::string(12, 'x'));
  EXPECT_TRUE(ValidateTensor(t, "t").ok());
  t.set_data(std::string(11, 'x'));
  EXPECT_EQ(ValidateTensor(t, "t").code(), absl::StatusCode::kInvalidArgument);
  t.set_data(std::string(12, 'x'));
  t.set_dtype(v1::DTYPE_UNSPECIFIED);
  EXPECT_EQ(ValidateTensor(t, "t").code(), absl::StatusCode::kInvalidArgument);
  t.set_dtype(v1::DTYPE_FP32);
  t.set_shape(0, -1);
  EXPECT_EQ(ValidateTensor(t, "t").code(), absl::StatusCode::kInvalidArgument);
}

// A decode of one sequence "s" with a zero fp32 q of 2 heads of dim 4 (the method left to set).
v1::DecodeRequest OneSequenceRequest() {
  v1::DecodeRequest req;
  req.add_sequence_ids("s");
  v1::Tensor* q = req.mutable_q();
  q->set_dtype(v1::DTYPE_FP32);
  for (int64_t dim : {1, 2, 4}) q->add_shape(dim);
  q->set_data(std::string(1 * 2 * 4 * 4, '\0'));
  return req;
}

// vAttention's predictor on the wire: each value maps to the engine's, unspecified to the hash
// predictor, and a value this server does not know is refused (not read as another predictor).
TEST(ConvertTest, VAttentionPredictors) {
  v1::DecodeRequest req = OneSequenceRequest();
  auto predictor = [&](int value) -> absl::StatusOr<kernels::TopKPredictor> {
    req.mutable_method()->mutable_vattention()->set_predictor(
        static_cast<v1::TopKPredictor>(value));
    absl::StatusOr<engine::DecodeCall> c = FromProto(req);
    if (!c.ok()) return c.status();
    return c->method.vattention.predictor;
  };
  EXPECT_EQ(*predictor(v1::TOP_K_PREDICTOR_UNSPECIFIED), kernels::TopKPredictor::kHash);
  EXPECT_EQ(*predictor(v1::TOP_K_PREDICTOR_HASH), kernels::TopKPredictor::kHash);
  EXPECT_EQ(*predictor(v1::TOP_K_PREDICTOR_EXACT), kernels::TopKPredictor::kExact);
  EXPECT_EQ(*predictor(v1::TOP_K_PREDICTOR_COMPRESSED), kernels::TopKPredictor::kCompressed);
  EXPECT_EQ(predictor(77).status().code(), absl::StatusCode::kInvalidArgument);
}

// vAttention's residual sampler on the wire: unspecified reads as the paper's uniform sampler,
// unknown values are refused.
TEST(ConvertTest, VAttentionResidualSampler) {
  v1::DecodeRequest req = OneSequenceRequest();
  auto sampler = [&](int value) -> absl::StatusOr<kernels::ResidualSampler> {
    req.mutable_method()->mutable_vattention()->set_sampler(
        static_cast<v1::ResidualSampler>(value));
    absl::StatusOr<engine::DecodeCall> c = FromProto(req);
    if (!c.ok()) return c.status();
    return c->method.vattention.sampler;
  };
  EXPECT_EQ(*sampler(v1::RESIDUAL_SAMPLER_UNSPECIFIED), kernels::ResidualSampler::kUniform);
  EXPECT_EQ(*sampler(v1::RESIDUAL_SAMPLER_UNIFORM), kernels::ResidualSampler::kUniform);
  EXPECT_EQ(*sampler(v1::RESIDUAL_SAMPLER_IMPORTANCE), kernels::ResidualSampler::kImportance);
  EXPECT_EQ(sampler(5).status().code(), absl::StatusCode::kInvalidArgument);
}

// S2ANTA's score source and correction on the wire: unspecified reads as exact scores and the
// ratio correction (the older clients' meaning), unknown values are refused.
TEST(ConvertTest, SantaScoresAndCorrection) {
  v1::DecodeRequest req = OneSequenceRequest();
  auto convert = [&](int scores, int correction) -> absl::StatusOr<kernels::SantaParams> {
    v1::SantaParams* s = req.mutable_method()->mutable_santa();
    s->set_samples(8);
    s->set_scores(static_cast<v1::ScoreSource>(scores));
    s->set_correction(static_cast<v1::SantaCorrection>(correction));
    absl::StatusOr<engine::DecodeCall> c = FromProto(req);
    if (!c.ok()) return c.status();
    return c->method.santa;
  };
  absl::StatusOr<kernels::SantaParams> p = convert(0, 0);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->scores, kernels::ScoreSource::kExact);
  EXPECT_EQ(p->correction, kernels::SantaCorrection::kRatio);
  p = convert(v1::SCORE_SOURCE_COMPRESSED_KEYS, v1::SANTA_CORRECTION_NONE);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->scores, kernels::ScoreSource::kCompressedKeys);
  EXPECT_EQ(p->correction, kernels::SantaCorrection::kNone);
  EXPECT_EQ(convert(v1::SCORE_SOURCE_EXACT, v1::SANTA_CORRECTION_RATIO)->scores,
            kernels::ScoreSource::kExact);
  EXPECT_EQ(convert(9, 0).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(convert(0, 9).status().code(), absl::StatusCode::kInvalidArgument);
  // The proposal's uniform floor reaches the engine, whose checks judge it (ValidateSantaParams).
  req.mutable_method()->mutable_santa()->set_uniform_floor(0.05f);
  p = convert(v1::SCORE_SOURCE_COMPRESSED_KEYS, v1::SANTA_CORRECTION_RATIO);
  ASSERT_TRUE(p.ok()) << p.status();
  EXPECT_EQ(p->uniform_floor, 0.05f);
}

TEST(ConvertTest, AppendNeedsRank4AndMatchingKV) {
  v1::AppendRequest r;
  r.set_sequence_id("s");
  for (v1::Tensor* t : {r.mutable_k(), r.mutable_v()}) {
    t->set_dtype(v1::DTYPE_FP16);
    for (int d : {1, 5, 2, 8}) t->add_shape(d);
    t->set_data(std::string(1 * 5 * 2 * 8 * 2, 'a'));
  }
  auto ok = FromProto(r);
  ASSERT_TRUE(ok.ok()) << ok.status();
  EXPECT_EQ(ok->num_tokens, 5u);
  EXPECT_EQ(ok->num_kv_heads, 2u);
  EXPECT_EQ(ok->head_dim, 8u);
  EXPECT_EQ(ok->dtype, kernels::DType::kFp16);
  r.set_num_layers(2);  // shape[0] is 1
  EXPECT_EQ(FromProto(r).status().code(), absl::StatusCode::kInvalidArgument);
  r.set_num_layers(1);
  r.mutable_v()->set_dtype(v1::DTYPE_BF16);
  EXPECT_EQ(FromProto(r).status().code(), absl::StatusCode::kInvalidArgument);
}

// The method codec: unset fields take the method's defaults, every enum value it does not know
// is refused naming the field (vattention.target used to fall back to output silently), and a
// count out of range names its field.
TEST(ConvertTest, MethodDefaultsAndRefusals) {
  v1::Method m;
  absl::StatusOr<engine::Method> dense = FromProto(m);
  ASSERT_TRUE(dense.ok());
  EXPECT_EQ(dense->kind, engine::MethodKind::kDense);
  m.mutable_saap();
  absl::StatusOr<engine::Method> saap = FromProto(m);
  ASSERT_TRUE(saap.ok());
  EXPECT_EQ(saap->saap.probes, 8);
  m.mutable_vattention();
  absl::StatusOr<engine::Method> v = FromProto(m);
  ASSERT_TRUE(v.ok());
  EXPECT_EQ(v->vattention.predictor, kernels::TopKPredictor::kHash);
  EXPECT_EQ(v->vattention.target, kernels::VerifyTarget::kOutput);
  EXPECT_EQ(v->vattention.sampler, kernels::ResidualSampler::kUniform);
  struct Bad {
    const char* field;
    std::function<void(v1::Method*)> set;
  };
  const std::vector<Bad> bad = {
      {"santa.sampler",
       [](v1::Method* x) { x->mutable_santa()->set_sampler(static_cast<v1::SantaSampler>(99)); }},
      {"santa.samples", [](v1::Method* x) { x->mutable_santa()->set_samples(1u << 25); }},
      {"santa.bernoulli_mode",
       [](v1::Method* x) {
         x->mutable_santa()->set_bernoulli_mode(static_cast<v1::BernoulliQkMode>(9));
       }},
      {"top_k.scores",
       [](v1::Method* x) { x->mutable_top_k()->set_scores(static_cast<v1::ScoreSource>(9)); }},
      {"vattention.target",
       [](v1::Method* x) {
         x->mutable_vattention()->set_target(static_cast<v1::VerifyTarget>(9));
       }},
      {"vattention.bits", [](v1::Method* x) { x->mutable_vattention()->set_bits(512); }},
      {"hash_top_k.top_k", [](v1::Method* x) { x->mutable_hash_top_k()->set_top_k(2u << 30); }},
      {"saap.probes", [](v1::Method* x) { x->mutable_saap()->set_probes(1u << 21); }},
  };
  for (const Bad& b : bad) {
    v1::Method x;
    b.set(&x);
    absl::StatusOr<engine::Method> r = FromProto(x);
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << b.field;
    EXPECT_THAT(std::string(r.status().message()),
                ::testing::HasSubstr(std::string("method.") + b.field))
        << r.status();
  }
}

}  // namespace
}  // namespace kvsparse::rpc
