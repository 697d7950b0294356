// Message building for exceptions: str("bucket ", b, " has ", n) concatenates strings, C
// strings, characters, integers and floating-point numbers into one std::string.
//
// Why not std::ostringstream: iostreams go through the C++ runtime's locale facets. On one
// machine (the extension built there with its own g++, loaded into torch's process) the first
// `stream << long` in an error path segfaulted inside the extension's copy of the formatting
// code, which had picked up a different facet (the backtrace showed a codecvt method called
// from ostream::_M_insert). std::to_string and snprintf stay in the C runtime, and messages
// need nothing more.
#pragma once

#include <cstdio>
#include <string>
#include <type_traits>

namespace fusedist {
namespace str_detail {

inline void append(std::string& out, const std::string& s) { out += s; }
inline void append(std::string& out, const char* s) { out += (s != nullptr ? s : "(null)"); }
inline void append(std::string& out, char c) { out += c; }

template <typename T>
typename std::enable_if<std::is_integral<T>::value>::type append(std::string& out, T v) {
  out += std::to_string(v);
}

template <typename T>
typename std::enable_if<std::is_floating_point<T>::value>::type append(std::string& out, T v) {
  char buf[64];
  std::snprintf(buf, sizeof(buf), "%g", static_cast<double>(v));
  out += buf;
}

}  // namespace str_detail

template <typename... Parts>
std::string str(const Parts&... parts) {
  std::string out;
  (str_detail::append(out, parts), ...);
  return out;
}

}  // namespace fusedist
