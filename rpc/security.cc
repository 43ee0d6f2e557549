#include "rpc/security.h"

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/tls_certificate_provider.h>
#include <grpcpp/security/tls_credentials_options.h>
#include <openssl/bio.h>
#include <openssl/err.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/x509.h>
#include <stdlib.h>
#include <sys/stat.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

#include "absl/strings/ascii.h"
#include "absl/strings/match.h"
#include "absl/strings/numbers.h"
#include "absl/strings/str_cat.h"
#include "absl/strings/str_replace.h"
#include "absl/strings/str_split.h"
#include "absl/strings/strip.h"

namespace kvsparse::rpc {
namespace {

absl::StatusOr<std::string> ReadFile(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return absl::NotFoundError(absl::StrCat("cannot read ", path));
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}

// The file must exist and hold a PEM block (the watcher re-reads it; this catches a wrong path
// or a wrong file at start-up, with the flag's name, rather than at the first handshake).
absl::Status CheckPem(const std::string& path, absl::string_view what) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", text.status().message()));
  }
  if (!absl::StrContains(*text, "-----BEGIN ")) {
    return absl::InvalidArgumentError(absl::StrCat(what, ": ", path, " holds no PEM block"));
  }
  return absl::OkStatus();
}

unsigned int ReloadSeconds(absl::Duration d) {
  return static_cast<unsigned int>(std::max<int64_t>(1, absl::ToInt64Seconds(d)));
}

// Constant-time equality: the time depends on the lengths only, not on where they differ.
bool ConstantTimeEquals(absl::string_view a, absl::string_view b) {
  const size_t n = std::max(a.size(), b.size());
  unsigned char diff = a.size() == b.size() ? 0 : 1;
  for (size_t i = 0; i < n; ++i) {
    const unsigned char x = i < a.size() ? static_cast<unsigned char>(a[i]) : 0;
    const unsigned char y = i < b.size() ? static_cast<unsigned char>(b[i]) : 0;
    diff |= x ^ y;
  }
  return diff == 0;
}

}  // namespace

absl::Status CheckCertificates(absl::string_view cert_pem, absl::string_view key_pem) {
  struct Free {
    void operator()(BIO* b) const { BIO_free(b); }
    void operator()(X509* x) const { X509_free(x); }
    void operator()(EVP_PKEY* k) const { EVP_PKEY_free(k); }
  };
  auto bio = [](absl::string_view pem) {
    return std::unique_ptr<BIO, Free>(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  };
  std::unique_ptr<BIO, Free> cb = bio(cert_pem);
  std::unique_ptr<X509, Free> cert(PEM_read_bio_X509(cb.get(), nullptr, nullptr, nullptr));
  absl::Status status;
  if (cert == nullptr) {
    status = absl::InvalidArgumentError("no certificate in PEM form");
  } else if (!key_pem.empty()) {
    std::unique_ptr<BIO, Free> kb = bio(key_pem);
    std::unique_ptr<EVP_PKEY, Free> key(
        PEM_read_bio_PrivateKey(kb.get(), nullptr, nullptr, nullptr));
    if (key == nullptr) {
      status = absl::InvalidArgumentError("no private key in PEM form");
    } else if (X509_check_private_key(cert.get(), key.get()) != 1) {
      status = absl::InvalidArgumentError("the private key is not the certificate's");
    }
  }
  ERR_clear_error();  // OpenSSL's error queue is per thread: leave it empty
  return status;
}

absl::StatusOr<std::unique_ptr<TlsFileGuard>> TlsFileGuard::Create(const TlsFiles& files) {
  if (files.cert.empty() || files.key.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  std::unique_ptr<TlsFileGuard> g(new TlsFileGuard());
  g->files_ = files;
  // Memory first (/dev/shm: the key never reaches a disk, and it is writable in a container
  // whose root filesystem is read-only), then the temporary directory.
  std::error_code ec;
  std::vector<std::filesystem::path> candidates = {"/dev/shm"};
  if (std::filesystem::path t = std::filesystem::temp_directory_path(ec); !ec)
    candidates.push_back(t);
  std::string tried;
  for (const std::filesystem::path& base : candidates) {
    std::string tmpl = (base / "kvsparse-tls-XXXXXX").string();
    if (mkdtemp(tmpl.data()) != nullptr) {
      g->dir_ = tmpl;  // mkdtemp makes it 0700
      break;
    }
    absl::StrAppend(&tried, tried.empty() ? "" : ", ", base.string());
  }
  if (g->dir_.empty()) {
    return absl::InternalError(
        absl::StrCat("cannot make a private directory for the TLS files under ", tried));
  }
  g->served_ = files;
  g->served_.cert = g->dir_ + "/cert.pem";
  g->served_.key = g->dir_ + "/key.pem";
  if (!files.ca.empty()) g->served_.ca = g->dir_ + "/ca.pem";
  g->served_.reload = absl::Seconds(1);
  absl::StatusOr<bool> first = g->Reload();
  if (!first.ok()) return first.status();
  return g;
}

TlsFileGuard::~TlsFileGuard() {
  std::error_code ec;
  std::filesystem::remove_all(dir_, ec);
}

absl::StatusOr<bool> TlsFileGuard::Reload() {
  const char* names[3] = {"--tls_cert", "--tls_key", "--tls_client_ca"};
  const std::string* paths[3] = {&files_.cert, &files_.key, &files_.ca};
  std::string text[3];
  for (int i = 0; i < 3; ++i) {
    if (paths[i]->empty()) continue;
    absl::StatusOr<std::string> t = ReadFile(*paths[i]);
    if (!t.ok()) {  // reported once until it changes, as a refused text
      const std::string what = absl::StrCat(names[i], ": ", t.status().message());
      if (last_text_ == what) return false;
      last_text_ = what;
      return absl::InvalidArgumentError(what);
    }
    text[i] = *std::move(t);
  }
  std::string all =
      absl::StrCat(text[0].size(), ":", text[0], text[1].size(), ":", text[1], text[2]);
  if (all == last_text_) return false;
  last_text_ = std::move(all);
  if (absl::Status s = CheckCertificates(text[0], text[1]); !s.ok()) {
    return absl::InvalidArgumentError(
        absl::StrCat("--tls_cert ", files_.cert, " / --tls_key ", files_.key, ": ", s.message()));
  }
  if (!files_.ca.empty()) {
    if (absl::Status s = CheckCertificates(text[2]); !s.ok()) {
      return absl::InvalidArgumentError(
          absl::StrCat("--tls_client_ca ", files_.ca, ": ", s.message()));
    }
  }
  if (absl::Status s = Write(text[0], text[1], text[2]); !s.ok()) return s;
  return true;
}

absl::Status TlsFileGuard::Write(const std::string& cert, const std::string& key,
                                 const std::string& ca) {
  // Each copy is written aside and renamed over the old one, so gRPC never reads half a file.
  auto put = [&](const std::string& path, const std::string& text) -> absl::Status {
    const std::string tmp = path + ".new";
    std::FILE* f = std::fopen(tmp.c_str(), "wb");
    if (f == nullptr) return absl::InternalError(absl::StrCat("cannot write ", tmp));
    chmod(tmp.c_str(), 0600);
    const bool ok = std::fwrite(text.data(), 1, text.size(), f) == text.size();
    if (std::fclose(f) != 0 || !ok || std::rename(tmp.c_str(), path.c_str()) != 0) {
      return absl::InternalError(absl::StrCat("cannot write ", path));
    }
    return absl::OkStatus();
  };
  if (absl::Status s = put(served_.key, key); !s.ok()) return s;
  if (absl::Status s = put(served_.cert, cert); !s.ok()) return s;
  if (!served_.ca.empty()) return put(served_.ca, ca);
  return absl::OkStatus();
}

absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(const TlsFiles& f) {
  if (f.cert.empty() || f.key.empty()) {
    return absl::InvalidArgumentError("TLS needs both --tls_cert and --tls_key");
  }
  if (absl::Status s = CheckPem(f.cert, "--tls_cert"); !s.ok()) return s;
  if (absl::Status s = CheckPem(f.key, "--tls_key"); !s.ok()) return s;
  if (!f.ca.empty()) {
    if (absl::Status s = CheckPem(f.ca, "--tls_client_ca"); !s.ok()) return s;
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      f.key, f.cert, f.ca, ReloadSeconds(f.reload));
  grpc::experimental::TlsServerCredentialsOptions options(provider);
  options.watch_identity_key_cert_pairs();
  if (!f.ca.empty()) {
    options.watch_root_certs();
    options.set_cert_request_type(GRPC_SSL_REQUEST_AND_REQUIRE_CLIENT_CERTIFICATE_AND_VERIFY);
  } else {
    options.set_cert_request_type(GRPC_SSL_DONT_REQUEST_CLIENT_CERTIFICATE);
  }
  return grpc::experimental::TlsServerCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsChannelCredentials(const TlsFiles& f) {
  if (f.ca.empty()) return absl::InvalidArgumentError("TLS needs the server's CA certificate");
  if (f.cert.empty() != f.key.empty()) {
    return absl::InvalidArgumentError("a client certificate needs both its cert and its key");
  }
  if (absl::Status s = CheckPem(f.ca, "CA certificate"); !s.ok()) return s;
  if (!f.cert.empty()) {
    if (absl::Status s = CheckPem(f.cert, "client certificate"); !s.ok()) return s;
    if (absl::Status s = CheckPem(f.key, "client key"); !s.ok()) return s;
  }
  auto provider = std::make_shared<grpc::experimental::FileWatcherCertificateProvider>(
      f.key, f.cert, f.ca, ReloadSeconds(f.reload));
  grpc::experimental::TlsChannelCredentialsOptions options;
  options.set_certificate_provider(provider);
  options.watch_root_certs();
  if (!f.cert.empty()) options.watch_identity_key_cert_pairs();
  options.set_verify_server_certs(true);
  return grpc::experimental::TlsCredentials(options);
}

absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(const TlsFiles& f) {
  if (f.ca.empty() && f.cert.empty() && f.key.empty()) return grpc::InsecureChannelCredentials();
  return TlsChannelCredentials(f);
}

bool IsLoopbackAddress(absl::string_view listen) {
  absl::string_view host = listen;
  if (absl::ConsumePrefix(&host, "[")) {
    const size_t end = host.find(']');
    if (end == absl::string_view::npos) return false;
    return host.substr(0, end) == "::1";
  }
  const size_t colon = host.rfind(':');
  if (colon != absl::string_view::npos) host = host.substr(0, colon);
  if (host == "localhost") return true;
  // 127.0.0.0/8 in dotted decimal.
  std::vector<absl::string_view> parts = absl::StrSplit(host, '.');
  if (parts.size() != 4) return false;
  for (absl::string_view p : parts) {
    int v = 0;
    if (!absl::SimpleAtoi(p, &v) || v < 0 || v > 255) return false;
  }
  return parts[0] == "127";
}

absl::string_view RoleName(Role r) {
  switch (r) {
    case Role::kRead:
      return "read";
    case Role::kWrite:
      return "write";
    case Role::kAdmin:
      return "admin";
  }
  return "?";
}

Role RoleNeeded(absl::string_view method) {
  for (absl::string_view m : {"Gather", "GetPageTable", "GetDataPlane", "GetSequenceInfo",
                              "ListSequences", "GetStats", "Decode", "DecodeStream"}) {
    if (method == m) return Role::kRead;
  }
  for (absl::string_view m : {"CreateSequence", "ForkSequence", "Append", "DropSequence"}) {
    if (method == m) return Role::kWrite;
  }
  return Role::kAdmin;
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Load(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  absl::StatusOr<std::unique_ptr<TokenAuth>> auth = Parse(*text, path);
  if (!auth.ok()) return auth.status();
  (*auth)->path_ = path;
  absl::MutexLock lock(&(*auth)->reload_mu_);
  (*auth)->text_ = *std::move(text);
  return auth;
}

absl::StatusOr<std::unique_ptr<TokenAuth>> TokenAuth::Parse(absl::string_view text,
                                                            absl::string_view source) {
  absl::StatusOr<Entries> entries = ParseEntries(text, source);
  if (!entries.ok()) return entries.status();
  auto auth = std::unique_ptr<TokenAuth>(new TokenAuth());
  absl::MutexLock lock(&auth->mu_);
  auth->table_ = std::make_shared<const Entries>(*std::move(entries));
  return auth;
}

absl::StatusOr<bool> TokenAuth::Reload() {
  if (path_.empty()) return absl::FailedPreconditionError("tokens not loaded from a file");
  absl::MutexLock reload(&reload_mu_);
  absl::StatusOr<std::string> text = ReadFile(path_);
  if (!text.ok()) return text.status();
  if (*text == text_) return false;
  text_ = *text;
  absl::StatusOr<Entries> entries = ParseEntries(*text, path_);
  if (!entries.ok()) return entries.status();
  const std::shared_ptr<const Entries> old = Table();
  for (Entry& e : *entries) {
    for (const Entry& o : *old) {
      if (o.token == e.token) e.caller.in_flight = o.caller.in_flight;
    }
  }
  auto table = std::make_shared<const Entries>(*std::move(entries));
  absl::MutexLock lock(&mu_);
  table_ = std::move(table);
  return true;
}

absl::StatusOr<TokenAuth::Entries> TokenAuth::ParseEntries(absl::string_view text,
                                                           absl::string_view source) {
  Entries tokens;
  int line_no = 0;
  for (absl::string_view line : absl::StrSplit(text, '\n')) {
    ++line_no;
    line = absl::StripAsciiWhitespace(line);
    if (line.empty() || line[0] == '#') continue;
    std::vector<absl::string_view> f = absl::StrSplit(line, ' ', absl::SkipWhitespace());
    auto bad = [&](absl::string_view why) {
      return absl::InvalidArgumentError(absl::StrCat(source, ":", line_no, ": ", why));
    };
    if (f.size() != 2 && f.size() != 3) return bad("expected \"<token> <role> [tenant]\"");
    const absl::string_view token = f[0];
    if (token.size() < 16 || token.size() > 512) return bad("a token has 16..512 characters");
    for (char c : token) {
      if (c < 0x21 || c > 0x7e) return bad("a token is printable ASCII without spaces");
    }
    Caller caller;
    if (f[1] == "read") {
      caller.role = Role::kRead;
    } else if (f[1] == "write") {
      caller.role = Role::kWrite;
    } else if (f[1] == "admin") {
      caller.role = Role::kAdmin;
    } else {
      return bad(absl::StrCat("unknown role '", f[1], "' (read, write or admin)"));
    }
    if (f.size() == 3) {
      const absl::string_view t = f[2];
      const bool ok = !t.empty() && t.size() <= 64 && std::all_of(t.begin(), t.end(), [](char c) {
        return absl::ascii_isalnum(static_cast<unsigned char>(c)) || c == '.' || c == '_' ||
               c == '-';
      });
      if (!ok) return bad("a tenant is 1..64 of [A-Za-z0-9._-]");
      caller.tenant = std::string(t);
    }
    for (const Entry& e : tokens) {
      if (e.token == token) return bad("the same token twice");
    }
    caller.in_flight = std::make_shared<std::atomic<size_t>>(0);
    tokens.push_back({std::string(token), std::move(caller)});
  }
  if (tokens.empty()) return absl::InvalidArgumentError(absl::StrCat(source, ": no tokens"));
  return tokens;
}

absl::StatusOr<Caller> TokenAuth::Identify(const grpc::ServerContextBase& ctx) const {
  const auto& md = ctx.client_metadata();
  const auto it = md.find(kAuthMetadataKey);
  if (it == md.end()) {
    return absl::UnauthenticatedError(
        "this server requires a bearer token (metadata \"authorization: Bearer <token>\")");
  }
  absl::StatusOr<absl::string_view> token =
      BearerToken(absl::string_view(it->second.data(), it->second.size()));
  if (!token.ok()) return token.status();
  return IdentifyToken(*token);
}

absl::StatusOr<absl::string_view> BearerToken(absl::string_view authorization) {
  constexpr absl::string_view kScheme = "bearer";
  if (authorization.size() <= kScheme.size() ||
      !absl::EqualsIgnoreCase(authorization.substr(0, kScheme.size()), kScheme) ||
      authorization[kScheme.size()] != ' ') {
    return absl::UnauthenticatedError("the authorization metadata is not \"Bearer <token>\"");
  }
  absl::string_view token = authorization.substr(kScheme.size());
  while (absl::ConsumePrefix(&token, " ")) {
  }
  if (token.empty()) return absl::UnauthenticatedError("the authorization metadata has no token");
  return token;
}

absl::StatusOr<Caller> TokenAuth::IdentifyToken(absl::string_view token) const {
  // Every entry is compared, in constant time, whichever matches.
  const std::shared_ptr<const Entries> table = Table();
  const Entry* match = nullptr;
  for (const Entry& e : *table) {
    if (ConstantTimeEquals(e.token, token) && match == nullptr) match = &e;
  }
  if (match == nullptr) return absl::UnauthenticatedError("unknown bearer token");
  return match->caller;
}

absl::Status TokenAuth::Allows(const Caller& c, absl::string_view method) {
  const Role needed = RoleNeeded(method);
  if (static_cast<int>(c.role) < static_cast<int>(needed)) {
    return absl::PermissionDeniedError(absl::StrCat(method, " needs a token with role ",
                                                    RoleName(needed), "; this token's is ",
                                                    RoleName(c.role)));
  }
  return absl::OkStatus();
}

absl::StatusOr<Caller> TokenAuth::Check(const grpc::ServerContextBase& ctx,
                                        absl::string_view method) const {
  absl::StatusOr<Caller> c = Identify(ctx);
  if (!c.ok()) return c.status();
  if (absl::Status s = Allows(*c, method); !s.ok()) return s;
  return c;
}

absl::StatusOr<Caller> TokenAuth::CheckToken(absl::string_view token,
                                             absl::string_view method) const {
  absl::StatusOr<Caller> c = IdentifyToken(token);
  if (!c.ok()) return c.status();
  if (absl::Status s = Allows(*c, method); !s.ok()) return s;
  return c;
}

std::string ScopedId(absl::string_view tenant, absl::string_view id) {
  return tenant.empty() ? std::string(id) : absl::StrCat(tenant, ":", id);
}

absl::Status UnscopedStatus(absl::string_view tenant, const absl::Status& status) {
  if (tenant.empty() || status.ok()) return status;
  return absl::Status(status.code(), absl::StrReplaceAll(status.message(),
                                                         {{absl::StrCat("'", tenant, ":"), "'"}}));
}

bool UnscopedId(absl::string_view tenant, absl::string_view stored, std::string* id) {
  if (tenant.empty()) {
    *id = std::string(stored);
    return true;
  }
  if (stored.size() <= tenant.size() + 1 || !absl::StartsWith(stored, tenant) ||
      stored[tenant.size()] != ':') {
    return false;
  }
  *id = std::string(stored.substr(tenant.size() + 1));
  return true;
}

absl::StatusOr<std::string> ReadTokenFile(const std::string& path) {
  absl::StatusOr<std::string> text = ReadFile(path);
  if (!text.ok()) return text.status();
  absl::string_view first = *text;
  first = first.substr(0, first.find('\n'));
  first = absl::StripAsciiWhitespace(first);
  if (first.empty()) return absl::InvalidArgumentError(absl::StrCat(path, ": empty token file"));
  return std::string(first);
}

}  // namespace kvsparse::rpc
