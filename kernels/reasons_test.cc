// Validation that names every reason at once (kernels/reasons.h): the collector itself and the
// methods' parameter checks built on it.
#include "kernels/reasons.h"

#include <gtest/gtest.h>

#include "absl/strings/match.h"
#include "kernels/hash_topk.h"
#include "kernels/saap.h"
#include "kernels/santa.h"
#include "kernels/vattention.h"

namespace kvsparse::kernels {
namespace {

TEST(Reasons, NoneIsOkAndSeveralAreOneErrorInTheirOrder) {
  Reasons none;
  none.AddIf(false, "never");
  EXPECT_TRUE(none.ToStatus().ok());

  Reasons two;
  two.AddIf(true, "a ", 1);
  two.Add(absl::OkStatus());
  two.AddIf(true, "b");
  EXPECT_EQ(two.ToStatus(), absl::InvalidArgumentError("a 1; b"));

  // The first reason's status gives the code; the constructor's otherwise.
  Reasons from_status;
  from_status.Add(absl::FailedPreconditionError("no GPU path"));
  from_status.AddIf(true, "also this");
  EXPECT_EQ(from_status.ToStatus(), absl::FailedPreconditionError("no GPU path; also this"));
  Reasons coded(absl::StatusCode::kFailedPrecondition);
  coded.AddIf(true, "x");
  coded.Add(absl::InvalidArgumentError("y"));
  EXPECT_EQ(coded.ToStatus(), absl::FailedPreconditionError("x; y"));
}

void ExpectEvery(const absl::Status& s, std::initializer_list<const char*> reasons) {
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument) << s;
  for (const char* r : reasons) EXPECT_TRUE(absl::StrContains(s.message(), r)) << r << " in " << s;
}

TEST(Reasons, EachMethodsParametersNameEveryProblem) {
  VAttentionParams v;
  v.epsilon = 2.f;
  v.delta = 0.f;
  v.fixed.sink_tokens = -1;
  v.predictor = TopKPredictor::kHash;
  v.sampler = ResidualSampler::kImportance;
  ExpectEvery(ValidateVAttentionParams(v),
              {"epsilon must be in (0, 1), got 2", "delta must be in (0, 1), got 0",
               "sink_tokens -1 < 0", "importance sampling needs a score for every token"});

  SantaParams s;
  s.samples = 0;
  s.allocation = SantaAllocation::kProp;
  s.tile_size = 0;
  s.bernoulli_qk_samples = -2;
  ExpectEvery(ValidateSantaParams(s), {"samples (S) must be >= 1, got 0", "tile_size must be >= 1",
                                       "bernoulli_qk_samples must be >= 0, got -2"});

  HashTopKParams h;
  h.fixed.local_tokens = -3;
  h.fixed.top_k = -1;
  ExpectEvery(ValidateHashTopKParams(h), {"local_tokens -3 < 0", "top_k -1 < 0"});

  SaapWeights w;
  w.clusters = 4;
  SaapParams a;
  a.probes = 9;
  a.sink_tokens = -1;
  a.local_tokens = -1;
  ExpectEvery(ValidateSaapParams(a, w),
              {"probes must be in [1, 4]", "sink_tokens -1 < 0", "local_tokens -1 < 0"});
}

}  // namespace
}  // namespace kvsparse::kernels
