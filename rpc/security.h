// Transport security and access control (docs/RELIABILITY.md, "Threat model"):
//   - TLS and mutual TLS from PEM files, for the server's port and for a client's channel (a
//     worker's to its store, the C++ clients'); the files are watched and re-read every
//     `reload` (gRPC's FileWatcherCertificateProvider): a renewed certificate is served to new
//     connections without a restart; the server's own files pass TlsFileGuard first, so a bad
//     one is refused and the last good pair kept;
//   - bearer tokens ("authorization: Bearer <token>" metadata) from a file, each with a role,
//     compared in constant time, checked for every call of both services in one place
//     (RpcRunner, server/rpc.h); grpc.health.v1 and reflection stay open (probes, tooling); the
//     token file may be re-read while serving (TokenAuth::Reload).
#ifndef KVSPARSE_RPC_SECURITY_H_
#define KVSPARSE_RPC_SECURITY_H_

#include <grpcpp/security/credentials.h>
#include <grpcpp/security/server_credentials.h>
#include <grpcpp/server_context.h>

#include <atomic>
#include <cstddef>
#include <memory>
#include <string>
#include <vector>

#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/strings/string_view.h"
#include "absl/synchronization/mutex.h"
#include "absl/time/time.h"

namespace kvsparse::rpc {

// PEM files. Server side: cert + key (its identity), ca: the CA that signs client certificates
// (set: mutual TLS, a client without a valid certificate is refused). Client side: ca: the CA
// that signs the server's certificate (set: TLS), cert + key: the client's identity (mTLS).
struct TlsFiles {
  std::string cert;
  std::string key;
  std::string ca;
  absl::Duration reload = absl::Seconds(60);  // how often the files are re-read
};

// INVALID_ARGUMENT naming the file when one cannot be read or holds no PEM block, or when cert
// and key are not given together. Server: cert and key required.
absl::StatusOr<std::shared_ptr<grpc::ServerCredentials>> TlsServerCredentials(const TlsFiles& f);
// Client: ca required (the server is verified, its name against the target's host); cert + key
// optional (mTLS).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> TlsChannelCredentials(const TlsFiles& f);
// A client channel's credentials from its files: plaintext when none of ca, cert and key is
// given, else TlsChannelCredentials (so a key or certificate without a CA is refused, not ignored).
absl::StatusOr<std::shared_ptr<grpc::ChannelCredentials>> ChannelCredentialsFor(const TlsFiles& f);

// INVALID_ARGUMENT naming what fails unless `cert_pem` holds at least one certificate,
// `key_pem` a private key, and the key is the first certificate's (OpenSSL). An empty `key_pem`
// checks the certificates alone (a CA file).
absl::Status CheckCertificates(absl::string_view cert_pem, absl::string_view key_pem = {});

// The server's TLS files, checked before gRPC reads them: gRPC watches copies in a private
// directory (mode 0700 under /dev/shm, in memory, or else the temporary directory) that hold
// only a certificate and key that parse and match
// (and a CA file that parses). Reload re-reads the operator's files and, when their text changed
// and passes, replaces the copies (gRPC re-reads them every second); when it fails, the copies
// keep the last good files, so a bad certificate never reaches a handshake. Not thread-safe: one
// reloader thread.
class TlsFileGuard {
 public:
  // INVALID_ARGUMENT (naming the flag) unless the files pass now.
  static absl::StatusOr<std::unique_ptr<TlsFileGuard>> Create(const TlsFiles& files);
  ~TlsFileGuard();  // removes the copies
  TlsFileGuard(const TlsFileGuard&) = delete;
  TlsFileGuard& operator=(const TlsFileGuard&) = delete;

  // The copies, for TlsServerCredentials (reload: 1 s).
  const TlsFiles& served() const { return served_; }
  // true: the files changed and passed, the copies were replaced; false: unchanged since the
  // last Reload or Create (a refused text is not refused again until it changes); an error:
  // they changed and fail, the copies are as they were.
  absl::StatusOr<bool> Reload();

 private:
  TlsFileGuard() = default;
  absl::Status Write(const std::string& cert, const std::string& key, const std::string& ca);

  TlsFiles files_;   // the operator's
  TlsFiles served_;  // the copies
  std::string dir_;
  std::string last_text_;  // cert + key + ca as last read (applied or refused)
};

// Whether a listen address (host:port) binds only the loopback interface: 127.0.0.0/8, [::1],
// localhost. 0.0.0.0, [::], other hosts: no.
bool IsLoopbackAddress(absl::string_view listen);

// What a call may do. Each role includes the ones below it.
enum class Role : int {
  // Gather, GetPageTable, GetDataPlane, GetSequenceInfo, ListSequences, GetStats, Decode,
  // DecodeStream
  kRead = 1,
  kWrite = 2,  // and CreateSequence, ForkSequence, Append, DropSequence
  kAdmin = 3,  // everything (the role operators' tools use)
};
absl::string_view RoleName(Role r);
// The role a method (its name as in the proto) needs; unknown methods need kAdmin.
Role RoleNeeded(absl::string_view method);

// The metadata key and prefix clients send a token in.
inline constexpr char kAuthMetadataKey[] = "authorization";
inline constexpr char kBearerPrefix[] = "Bearer ";
// The token of an authorization value "<scheme> <token>" whose scheme is "Bearer" in any case
// (RFC 6750 / RFC 7235: the scheme is case-insensitive), after one or more spaces; the token
// itself is taken as sent. UNAUTHENTICATED otherwise.
absl::StatusOr<absl::string_view> BearerToken(absl::string_view authorization);

// Tenants: a token may carry a tenant; its calls then see only the sequences of that tenant,
// stored as "<tenant>:<id>" (tenant names have no ':', so no id of one tenant is another's).
// A token without a tenant (operators' tools, a worker reading its store) sees the stored ids.
std::string ScopedId(absl::string_view tenant, absl::string_view id);
// The caller's id of a stored one; false when the stored id is not the tenant's.
bool UnscopedId(absl::string_view tenant, absl::string_view stored, std::string* id);
// A status as the tenant should read it: its message with the tenant's scoped ids ('t:id', the
// way every message quotes an id) as the caller named them ('id'). Without a tenant: unchanged.
absl::Status UnscopedStatus(absl::string_view tenant, const absl::Status& status);

struct Caller {
  Role role = Role::kAdmin;
  std::string tenant;  // empty: the whole namespace
  // The calls and streams in flight with this caller's token (RpcRunner's --max_calls_per_token):
  // one counter per token entry, shared by every call that carries it, so two tokens of one
  // tenant are counted apart. Null without tokens.
  std::shared_ptr<std::atomic<size_t>> in_flight;
};

// Thread-safe: Check/Identify run on every call while Reload may swap the table (one reloader at
// a time); a call sees the whole old table or the whole new one.
class TokenAuth {
 public:
  // A token file: one token per line, "<token> <role> [tenant]" (role: read, write or admin;
  // tenant: 1..64 of [A-Za-z0-9._-]), '#' comments and blank lines ignored; tokens of 16..512
  // printable characters, no spaces. INVALID_ARGUMENT naming the line for anything else,
  // NOT_FOUND without the file.
  static absl::StatusOr<std::unique_ptr<TokenAuth>> Load(const std::string& path);
  static absl::StatusOr<std::unique_ptr<TokenAuth>> Parse(absl::string_view text,
                                                          absl::string_view source);

  // The caller a call's token names: UNAUTHENTICATED for a missing, malformed or unknown token.
  absl::StatusOr<Caller> Identify(const grpc::ServerContextBase& ctx) const;
  absl::StatusOr<Caller> IdentifyToken(absl::string_view token) const;  // after "Bearer "
  // The caller, if the call's token is known and its role covers `method`; UNAUTHENTICATED
  // (above) or PERMISSION_DENIED for a role below the method's.
  absl::StatusOr<Caller> Check(const grpc::ServerContextBase& ctx, absl::string_view method) const;
  absl::StatusOr<Caller> CheckToken(absl::string_view token, absl::string_view method) const;
  size_t size() const { return Table()->size(); }

  // Re-reads the file Load read and, if its text changed since the last Reload (or Load), swaps
  // in the new table whole; a token in both keeps its in-flight count (Caller::in_flight).
  // Returns true if swapped, false if the text is unchanged; a file that cannot be read (NOT_FOUND)
  // or parsed (INVALID_ARGUMENT naming the line) leaves the old table in place, and a text that
  // failed to parse is not reported again until it changes. FAILED_PRECONDITION without a file
  // (Parse).
  absl::StatusOr<bool> Reload();

 private:
  struct Entry {
    std::string token;
    Caller caller;
  };
  using Entries = std::vector<Entry>;
  static absl::StatusOr<Entries> ParseEntries(absl::string_view text, absl::string_view source);
  static absl::Status Allows(const Caller& c, absl::string_view method);
  std::shared_ptr<const Entries> Table() const {
    absl::ReaderMutexLock lock(&mu_);
    return table_;
  }

  std::string path_;  // empty: made by Parse, nothing to reload
  mutable absl::Mutex mu_;
  std::shared_ptr<const Entries> table_ ABSL_GUARDED_BY(mu_);
  std::string text_ ABSL_GUARDED_BY(reload_mu_);  // the text last read (loaded or rejected)
  absl::Mutex reload_mu_;                         // one Reload at a time; taken before mu_
};

// A token from a file (its first line, trimmed): what clients and workers send.
absl::StatusOr<std::string> ReadTokenFile(const std::string& path);

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_SECURITY_H_
