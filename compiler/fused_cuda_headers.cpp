// The headers NVRTC gets with each generated kernel (compiler/fused_cuda_codegen.h): the text of
// kernels/scalar_fn.h and compiler/fused_cuda_rtc.h, embedded at configure time (CMakeLists.txt
// writes kiln_rtc_headers.inc from the files, again whenever one changes).
#include <cstdio>

#include "compiler/fused_cuda_codegen.h"

namespace kiln::compiler::internal {

const std::vector<RtcHeader>& rtc_headers() {
  static const std::vector<RtcHeader> headers = {
#include "kiln_rtc_headers.inc"
  };
  return headers;
}

const std::string& rtc_headers_digest() {
  static const std::string digest = [] {
    uint64_t h = 0xcbf29ce484222325ull;  // FNV-1a over names and texts
    for (const RtcHeader& header : rtc_headers()) {
      for (std::string_view s : {header.name, header.text}) {
        for (unsigned char c : s) {
          h ^= c;
          h *= 0x100000001b3ull;
        }
        h ^= 0xff;
        h *= 0x100000001b3ull;
      }
    }
    char buf[17];
    std::snprintf(buf, sizeof(buf), "%016llx", static_cast<unsigned long long>(h));
    return std::string(buf);
  }();
  return digest;
}

}  // namespace kiln::compiler::internal
