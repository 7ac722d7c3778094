// Text that came from a file (tensor names, paths, JSON parse errors quoting the bytes they
// stopped at) is untrusted: it may hold bytes that are not UTF-8, which a JSON writer must not
// emit, and control characters, which a terminal would obey. Everything the CLI prints goes
// through SafeText (cli/output.h); JSON output replaces invalid UTF-8 instead.
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace rs {

// Whether `s` is well-formed UTF-8 (no overlong forms, surrogates or code points past U+10FFFF).
bool IsValidUtf8(std::string_view s);

// `s` with every byte that is not part of a well-formed UTF-8 sequence written as "\xNN", and
// every control character (C0 except, with `keep_newlines`, '\n' and '\t'; DEL; C1 U+0080..U+009F)
// written as "\xNN" / "\u00NN". A backslash stays as it is. Valid printable UTF-8 is unchanged.
std::string SafeText(std::string_view s, bool keep_newlines = false);

// "1.50 GiB", "512 B": binary units, two decimals above bytes.
std::string HumanBytes(std::int64_t bytes);

}  // namespace rs
