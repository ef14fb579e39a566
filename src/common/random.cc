// Random values from getrandom(2) (see random.h).
#include "common/random.h"

#include <sys/random.h>

#include <cerrno>
#include <cstdio>
#include <cstdlib>

namespace kvbridge {

void random_bytes(void* data, size_t bytes) {
  auto* p = static_cast<unsigned char*>(data);
  while (bytes > 0) {
    const ssize_t n = ::getrandom(p, bytes, 0);
    if (n < 0 && errno == EINTR) continue;
    if (n <= 0) {
      std::perror("kvbridge: getrandom");
      std::abort();
    }
    p += n;
    bytes -= static_cast<size_t>(n);
  }
}

uint64_t random_nonzero_u64() {
  uint64_t v = 0;
  while (v == 0) random_bytes(&v, sizeof v);
  return v;
}

}  // namespace kvbridge
