#include <cerrno>
#include <cstring>
#include <fstream>
#include <iostream>
#include <iterator>
#include <sstream>

#include "cli.h"

namespace kvbridge::cli {

Result<std::string> read_input(const std::string& path) {
  std::ostringstream text;
  if (path == "-") {
    text << std::cin.rdbuf();
    if (std::cin.bad()) return Status::io_error("cannot read stdin");
    return text.str();
  }
  std::ifstream in(path, std::ios::binary);
  if (!in) return Status::io_error("cannot open '" + path + "': " + std::strerror(errno));
  text << in.rdbuf();
  if (in.bad()) return Status::io_error("cannot read '" + path + "'");
  return text.str();
}

int fail(const Status& status) {
  std::cerr << "kvbridge: " << status.to_string() << "\n";
  return kExitError;
}

}  // namespace kvbridge::cli
