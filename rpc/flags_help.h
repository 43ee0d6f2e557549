// --help for the programs' mains (kvsparse-server, the kvsparse CLI): --help, -h and --helpfull
// print the flags to stdout and exit 0 (Abseil's own handling exits 1). Call before
// absl::ParseCommandLine. --help lists the flags defined in files whose path contains
// `own_flags_file`, --helpfull every flag linked in. The human-readable printer is Abseil's
// (absl/flags/internal/usage.h).
#ifndef KVSPARSE_RPC_FLAGS_HELP_H_
#define KVSPARSE_RPC_FLAGS_HELP_H_

#include <cstdlib>
#include <iostream>

#include "absl/flags/internal/program_name.h"
#include "absl/flags/internal/usage.h"
#include "absl/flags/usage.h"
#include "absl/strings/match.h"
#include "absl/strings/string_view.h"

namespace kvsparse::rpc {

inline void HandleHelp(int argc, char** argv, absl::string_view own_flags_file) {
  for (int i = 1; i < argc; ++i) {
    const absl::string_view a = argv[i];
    if (a == "--help" || a == "-help" || a == "-h" || a == "--helpfull" || a == "-helpfull") {
      absl::flags_internal::SetProgramInvocationName(argv[0]);
      absl::flags_internal::FlagsHelp(std::cout, absl::StrContains(a, "full") ? "" : own_flags_file,
                                      absl::flags_internal::HelpFormat::kHumanReadable,
                                      absl::ProgramUsageMessage());
      std::exit(0);
    }
  }
}

}  // namespace kvsparse::rpc

#endif  // KVSPARSE_RPC_FLAGS_HELP_H_
