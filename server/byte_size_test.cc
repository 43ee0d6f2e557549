// Size flags (--capacity and the other byte counts): K/M/G/T with or without Kubernetes' "i"
// and a trailing B, fractions, and their printing.
#include "server/byte_size.h"

#include <string>

#include "gtest/gtest.h"

namespace kvsparse::server {
namespace {

TEST(ByteSizeTest, ParsesUnits) {
  ByteSize b;
  std::string err;
  ASSERT_TRUE(AbslParseFlag("64K", &b, &err));
  EXPECT_EQ(b.bytes, 65536u);
  ASSERT_TRUE(AbslParseFlag("1.5g", &b, &err));
  EXPECT_EQ(b.bytes, 3ull << 29);
  ASSERT_TRUE(AbslParseFlag("4096", &b, &err));
  EXPECT_EQ(b.bytes, 4096u);
  for (const char* k8s : {"8Gi", "8GiB", "8gb", "8G"}) {  // Kubernetes' spelling too
    ASSERT_TRUE(AbslParseFlag(k8s, &b, &err)) << k8s << ": " << err;
    EXPECT_EQ(b.bytes, 8ull << 30) << k8s;
  }
  ASSERT_TRUE(AbslParseFlag("256Mi", &b, &err));
  EXPECT_EQ(b.bytes, 256ull << 20);
  ASSERT_TRUE(AbslParseFlag("4096B", &b, &err));
  EXPECT_EQ(b.bytes, 4096u);
  EXPECT_FALSE(AbslParseFlag("12i", &b, &err));
  EXPECT_FALSE(AbslParseFlag("Gi", &b, &err));
  EXPECT_FALSE(AbslParseFlag("lots", &b, &err));
  EXPECT_FALSE(AbslParseFlag("-1G", &b, &err));
  EXPECT_EQ(AbslUnparseFlag(ByteSize{8ull << 30}), "8G");
  EXPECT_EQ(AbslUnparseFlag(ByteSize{1000}), "1000");
}

}  // namespace
}  // namespace kvsparse::server
