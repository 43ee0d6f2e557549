#include "rpc/method_text.h"

#include <gtest/gtest.h>

#include <string>

#include "absl/strings/match.h"
#include "google/protobuf/descriptor.h"
#include "google/protobuf/util/message_differencer.h"

namespace kvsparse::rpc {
namespace {

namespace pb = google::protobuf;

// The proto is the text form's schema: every parameter of every method has a default that
// parses, and every enum value a method reads, UNSPECIFIED aside, has a word.
TEST(MethodTextTest, EveryParameterHasADefaultAndEveryValueAWord) {
  const pb::OneofDescriptor& kinds = *v1::Method::descriptor()->FindOneofByName("kind");
  ASSERT_EQ(MethodNames().size(), static_cast<size_t>(kinds.field_count()));
  for (const std::string& name : MethodNames()) {
    absl::StatusOr<v1::Method> m = MethodFromText(name);
    ASSERT_TRUE(m.ok()) << name << ": " << m.status();
    EXPECT_EQ(MethodText(*m), name);
    const pb::Descriptor& d = *v1::Method::descriptor()->FindFieldByName(name)->message_type();
    for (int i = 0; i < d.field_count(); ++i) {
      const pb::FieldDescriptor& f = *d.field(i);
      EXPECT_FALSE(f.options().GetExtension(v1::text_default).empty()) << name << "." << f.name();
      if (f.enum_type() == nullptr) continue;
      for (int j = 1; j < f.enum_type()->value_count(); ++j) {
        EXPECT_FALSE(f.enum_type()->value(j)->options().GetExtension(v1::text_word).empty())
            << f.enum_type()->value(j)->name();
      }
    }
  }
}

TEST(MethodTextTest, FieldsLeftOutTakeTheirDefaults) {
  absl::StatusOr<v1::Method> t = MethodFromText("top_k");
  ASSERT_TRUE(t.ok()) << t.status();
  EXPECT_EQ(t->top_k().top_k_fraction(), 1.f / 32);
  EXPECT_EQ(t->top_k().sink_tokens(), 128u);
  EXPECT_EQ(t->top_k().scores(), v1::SCORE_SOURCE_COMPRESSED_KEYS);
  absl::StatusOr<v1::Method> s =
      MethodFromText(" santa : samples = 64, allocation=flash ,scores=compressed,proposal=group ");
  ASSERT_TRUE(s.ok()) << s.status();
  EXPECT_EQ(s->santa().samples(), 64u);
  EXPECT_EQ(s->santa().allocation(), v1::SANTA_ALLOCATION_FLASH);
  EXPECT_EQ(s->santa().scores(), v1::SCORE_SOURCE_COMPRESSED_KEYS);
  EXPECT_EQ(s->santa().proposal(), v1::SANTA_PROPOSAL_GROUP);
  EXPECT_EQ(s->santa().sampler(), v1::SANTA_SAMPLER_SYSTEMATIC);  // a default
  EXPECT_EQ(s->santa().correction(), v1::SANTA_CORRECTION_RATIO);
  absl::StatusOr<v1::Method> v = MethodFromText("vattention:bound=clt-ratio,source=learned");
  ASSERT_TRUE(v.ok()) << v.status();
  EXPECT_EQ(v->vattention().bound(), v1::BUDGET_BOUND_CLT_RATIO);
  EXPECT_EQ(v->vattention().source(), v1::SIGNATURE_SOURCE_LEARNED);
  EXPECT_EQ(v->vattention().epsilon(), 0.05f);
  EXPECT_TRUE(MethodFromText("dense")->has_dense());
}

TEST(MethodTextTest, EveryProblemIsNamedAtOnce) {
  absl::StatusOr<v1::Method> m =
      MethodFromText("santa:samples=-1,allocation=nope,bogus=1,tile_size=3,tile_size=4,scores");
  ASSERT_EQ(m.status().code(), absl::StatusCode::kInvalidArgument);
  const std::string msg(m.status().message());
  for (const char* want : {"samples='-1' is not an unsigned integer",
                           "allocation='nope' is not one of global, prop, flash",
                           "'bogus=1' is not field=value of sampler, allocation, samples",
                           "tile_size is given twice", "'scores' is not field=value"}) {
    EXPECT_TRUE(absl::StrContains(msg, want)) << want << " in " << msg;
  }
  absl::StatusOr<v1::Method> unknown = MethodFromText("topk:top_k=3");
  ASSERT_FALSE(unknown.ok());
  EXPECT_TRUE(
      absl::StrContains(unknown.status().message(),
                        "unknown method 'topk': one of dense, santa, hash_top_k, vattention, "
                        "saap, top_k"))
      << unknown.status();
  EXPECT_FALSE(MethodFromText("vattention:epsilon=inf").ok());
  EXPECT_FALSE(MethodFromText("vattention:epsilon=nan").ok());
}

// MethodText writes what differs from the defaults, and reads back as the same method.
TEST(MethodTextTest, TextReadsBackAsTheSameMethod) {
  for (const char* text : {"santa:samples=256,allocation=prop,scores=compressed",
                           "vattention:epsilon=0.333333343,predictor=compressed,sampler=importance",
                           "hash_top_k:top_k_fraction=0.0125,sink_tokens=0,source=learned",
                           "top_k:top_k=7,scores=exact", "saap:probes=4"}) {
    absl::StatusOr<v1::Method> m = MethodFromText(text);
    ASSERT_TRUE(m.ok()) << text << ": " << m.status();
    const std::string again = MethodText(*m);
    absl::StatusOr<v1::Method> back = MethodFromText(again);
    ASSERT_TRUE(back.ok()) << again << ": " << back.status();
    EXPECT_TRUE(pb::util::MessageDifferencer::Equals(*m, *back)) << text << " -> " << again;
  }
  EXPECT_EQ(MethodText(*MethodFromText("santa:samples=256,allocation=prop")), "santa:samples=256");
  v1::Method third;
  third.mutable_vattention()->set_epsilon(1.f / 3);
  absl::StatusOr<v1::Method> back = MethodFromText(MethodText(third));
  ASSERT_TRUE(back.ok()) << back.status();
  EXPECT_EQ(back->vattention().epsilon(), 1.f / 3);  // the float exactly
  EXPECT_EQ(MethodText(v1::Method{}), "dense");
}

// A request built field by field reads its UNSPECIFIED enums as the text defaults (the server's
// reading, rpc/convert.cc), and keeps every other value.
TEST(MethodTextTest, UnsetWordsReadAsTheTextDefaults) {
  v1::Method m;
  m.mutable_santa()->set_samples(5);
  m.mutable_santa()->set_allocation(v1::SANTA_ALLOCATION_FLASH);
  FillUnsetWords(&m);
  EXPECT_EQ(m.santa().samples(), 5u);
  EXPECT_EQ(m.santa().tile_size(), 0u);  // not an enum: 0 is its value
  EXPECT_EQ(m.santa().allocation(), v1::SANTA_ALLOCATION_FLASH);
  EXPECT_EQ(m.santa().sampler(), v1::SANTA_SAMPLER_SYSTEMATIC);
  EXPECT_EQ(m.santa().scores(), v1::SCORE_SOURCE_EXACT);
  EXPECT_EQ(m.santa().proposal(), v1::SANTA_PROPOSAL_PER_HEAD);
  v1::Method t;
  t.mutable_top_k();
  FillUnsetWords(&t);
  EXPECT_EQ(t.top_k().scores(), v1::SCORE_SOURCE_COMPRESSED_KEYS);  // top_k's own default
  EXPECT_EQ(t.top_k().sink_tokens(), 0u);
  v1::Method none;
  FillUnsetWords(&none);
  EXPECT_EQ(none.kind_case(), v1::Method::KIND_NOT_SET);
}

// What each method reads, from the proto's method_reads and value_reads (the integration test
// AttentionServiceTest.PlacementForServesEveryMethod decodes with these through a server).
TEST(MethodTextTest, PlacementForSaysWhatEachMethodReads) {
  auto placement = [](const char* text) {
    absl::StatusOr<v1::Method> m = MethodFromText(text);
    EXPECT_TRUE(m.ok()) << text << ": " << m.status();
    return PlacementFor(*m, 64, 4);
  };
  EXPECT_EQ(placement("dense").ByteSizeLong(), 0u);
  EXPECT_EQ(placement("santa").k_tier(), v1::TIER_DEVICE);  // exact scores: every key
  EXPECT_EQ(placement("santa:scores=compressed").compressed_key_bits(), 4u);
  EXPECT_EQ(placement("santa:scores=compressed").k_tier(), v1::TIER_UNSPECIFIED);
  EXPECT_EQ(placement("hash_top_k").signature_bits(), 64u);            // the deployment's bits
  EXPECT_EQ(placement("hash_top_k:bits=128").signature_bits(), 128u);  // the method's own
  EXPECT_EQ(placement("vattention").signature_bits(), 64u);            // the hash predictor
  EXPECT_EQ(placement("vattention:predictor=exact").k_tier(), v1::TIER_DEVICE);
  EXPECT_EQ(placement("vattention:predictor=compressed").compressed_key_bits(), 4u);
  EXPECT_EQ(placement("saap").signature_bits(), 32u);  // each key's bucket
  EXPECT_EQ(placement("top_k").compressed_key_bits(), 4u);
  EXPECT_EQ(placement("top_k:scores=exact").k_tier(), v1::TIER_DEVICE);
  // A message built field by field: UNSPECIFIED reads as the default (top_k: compressed keys).
  v1::Method raw;
  raw.mutable_top_k();
  EXPECT_EQ(PlacementFor(raw).compressed_key_bits(), 2u);
}

}  // namespace
}  // namespace kvsparse::rpc
