#include "rpc/security.h"

#include <cstdio>
#include <fstream>
#include <string>

#include "gtest/gtest.h"

namespace kvsparse::rpc {
namespace {

TEST(SecurityTest, LoopbackAddresses) {
  for (const char* a : {"127.0.0.1:50051", "127.1.2.3:0", "localhost:80", "[::1]:50051"}) {
    EXPECT_TRUE(IsLoopbackAddress(a)) << a;
  }
  for (const char* a : {"0.0.0.0:50051", "[::]:50051", "10.0.0.1:1", "example.com:443",
                        "128.0.0.1:1", "127.0.0:1", "[::1:1", "127.0.0.1.5:1"}) {
    EXPECT_FALSE(IsLoopbackAddress(a)) << a;
  }
}

TEST(SecurityTest, RolesCoverTheMethods) {
  for (const char* m :
       {"Gather", "Decode", "DecodeStream", "ListSequences", "GetSequenceInfo", "GetStats"}) {
    EXPECT_EQ(RoleNeeded(m), Role::kRead) << m;
  }
  for (const char* m : {"CreateSequence", "ForkSequence", "Append", "DropSequence"}) {
    EXPECT_EQ(RoleNeeded(m), Role::kWrite) << m;
  }
  EXPECT_EQ(RoleNeeded("SomethingNew"), Role::kAdmin);
}

TEST(SecurityTest, TokenFile) {
  auto auth = TokenAuth::Parse(
      "# comment\n\n  reader-0123456789abcdef  read \nwriter-0123456789abcdef write\n"
      "admin-0123456789abcdefg admin\n",
      "tokens");
  ASSERT_TRUE(auth.ok()) << auth.status();
  EXPECT_EQ((*auth)->size(), 3u);
  EXPECT_TRUE((*auth)->CheckToken("reader-0123456789abcdef", "Gather").ok());
  EXPECT_EQ((*auth)->CheckToken("reader-0123456789abcdef", "Append").status().code(),
            absl::StatusCode::kPermissionDenied);
  EXPECT_TRUE((*auth)->CheckToken("writer-0123456789abcdef", "DropSequence").ok());
  EXPECT_TRUE((*auth)->CheckToken("admin-0123456789abcdefg", "SomethingNew").ok());
  EXPECT_EQ((*auth)->CheckToken("writer-0123456789abcdeX", "Gather").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*auth)->CheckToken("writer-0123456789abcde", "Gather").status().code(),  // a prefix
            absl::StatusCode::kUnauthenticated);
  EXPECT_EQ((*auth)->CheckToken("", "Gather").status().code(), absl::StatusCode::kUnauthenticated);

  for (const char* bad :
       {"short read\n", "reader-0123456789abcdef reader\n", "reader-0123456789abcdef\n", "a b c\n",
        "# only comments\n", "reader-0123456789abcdef read\nreader-0123456789abcdef write\n"}) {
    auto r = TokenAuth::Parse(bad, "tokens");
    EXPECT_EQ(r.status().code(), absl::StatusCode::kInvalidArgument) << bad;
  }
  EXPECT_EQ(TokenAuth::Load("/nonexistent/tokens").status().code(), absl::StatusCode::kNotFound);
}

// Reload swaps a changed file in whole, keeps a kept token's in-flight count and its own table
// when the new file does not parse, and reports a bad text once.
// RFC 6750: the scheme is case-insensitive ("bearer <token>" was refused before), one or more
// spaces follow it, the token is taken as sent.
TEST(SecurityTest, BearerSchemeIsCaseInsensitive) {
  for (absl::string_view v : {"Bearer abc", "bearer abc", "BEARER abc", "bEaReR   abc"}) {
    absl::StatusOr<absl::string_view> t = BearerToken(v);
    ASSERT_TRUE(t.ok()) << v << ": " << t.status();
    EXPECT_EQ(*t, "abc") << v;
  }
  EXPECT_EQ(*BearerToken("Bearer AbC"), "AbC");
  for (absl::string_view v : {"", "Bearer", "Bearer ", "Bearerabc", "Basic abc", "Bearer\tabc"}) {
    EXPECT_EQ(BearerToken(v).status().code(), absl::StatusCode::kUnauthenticated) << v;
  }
}

TEST(SecurityTest, TokenFileReload) {
  const std::string path = ::testing::TempDir() + "/reload_tokens.txt";
  auto write = [&](const char* text) {
    std::ofstream f(path, std::ios::trunc);
    f << text;
  };
  write("old-0123456789abcdef read\nkept-0123456789abcdef write\n");
  auto auth = TokenAuth::Load(path);
  ASSERT_TRUE(auth.ok()) << auth.status();
  auto kept = (*auth)->CheckToken("kept-0123456789abcdef", "Append");
  ASSERT_TRUE(kept.ok());
  kept->in_flight->fetch_add(1);         // a call in flight across the reload
  EXPECT_EQ(*(*auth)->Reload(), false);  // unchanged

  write("new-0123456789abcdef read\nkept-0123456789abcdef write\n");
  EXPECT_EQ(*(*auth)->Reload(), true);
  EXPECT_EQ((*auth)->CheckToken("old-0123456789abcdef", "Gather").status().code(),
            absl::StatusCode::kUnauthenticated);
  EXPECT_TRUE((*auth)->CheckToken("new-0123456789abcdef", "Gather").ok());
  auto kept_after = (*auth)->CheckToken("kept-0123456789abcdef", "Append");
  ASSERT_TRUE(kept_after.ok());
  EXPECT_EQ(kept_after->in_flight, kept->in_flight);
  EXPECT_EQ(kept_after->in_flight->load(), 1u);

  write("new-0123456789abcdef reader\n");  // a bad role: the table stays
  EXPECT_EQ((*auth)->Reload().status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_EQ(*(*auth)->Reload(), false);  // the same bad text: said once
  EXPECT_TRUE((*auth)->CheckToken("new-0123456789abcdef", "Gather").ok());
  EXPECT_TRUE((*auth)->CheckToken("kept-0123456789abcdef", "Append").ok());
  EXPECT_EQ((*auth)->size(), 2u);

  std::remove(path.c_str());
  EXPECT_EQ((*auth)->Reload().status().code(), absl::StatusCode::kNotFound);
  EXPECT_TRUE((*auth)->CheckToken("new-0123456789abcdef", "Gather").ok());
  auto parsed = TokenAuth::Parse("new-0123456789abcdef read\n", "tokens");
  EXPECT_EQ((*parsed)->Reload().status().code(), absl::StatusCode::kFailedPrecondition);
}

TEST(SecurityTest, Tenants) {
  auto auth = TokenAuth::Parse("alice-0123456789abcdef write alice\nops-0123456789abcdefgh admin\n",
                               "tokens");
  ASSERT_TRUE(auth.ok()) << auth.status();
  auto alice = (*auth)->IdentifyToken("alice-0123456789abcdef");
  ASSERT_TRUE(alice.ok());
  EXPECT_EQ(alice->tenant, "alice");
  EXPECT_EQ(alice->role, Role::kWrite);
  EXPECT_EQ((*auth)->IdentifyToken("ops-0123456789abcdefgh")->tenant, "");
  auto checked = (*auth)->CheckToken("alice-0123456789abcdef", "Append");  // what RpcRunner uses
  ASSERT_TRUE(checked.ok()) << checked.status();
  EXPECT_EQ(checked->tenant, "alice");
  EXPECT_EQ(checked->role, Role::kWrite);
  EXPECT_EQ(ScopedId("alice", "s1"), "alice:s1");
  EXPECT_EQ(ScopedId("", "s1"), "s1");
  std::string id;
  EXPECT_TRUE(UnscopedId("alice", "alice:s1", &id));
  EXPECT_EQ(id, "s1");
  EXPECT_TRUE(UnscopedId("alice", "alice:bob:x", &id));  // her own id "bob:x"
  EXPECT_EQ(id, "bob:x");
  EXPECT_FALSE(UnscopedId("alice", "bob:s1", &id));
  EXPECT_FALSE(UnscopedId("alice", "alicex:s1", &id));
  EXPECT_FALSE(UnscopedId("alice", "alice:", &id));
  EXPECT_FALSE(UnscopedId("alice", "s1", &id));
  // Errors name a tenant's ids as it named them (issue 48: 'tenantB:a2' leaked before).
  const absl::Status scoped =
      absl::NotFoundError("sequence 'alice:s1' not found (and 'alice:s2'; 'bob:s3')");
  const absl::Status seen = UnscopedStatus("alice", scoped);
  EXPECT_EQ(seen.code(), absl::StatusCode::kNotFound);
  EXPECT_EQ(seen.message(), "sequence 's1' not found (and 's2'; 'bob:s3')");
  EXPECT_EQ(UnscopedStatus("", scoped), scoped);
  for (const char* bad : {"t-0123456789abcdefgh read a:b\n", "t-0123456789abcdefgh read a/b\n",
                          "t-0123456789abcdefgh read a b\n"}) {
    EXPECT_EQ(TokenAuth::Parse(bad, "tokens").status().code(), absl::StatusCode::kInvalidArgument)
        << bad;
  }
}

TEST(SecurityTest, TlsFilesAreCheckedAtStart) {
  TlsFiles f;
  f.cert = "/nonexistent/cert.pem";
  EXPECT_EQ(TlsServerCredentials(f).status().code(), absl::StatusCode::kInvalidArgument);
  f.key = "/nonexistent/key.pem";
  auto s = TlsServerCredentials(f);
  EXPECT_EQ(s.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.status().message().find("--tls_cert"), std::string::npos) << s.status();
  TlsFiles c;
  EXPECT_EQ(TlsChannelCredentials(c).status().code(), absl::StatusCode::kInvalidArgument);
  c.ca = testing::TempDir() + "/not-a-pem";  // exists, no PEM block
  std::ofstream(c.ca) << "hello\n";
  auto r = TlsChannelCredentials(c);
  EXPECT_NE(r.status().message().find("no PEM block"), std::string::npos) << r.status();
  // A client channel: plaintext without files; a key without a CA is refused, not ignored.
  auto plain = ChannelCredentialsFor(TlsFiles{});
  ASSERT_TRUE(plain.ok()) << plain.status();
  EXPECT_NE(*plain, nullptr);
  TlsFiles key_only;
  key_only.key = "/nonexistent/key.pem";
  EXPECT_EQ(ChannelCredentialsFor(key_only).status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(ChannelCredentialsFor(c).status().message().find("no PEM block"), std::string::npos);
}

// The checks TlsFileGuard runs before gRPC sees a file (the matching pair is exercised through
// the server in test_security.py, with certificates the openssl tool makes).
TEST(SecurityTest, CertificateChecksRefuseWhatIsNotAPair) {
  const std::string fake = "-----BEGIN CERTIFICATE-----\nZ2FyYmFnZQ==\n-----END CERTIFICATE-----\n";
  absl::Status s = CheckCertificates(fake);
  EXPECT_EQ(s.code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(s.message().find("no certificate"), std::string::npos) << s;
  EXPECT_EQ(CheckCertificates("").code(), absl::StatusCode::kInvalidArgument);
  TlsFiles f;
  f.cert = testing::TempDir() + "/fake-cert.pem";
  f.key = testing::TempDir() + "/fake-key.pem";
  std::ofstream(f.cert) << fake;
  std::ofstream(f.key) << "-----BEGIN PRIVATE KEY-----\nZ2FyYmFnZQ==\n-----END PRIVATE KEY-----\n";
  auto g = TlsFileGuard::Create(f);
  EXPECT_EQ(g.status().code(), absl::StatusCode::kInvalidArgument);
  EXPECT_NE(g.status().message().find("--tls_cert"), std::string::npos) << g.status();
  f.cert = "/nonexistent/cert.pem";
  EXPECT_EQ(TlsFileGuard::Create(f).status().code(), absl::StatusCode::kInvalidArgument);
}

}  // namespace
}  // namespace kvsparse::rpc
