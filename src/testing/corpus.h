// testing/corpus.h: the seed corpora of the fuzz targets, written and
// checked by the unit tests of each decoder.
//
// A decoder's test builds its seeds (valid inputs of every kind) and calls
// seed_corpus(): with KVB_WRITE_CORPUS=DIR in the environment it writes them
// to DIR/<target>/ (scripts/corpus.sh does this for every target, into
// fuzz/corpus/); either way it returns the seeds checked in under
// fuzz/corpus/<target>/, so the test can check that each still decodes and
// the corpus cannot rot when a format changes. Header-only, for tests.
#pragma once

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#ifndef KVB_SOURCE_DIR
#error "KVB_SOURCE_DIR must name the source tree (kvb_test defines it)"
#endif

namespace kvbridge::testing {

using Seeds = std::vector<std::pair<std::string, std::string>>;  // (file name, bytes)

inline Seeds seed_corpus(std::string_view target, const Seeds& seeds) {
  namespace fs = std::filesystem;
  if (const char* dir = std::getenv("KVB_WRITE_CORPUS"); dir != nullptr) {
    const fs::path out = fs::path(dir) / target;
    fs::create_directories(out);
    for (const auto& [name, bytes] : seeds) std::ofstream(out / name, std::ios::binary) << bytes;
  }
  Seeds checked_in;
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(fs::path(KVB_SOURCE_DIR) / "fuzz" / "corpus" / target, ec)) {
    std::ifstream in(entry.path(), std::ios::binary);
    checked_in.emplace_back(entry.path().filename().string(),
                            std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
  }
  return checked_in;
}

}  // namespace kvbridge::testing
