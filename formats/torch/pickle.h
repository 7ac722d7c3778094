// A restricted reader of Python pickles (protocols 2 to 5), for the metadata of PyTorch
// Distributed Checkpoints (formats/torch/DCP.md): `.metadata` and the `data.pkl` of torch.save
// archives. It never executes anything. It interprets the opcodes into a value tree of plain
// records (None, bools, integers, floats, strings, bytes, tuples, lists, dicts, sets) in which
// a class or function the pickle names is a `kGlobal` node and "calling" it (REDUCE, NEWOBJ,
// NEWOBJ_EX) or restoring its state (BUILD) makes a `kObject` record holding the global, the
// arguments and the state — nothing is constructed, no Python code runs.
//
// Only globals on the caller's allowlist are accepted, and only those marked callable may be
// called; everything else is refused with DataLoss naming the input and the byte offset of the
// opcode: an unknown global (`os.system`, `builtins.eval`, ...), REDUCE of a global that is
// not callable or of anything that is not a global, persistent ids (PERSID, BINPERSID) unless
// the caller allows them, the extension registry (EXT1/2/4), out-of-band buffers, protocol 0/1
// text opcodes (INST, OBJ), a truncated stream, a length past the end of the input, an integer
// wider than 64 bits, a memo index that was never stored, stack underflow, a missing MARK, and
// more nodes than the limit. The reader is a loop over the input (no recursion), its memory is
// bounded by a constant times the input size, and its time is linear in it; a memo may make
// the tree a graph with shared nodes or even cycles (a list appended to itself), so consumers
// walk it with a depth bound (PickleToJson does).
#pragma once

#include <cstddef>
#include <cstdint>
#include <nlohmann/json_fwd.hpp>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "base/status.h"

namespace rs {

enum class PickleKind : std::uint8_t {
  kNone,
  kBool,
  kInt,  // fits int64 (LONG1 / LONG4 of up to 8 bytes)
  kFloat,
  kString,  // unicode: valid UTF-8 (invalid bytes are refused, as Python's unpickler refuses them)
  kBytes,   // bytes, bytearray, and protocol-2 "binstring"
  kTuple,
  kList,
  kDict,          // dict and collections.OrderedDict; items in insertion order
  kSet,           // set and frozenset
  kGlobal,        // a class or function named by GLOBAL / STACK_GLOBAL: `module`, `name`
  kObject,        // the result of calling a global: `cls` (a kGlobal node), `args`, `state`
  kPersistentId,  // BINPERSID / PERSID (only when allowed): `args` is the id value
};
std::string_view PickleKindName(PickleKind k);  // "none", "int", "tuple", ...

inline constexpr std::size_t kPickleNoNode = static_cast<std::size_t>(-1);

struct PickleNode {
  PickleKind kind = PickleKind::kNone;
  bool b = false;
  std::int64_t i = 0;
  double f = 0;
  std::string s;                       // kString, kBytes; kGlobal: the name; kObject: the class name
  std::string module;                  // kGlobal, kObject: the class's module
  std::vector<std::size_t> items;      // kTuple, kList, kSet: elements; kDict: key, value, key, ...
  std::size_t cls = kPickleNoNode;     // kObject: the kGlobal node
  std::size_t args = kPickleNoNode;    // kObject: the argument tuple; kPersistentId: the id
  std::size_t kwargs = kPickleNoNode;  // kObject from NEWOBJ_EX: the keyword dict
  std::size_t state = kPickleNoNode;   // kObject: the BUILD state, if any
  std::int64_t offset = 0;             // input offset of the opcode that made it, for messages
};

// One global the reader accepts. `callable`: REDUCE / NEWOBJ may apply it (making a kObject
// record, or for collections.OrderedDict / builtins.set / builtins.frozenset / builtins.dict
// the container itself); otherwise it may only appear as a value (e.g. `torch.float32`).
struct PickleGlobal {
  std::string_view module;
  std::string_view name;
  bool callable = false;
};

struct PickleOptions {
  std::span<const PickleGlobal> globals;  // the allowlist
  bool allow_persistent_ids = false;      // BINPERSID / PERSID (torch.save's storages)
  // Accept every global, allowlisted or not, as an inert name that calls only record (for
  // files whose contents we search but do not validate, such as Megatron's common.pt, whose
  // `args` hold classes of Megatron and argparse). Nothing is executed either way.
  bool inert_unknown_globals = false;
  std::int64_t max_nodes = std::int64_t{1} << 24;
};

class PickleTree {
 public:
  std::size_t root() const { return root_; }
  const PickleNode& node(std::size_t i) const { return nodes_[i]; }
  std::size_t size() const { return nodes_.size(); }
  // The node's kind and, for globals and objects, "module.name"; for messages.
  std::string Describe(std::size_t i) const;

 private:
  friend Result<PickleTree> Unpickle(std::span<const std::byte>, const PickleOptions&, const std::string&);
  std::vector<PickleNode> nodes_;
  std::size_t root_ = kPickleNoNode;
};

// Interprets `data` (one pickle, up to STOP; bytes after STOP are refused). `what` names the
// input (file and item) at the start of every message. Errors: DataLoss as described above.
Result<PickleTree> Unpickle(std::span<const std::byte> data, const PickleOptions& options, const std::string& what);

// The tree below `node` as JSON, for reports: strings and numbers as themselves (the bytes of a
// string that are not well-formed UTF-8 written as "\xNN", so the result always dumps), bytes as
// {"bytes": length}, tuples / lists / sets as arrays, dicts with string keys as objects (other
// keys: arrays of [key, value] pairs), globals as "module.name", objects as
// {"class": ..., "args": ..., "state": ...}. InvalidArgument when deeper than `max_depth`
// (also what a cycle gives) or larger than `max_nodes`.
Result<nlohmann::json> PickleToJson(const PickleTree& tree, std::size_t node, int max_depth = 32,
                                    std::int64_t max_nodes = 100000);

}  // namespace rs
