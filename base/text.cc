#include "base/text.h"

#include <cstdint>
#include <cstdio>
#include <iterator>

namespace rs {
namespace {

// Length of the well-formed UTF-8 sequence starting at s[i] (1..4), or 0 if there is none
// (RFC 3629: no overlong forms, no surrogates, nothing past U+10FFFF).
std::size_t Utf8Length(std::string_view s, std::size_t i, std::uint32_t* cp) {
  const auto b = [&](std::size_t k) { return static_cast<unsigned char>(s[i + k]); };
  const unsigned char c = b(0);
  if (c < 0x80) {
    *cp = c;
    return 1;
  }
  std::size_t n = 0;
  std::uint32_t v = 0;
  unsigned char lo = 0x80, hi = 0xBF;  // allowed range of the second byte
  if (c >= 0xC2 && c <= 0xDF) {
    n = 2;
    v = c & 0x1Fu;
  } else if (c >= 0xE0 && c <= 0xEF) {
    n = 3;
    v = c & 0x0Fu;
    if (c == 0xE0) lo = 0xA0;  // overlong
    if (c == 0xED) hi = 0x9F;  // surrogates
  } else if (c >= 0xF0 && c <= 0xF4) {
    n = 4;
    v = c & 0x07u;
    if (c == 0xF0) lo = 0x90;  // overlong
    if (c == 0xF4) hi = 0x8F;  // past U+10FFFF
  } else {
    return 0;
  }
  if (i + n > s.size()) return 0;
  for (std::size_t k = 1; k < n; ++k) {
    const unsigned char t = b(k);
    if (k == 1 ? (t < lo || t > hi) : (t < 0x80 || t > 0xBF)) return 0;
    v = (v << 6) | (t & 0x3Fu);
  }
  *cp = v;
  return n;
}

void AppendHex(std::string& out, const char* prefix, unsigned v, int digits) {
  char buf[16];
  std::snprintf(buf, sizeof buf, "%s%0*X", prefix, digits, v);
  out += buf;
}

}  // namespace

bool IsValidUtf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    std::uint32_t cp = 0;
    const std::size_t n = Utf8Length(s, i, &cp);
    if (n == 0) return false;
    i += n;
  }
  return true;
}

std::string SafeText(std::string_view s, bool keep_newlines) {
  std::string out;
  out.reserve(s.size());
  for (std::size_t i = 0; i < s.size();) {
    std::uint32_t cp = 0;
    const std::size_t n = Utf8Length(s, i, &cp);
    if (n == 0) {
      AppendHex(out, "\\x", static_cast<unsigned char>(s[i]), 2);
      ++i;
      continue;
    }
    if (cp < 0x20 || cp == 0x7F) {
      if (keep_newlines && (cp == '\n' || cp == '\t')) {
        out += static_cast<char>(cp);
      } else {
        AppendHex(out, "\\x", cp, 2);
      }
    } else if (cp >= 0x80 && cp <= 0x9F) {
      AppendHex(out, "\\u", cp, 4);  // C1 controls (e.g. U+009B, the 8-bit CSI)
    } else {
      out.append(s.substr(i, n));
    }
    i += n;
  }
  return out;
}

std::string HumanBytes(std::int64_t bytes) {
  const char* units[] = {"B", "KiB", "MiB", "GiB", "TiB"};
  auto v = static_cast<double>(bytes);
  std::size_t u = 0;
  while (v >= 1024.0 && u + 1 < std::size(units)) {
    v /= 1024.0;
    ++u;
  }
  char buf[32];
  std::snprintf(buf, sizeof buf, u == 0 ? "%.0f %s" : "%.2f %s", v, units[u]);
  return buf;
}

}  // namespace rs
