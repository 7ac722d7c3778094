// Small durable-file helpers shared by every writer (checkpoints, safetensors files, the Hugging
// Face export directory): fsync a path, rename without replacing, unique suffixes for staging
// names.
#pragma once

#include <string>

#include "base/status.h"

namespace rs {

// fsyncs a file, or a directory when `directory` (IoError naming the path).
Status FsyncPath(const std::string& path, bool directory);
// Renames `from` to `to` without replacing an existing `to` (renameat2 RENAME_NOREPLACE; on
// file systems without it: check, then rename). AlreadyExists if `to` exists; IoError
// otherwise. Does not fsync.
Status RenameNoReplace(const std::string& from, const std::string& to);
// fsyncs the directory that holds `path` ("." for a bare name).
Status FsyncParentDir(const std::string& path);
// "<pid>-<16 random hex digits>": for staging names like "<dir>.tmp-<suffix>".
std::string UniqueSuffix();
// Creates `path` (AlreadyExists if it exists), writes `text`, fsyncs and closes it.
Status WriteNewFileDurably(const std::string& path, const std::string& text);
// Writes `text` to a new file next to `path`, fsyncs it and renames it over `path`: readers see
// the old file or the new one, never a part (for outputs that may be replaced, such as a
// picture). InvalidArgument if `path` is a directory; IoError naming the path otherwise.
Status ReplaceFileDurably(const std::string& path, const std::string& text);
// True if anything (even a dangling symlink) exists at `path`.
bool PathExists(const std::string& path);
// `dir` without trailing slashes ("/" stays).
std::string StripTrailingSlashes(std::string dir);
// Readies the place of a new output directory that every writer (checkpoints, DCP directories,
// Hugging Face exports) stages beside it and renames into place: InvalidArgument if `dir` is
// empty, AlreadyExists if anything is at `dir` (outputs are never overwritten), its parent
// directories created (IoError naming them).
Status PrepareNewOutputDir(const std::string& dir);

}  // namespace rs
