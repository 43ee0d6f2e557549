// What a binary was built from: the project's version, the git commit (with "-dirty" when the
// tree had uncommitted changes; "unknown" outside a git checkout) and whether its CUDA kernels
// were built. Printed by --version of kvsparse-server and kvsparse and exported as the
// kvsparse_build_info metric. The definitions are generated at build time
// (cmake/KvsparseBuildInfo.cmake).
#ifndef KVSPARSE_RPC_BUILD_INFO_H_
#define KVSPARSE_RPC_BUILD_INFO_H_

#include <string>

namespace kvsparse {

const char* BuildVersion();
const char* BuildCommit();
bool BuildCuda();

// "<program> 0.1.0 (commit 1a2b3c4d5e6f, CUDA on)": what --version prints.
inline std::string BuildInfoLine(const std::string& program) {
  return program + " " + BuildVersion() + " (commit " + BuildCommit() + ", CUDA " +
         (BuildCuda() ? "on" : "off") + ")";
}

}  // namespace kvsparse

#endif  // KVSPARSE_RPC_BUILD_INFO_H_
