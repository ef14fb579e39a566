#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "cli.h"
#include "device/device.h"

namespace kvbridge::cli {

std::string version_text() {
  std::string out = std::string("kvbridge ") + KVB_VERSION + "\n";
  if (!device::cuda_compiled()) {
    out += "CUDA: not compiled in (a build with the CUDA toolkit adds cuda:N memory and the cuda_ipc transport)";
  } else {
    out += "CUDA: compiled in (runtime " + std::to_string(KVB_CUDART_VERSION / 1000) + "." +
           std::to_string(KVB_CUDART_VERSION % 1000 / 10) + ", kernels for " + KVB_CUDA_ARCHITECTURES + ")";
  }
  device::Device& d = device::current();
  Result<int> n = d.count();
  out += "\ndevice: ";
  if (d.name() == "fake") out += "the host fake (KVB_DEVICE=fake), ";
  out += n.ok() ? std::to_string(*n) + " device(s)" : n.error().message();
  return out;
}

Result<std::string> read_input(const std::string& path, size_t max_bytes) {
  std::ifstream file;
  std::istream* in = &std::cin;
  const std::string name = path == "-" ? "stdin" : "'" + path + "'";
  if (path != "-") {
    file.open(path, std::ios::binary);
    if (!file) return Status::io_error("cannot open '" + path + "': " + std::strerror(errno));
    in = &file;
  }
  // The bound holds while reading: a huge input is refused after max_bytes
  // + 1 bytes, never buffered whole.
  std::string text;
  char chunk[1 << 16];
  while (*in) {
    in->read(chunk, sizeof chunk);
    text.append(chunk, static_cast<size_t>(in->gcount()));
    if (text.size() > max_bytes) {
      return Status::resource_exhausted(name + " is larger than " + std::to_string(max_bytes >> 20) +
                                        " MiB, the most a kvbridge document may be");
    }
  }
  if (in->bad()) return Status::io_error("cannot read " + name);
  return text;
}

Result<std::string> read_secret(const std::string& file) {
  std::string secret;
  if (!file.empty()) {
    KVB_ASSIGN_OR_RETURN(secret, read_input(file, 4096));
    while (!secret.empty() && (secret.back() == '\n' || secret.back() == '\r')) secret.pop_back();
    if (secret.empty()) return Status::invalid_argument("secret file '" + file + "' is empty");
    return secret;
  }
  if (const char* env = std::getenv("KVBRIDGE_SECRET"); env != nullptr) secret = env;
  return secret;
}

int fail(const Status& status) {
  std::cerr << "kvbridge: " << status.to_string() << "\n";
  return kExitError;
}

namespace {

// A whole number (of at least 1 when `positive`): a sign, a fraction or
// trailing text is refused with what was given.
CLI::Validator whole_number(bool positive) {
  const std::string what = positive ? "a whole number of at least 1" : "a whole number";
  return CLI::Validator(
      [positive, what](std::string& v) -> std::string {
        const bool digits = !v.empty() && v.find_first_not_of("0123456789") == std::string::npos;
        const bool zero = digits && v.find_first_not_of('0') == std::string::npos;
        return digits && !(positive && zero) ? std::string() : "'" + v + "' is not " + what;
      },
      positive ? "UINT>0" : "UINT");
}

}  // namespace

CLI::Validator positive() { return whole_number(true); }
CLI::Validator non_negative() { return whole_number(false); }

}  // namespace kvbridge::cli
