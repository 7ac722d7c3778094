#include "formats/torch/pickle.h"

#include <bit>
#include <cstring>
#include <nlohmann/json.hpp>
#include <unordered_map>

#include "base/memory.h"
#include "base/text.h"

namespace rs {
namespace {

// Pickle opcodes (Python's Lib/pickle.py). Only those interpreted, or refused by name, are
// listed; any other byte is an unknown opcode.
enum Op : unsigned char {
  kMark = '(',
  kStop = '.',
  kPop = '0',
  kPopMark = '1',
  kDup = '2',
  kFloat = 'F',
  kInt = 'I',
  kBinInt = 'J',
  kBinInt1 = 'K',
  kLong = 'L',
  kBinInt2 = 'M',
  kNone = 'N',
  kPersId = 'P',
  kBinPersId = 'Q',
  kReduce = 'R',
  kString = 'S',
  kBinString = 'T',
  kShortBinString = 'U',
  kUnicode = 'V',
  kBinUnicode = 'X',
  kAppend = 'a',
  kBuild = 'b',
  kGlobal = 'c',
  kDict = 'd',
  kEmptyDict = '}',
  kAppends = 'e',
  kGet = 'g',
  kBinGet = 'h',
  kInst = 'i',
  kLongBinGet = 'j',
  kList = 'l',
  kEmptyList = ']',
  kObj = 'o',
  kPut = 'p',
  kBinPut = 'q',
  kLongBinPut = 'r',
  kSetItem = 's',
  kTuple = 't',
  kEmptyTuple = ')',
  kSetItems = 'u',
  kBinFloat = 'G',
  kBinBytes = 'B',
  kShortBinBytes = 'C',
  kProto = 0x80,
  kNewObj = 0x81,
  kExt1 = 0x82,
  kExt2 = 0x83,
  kExt4 = 0x84,
  kTuple1 = 0x85,
  kTuple2 = 0x86,
  kTuple3 = 0x87,
  kNewTrue = 0x88,
  kNewFalse = 0x89,
  kLong1 = 0x8a,
  kLong4 = 0x8b,
  kShortBinUnicode = 0x8c,
  kBinUnicode8 = 0x8d,
  kBinBytes8 = 0x8e,
  kEmptySet = 0x8f,
  kAddItems = 0x90,
  kFrozenSet = 0x91,
  kNewObjEx = 0x92,
  kStackGlobal = 0x93,
  kMemoize = 0x94,
  kFrame = 0x95,
  kByteArray8 = 0x96,
  kNextBuffer = 0x97,
  kReadonlyBuffer = 0x98,
};

// Longest module or name a GLOBAL line may have (Python identifiers of real modules are far
// shorter); bounds the search for the newline.
constexpr std::size_t kMaxGlobalLine = 1024;

class Machine {
 public:
  Machine(std::span<const std::byte> data, const PickleOptions& o, const std::string& what,
          std::vector<PickleNode>& nodes)
      : data_(data), o_(o), what_(what), nodes_(nodes) {}

  Result<std::size_t> Run() {
    while (true) {
      op_at_ = pos_;
      if (pos_ >= data_.size()) return Err("the pickle ends without STOP (truncated)");
      const auto op = static_cast<unsigned char>(data_[pos_++]);
      Status st = Step(op);
      if (!st.ok()) return st;
      if (stopped_) {
        if (pos_ != data_.size()) {
          op_at_ = pos_;
          return Err(std::to_string(data_.size() - pos_) + " bytes follow the STOP opcode");
        }
        return result_;
      }
    }
  }

 private:
  Status Err(const std::string& m) const {
    return DataLoss(what_ + ": pickle byte offset " + std::to_string(op_at_) + ": " + m);
  }
  static std::string OpName(unsigned char op) {
    char buf[16];
    if (op >= 0x20 && op < 0x7f)
      std::snprintf(buf, sizeof buf, "'%c'", op);
    else
      std::snprintf(buf, sizeof buf, "0x%02x", op);
    return buf;
  }

  // Input.
  Status Need(std::uint64_t n) const {
    if (n > data_.size() - pos_) {
      return Err("needs " + std::to_string(n) + " more bytes, but only " + std::to_string(data_.size() - pos_) +
                 " are left (truncated, or a corrupt length)");
    }
    return Status::Ok();
  }
  std::uint64_t ReadLE(std::size_t n) {
    std::uint64_t v = 0;
    for (std::size_t k = 0; k < n; ++k)
      v |= static_cast<std::uint64_t>(static_cast<unsigned char>(data_[pos_ + k])) << (8 * k);
    pos_ += n;
    return v;
  }
  Result<std::string> ReadBytes(std::uint64_t n) {
    RS_RETURN_IF_ERROR(Need(n));
    std::string s(reinterpret_cast<const char*>(data_.data()) + pos_, static_cast<std::size_t>(n));
    pos_ += static_cast<std::size_t>(n);
    return s;
  }
  Result<std::string> ReadLine() {
    const std::size_t limit = std::min(data_.size(), pos_ + kMaxGlobalLine);
    for (std::size_t k = pos_; k < limit; ++k) {
      if (data_[k] == std::byte{'\n'}) {
        std::string s(reinterpret_cast<const char*>(data_.data()) + pos_, k - pos_);
        pos_ = k + 1;
        return s;
      }
    }
    return Err("no newline within " + std::to_string(kMaxGlobalLine) + " bytes for a GLOBAL name (truncated?)");
  }

  // Nodes and the stack.
  // Before the node table or the memo grows: what they would then hold must fit in the
  // memory this process may use (a pickle of 10^9 one-byte opcodes is refused, not a
  // std::bad_alloc).
  // Counted generously: a growing vector briefly holds its old and new buffers, and the
  // process has other uses for its address space.
  Status Budget(std::size_t nodes, std::size_t memo, std::size_t stack) const {
    const auto bytes =
        static_cast<std::int64_t>(2 * (3 * nodes * sizeof(PickleNode) + memo * 64 + 3 * stack * sizeof(std::size_t)));
    Status st = CheckMemory(bytes, what_ + ": the pickle's values");
    if (!st.ok()) return Status(st.code(), st.message() + " (at pickle byte offset " + std::to_string(op_at_) + ")");
    return Status::Ok();
  }
  Result<std::size_t> New(PickleKind kind) {
    if (static_cast<std::int64_t>(nodes_.size()) >= o_.max_nodes) {
      return Err("more than " + std::to_string(o_.max_nodes) + " values");
    }
    if (nodes_.size() == nodes_.capacity() && nodes_.size() >= 4096) {
      RS_RETURN_IF_ERROR(Budget(2 * nodes_.size(), memo_.size(), stack_.size()));
    }
    PickleNode n;
    n.kind = kind;
    n.offset = static_cast<std::int64_t>(op_at_);
    nodes_.push_back(std::move(n));
    return nodes_.size() - 1;
  }
  // Before the stack grows (DUP and memo gets push without making a value).
  Status StackRoom() {
    if (stack_.size() == stack_.capacity() && stack_.size() >= 4096) {
      return Budget(nodes_.size(), memo_.size(), 2 * stack_.size());
    }
    return Status::Ok();
  }
  Status Push(PickleKind kind, std::size_t* out = nullptr) {
    RS_RETURN_IF_ERROR(StackRoom());
    RS_ASSIGN_OR_RETURN(const std::size_t n, New(kind));
    stack_.push_back(n);
    if (out != nullptr) *out = n;
    return Status::Ok();
  }
  std::size_t Base() const { return marks_.empty() ? 0 : marks_.back(); }
  Result<std::size_t> Pop() {
    if (stack_.size() <= Base()) return Err("stack underflow");
    const std::size_t v = stack_.back();
    stack_.pop_back();
    return v;
  }
  Result<std::size_t> Top() const {
    if (stack_.size() <= Base()) return Err("stack underflow");
    return stack_.back();
  }
  Result<std::vector<std::size_t>> PopMark() {
    if (marks_.empty()) return Err("no MARK on the stack");
    const std::size_t base = marks_.back();
    marks_.pop_back();
    std::vector<std::size_t> items(stack_.begin() + static_cast<std::ptrdiff_t>(base), stack_.end());
    stack_.resize(base);
    return items;
  }
  PickleNode& N(std::size_t i) { return nodes_[i]; }

  const PickleGlobal* FindGlobal(std::string_view module, std::string_view name) const {
    for (const PickleGlobal& g : o_.globals) {
      if (g.module == module && g.name == name) return &g;
    }
    return nullptr;
  }
  Status PushGlobal(std::string module, std::string name) {  // copies: Push may move the nodes
    if (FindGlobal(module, name) == nullptr && !o_.inert_unknown_globals) {
      std::string shown = module + "." + name;
      if (shown.size() > 200) shown = shown.substr(0, 200) + "...";
      return Err("global '" + shown + "' is not on the allowlist (refused; nothing is executed)");
    }
    std::size_t n = 0;
    RS_RETURN_IF_ERROR(Push(PickleKind::kGlobal, &n));
    N(n).module = std::move(module);
    N(n).s = std::move(name);
    return Status::Ok();
  }

  // REDUCE / NEWOBJ / NEWOBJ_EX: `callable` applied to `args`.
  Status Call(std::size_t callable, std::size_t args, std::size_t kwargs, const char* opname) {
    if (N(callable).kind != PickleKind::kGlobal) {
      return Err(std::string(opname) + " of a " + std::string(PickleKindName(N(callable).kind)) +
                 ", not of an allowlisted global (refused)");
    }
    const PickleGlobal* g = FindGlobal(N(callable).module, N(callable).s);
    if ((g == nullptr && !o_.inert_unknown_globals) || (g != nullptr && !g->callable)) {
      return Err(std::string(opname) + " of '" + N(callable).module + "." + N(callable).s +
                 "', which is allowed only as a value, not as a callable (refused)");
    }
    if (N(args).kind != PickleKind::kTuple) {
      return Err(std::string(opname) + " of '" + N(callable).module + "." + N(callable).s + "' with a " +
                 std::string(PickleKindName(N(args).kind)) + " for arguments (expected a tuple)");
    }
    const std::string module = N(callable).module;
    const std::string name = N(callable).s;
    const std::vector<std::size_t> a = N(args).items;
    if ((module == "collections" && name == "OrderedDict") || (module == "builtins" && name == "dict")) {
      if (!a.empty() || kwargs != kPickleNoNode)
        return Err(module + "." + name + " called with arguments (expected none)");
      return Push(PickleKind::kDict);
    }
    if (module == "builtins" && (name == "set" || name == "frozenset")) {
      if (a.size() > 1 || kwargs != kPickleNoNode)
        return Err(module + "." + name + " called with more than one argument");
      std::size_t n = 0;
      std::vector<std::size_t> items;
      if (a.size() == 1) {
        const PickleNode& src = N(a[0]);
        if (src.kind != PickleKind::kList && src.kind != PickleKind::kTuple && src.kind != PickleKind::kSet) {
          return Err(module + "." + name + " of a " + std::string(PickleKindName(src.kind)) + " (expected a list)");
        }
        items = src.items;
      }
      RS_RETURN_IF_ERROR(Push(PickleKind::kSet, &n));
      N(n).items = std::move(items);
      return Status::Ok();
    }
    std::size_t n = 0;
    RS_RETURN_IF_ERROR(Push(PickleKind::kObject, &n));
    N(n).module = module;
    N(n).s = name;
    N(n).cls = callable;
    N(n).args = args;
    N(n).kwargs = kwargs;
    return Status::Ok();
  }

  Status Memo(std::uint64_t key) {
    RS_ASSIGN_OR_RETURN(const std::size_t top, Top());
    if (memo_.size() >= 4096 && (memo_.size() & (memo_.size() - 1)) == 0) {
      RS_RETURN_IF_ERROR(Budget(nodes_.size(), 2 * memo_.size(), stack_.size()));
    }
    memo_[key] = top;
    return Status::Ok();
  }
  Status Get(std::uint64_t key) {
    const auto it = memo_.find(key);
    if (it == memo_.end()) return Err("memo index " + std::to_string(key) + " was never stored");
    RS_RETURN_IF_ERROR(StackRoom());
    stack_.push_back(it->second);
    return Status::Ok();
  }

  Status PushInt(std::int64_t v) {
    std::size_t n = 0;
    RS_RETURN_IF_ERROR(Push(PickleKind::kInt, &n));
    N(n).i = v;
    return Status::Ok();
  }
  Status PushLong(std::uint64_t nbytes) {
    if (nbytes > 8) return Err("integer of " + std::to_string(nbytes) + " bytes does not fit 64 bits");
    RS_RETURN_IF_ERROR(Need(nbytes));
    std::uint64_t v = ReadLE(static_cast<std::size_t>(nbytes));
    if (nbytes > 0 && nbytes < 8 && (v >> (8 * nbytes - 1)) != 0) v |= ~std::uint64_t{0} << (8 * nbytes);  // sign
    return PushInt(static_cast<std::int64_t>(v));
  }
  Status PushString(PickleKind kind, std::uint64_t len) {
    RS_ASSIGN_OR_RETURN(std::string s, ReadBytes(len));
    if (kind == PickleKind::kString && !IsValidUtf8(s)) {
      // Python's unpickler decodes these opcodes as UTF-8 and refuses the same bytes.
      return Err("a unicode string of " + std::to_string(s.size()) + " bytes is not valid UTF-8");
    }
    std::size_t n = 0;
    RS_RETURN_IF_ERROR(Push(kind, &n));
    N(n).s = std::move(s);
    return Status::Ok();
  }
  Status Container(PickleKind kind, std::vector<std::size_t> items) {
    std::size_t n = 0;
    RS_RETURN_IF_ERROR(Push(kind, &n));
    N(n).items = std::move(items);
    return Status::Ok();
  }
  Status TupleN(std::size_t k) {
    std::vector<std::size_t> items(k);
    for (std::size_t j = k; j-- > 0;) {
      RS_ASSIGN_OR_RETURN(items[j], Pop());
    }
    return Container(PickleKind::kTuple, std::move(items));
  }
  Status AddTo(std::size_t target, PickleKind want, const std::vector<std::size_t>& items, const char* opname) {
    if (N(target).kind != want) {
      return Err(std::string(opname) + " on a " + Describe(target) + " (expected a " +
                 std::string(PickleKindName(want)) + ")");
    }
    if (want == PickleKind::kDict && items.size() % 2 != 0)
      return Err(std::string(opname) + " with an odd number of items");
    auto& dst = N(target).items;
    dst.insert(dst.end(), items.begin(), items.end());
    return Status::Ok();
  }
  std::string Describe(std::size_t i) const {
    const PickleNode& n = nodes_[i];
    std::string s(PickleKindName(n.kind));
    if (n.kind == PickleKind::kGlobal || n.kind == PickleKind::kObject) s += " '" + n.module + "." + n.s + "'";
    return s;
  }

  Status Step(unsigned char op) {
    switch (op) {
      case kProto: {
        RS_RETURN_IF_ERROR(Need(1));
        const auto v = ReadLE(1);
        if (v < 2 || v > 5) return Err("pickle protocol " + std::to_string(v) + " (this reader takes 2 to 5)");
        return Status::Ok();
      }
      case kFrame: {
        RS_RETURN_IF_ERROR(Need(8));
        const std::uint64_t len = ReadLE(8);
        if (len > data_.size() - pos_)
          return Err("FRAME of " + std::to_string(len) + " bytes runs past the end of the input");
        return Status::Ok();
      }
      case kStop: {
        RS_ASSIGN_OR_RETURN(result_, Pop());
        stopped_ = true;
        return Status::Ok();
      }
      case kMark:
        if (marks_.size() == marks_.capacity() && marks_.size() >= 4096) {
          RS_RETURN_IF_ERROR(Budget(nodes_.size(), memo_.size(), stack_.size() + 2 * marks_.size()));
        }
        marks_.push_back(stack_.size());
        return Status::Ok();
      case kPop:
        if (stack_.size() > Base()) {
          stack_.pop_back();
          return Status::Ok();
        }
        if (marks_.empty()) return Err("stack underflow");
        return PopMark().status();
      case kPopMark:
        return PopMark().status();
      case kDup: {
        RS_ASSIGN_OR_RETURN(const std::size_t top, Top());
        RS_RETURN_IF_ERROR(StackRoom());
        stack_.push_back(top);
        return Status::Ok();
      }
      case kNone:
        return Push(PickleKind::kNone);
      case kNewTrue:
      case kNewFalse: {
        std::size_t n = 0;
        RS_RETURN_IF_ERROR(Push(PickleKind::kBool, &n));
        N(n).b = op == kNewTrue;
        return Status::Ok();
      }
      case kBinInt:
        RS_RETURN_IF_ERROR(Need(4));
        return PushInt(static_cast<std::int32_t>(static_cast<std::uint32_t>(ReadLE(4))));
      case kBinInt1:
        RS_RETURN_IF_ERROR(Need(1));
        return PushInt(static_cast<std::int64_t>(ReadLE(1)));
      case kBinInt2:
        RS_RETURN_IF_ERROR(Need(2));
        return PushInt(static_cast<std::int64_t>(ReadLE(2)));
      case kLong1:
        RS_RETURN_IF_ERROR(Need(1));
        return PushLong(ReadLE(1));
      case kLong4:
        RS_RETURN_IF_ERROR(Need(4));
        return PushLong(ReadLE(4));
      case kBinFloat: {
        RS_RETURN_IF_ERROR(Need(8));
        std::uint64_t bits = 0;
        for (int k = 0; k < 8; ++k) bits = (bits << 8) | static_cast<unsigned char>(data_[pos_++]);  // big-endian
        std::size_t n = 0;
        RS_RETURN_IF_ERROR(Push(PickleKind::kFloat, &n));
        N(n).f = std::bit_cast<double>(bits);
        return Status::Ok();
      }
      case kShortBinUnicode:
        RS_RETURN_IF_ERROR(Need(1));
        return PushString(PickleKind::kString, ReadLE(1));
      case kBinUnicode:
        RS_RETURN_IF_ERROR(Need(4));
        return PushString(PickleKind::kString, ReadLE(4));
      case kBinUnicode8:
        RS_RETURN_IF_ERROR(Need(8));
        return PushString(PickleKind::kString, ReadLE(8));
      case kShortBinBytes:
      case kShortBinString:
        RS_RETURN_IF_ERROR(Need(1));
        return PushString(PickleKind::kBytes, ReadLE(1));
      case kBinBytes:
        RS_RETURN_IF_ERROR(Need(4));
        return PushString(PickleKind::kBytes, ReadLE(4));
      case kBinString: {
        RS_RETURN_IF_ERROR(Need(4));
        const auto len = static_cast<std::int32_t>(static_cast<std::uint32_t>(ReadLE(4)));
        if (len < 0) return Err("BINSTRING with negative length " + std::to_string(len));
        return PushString(PickleKind::kBytes, static_cast<std::uint64_t>(len));
      }
      case kBinBytes8:
      case kByteArray8:
        RS_RETURN_IF_ERROR(Need(8));
        return PushString(PickleKind::kBytes, ReadLE(8));
      case kEmptyTuple:
        return Container(PickleKind::kTuple, {});
      case kTuple1:
        return TupleN(1);
      case kTuple2:
        return TupleN(2);
      case kTuple3:
        return TupleN(3);
      case kTuple: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        return Container(PickleKind::kTuple, std::move(items));
      }
      case kEmptyList:
        return Container(PickleKind::kList, {});
      case kList: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        return Container(PickleKind::kList, std::move(items));
      }
      case kEmptyDict:
        return Container(PickleKind::kDict, {});
      case kDict: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        if (items.size() % 2 != 0) return Err("DICT with an odd number of items");
        return Container(PickleKind::kDict, std::move(items));
      }
      case kEmptySet:
        return Container(PickleKind::kSet, {});
      case kFrozenSet: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        return Container(PickleKind::kSet, std::move(items));
      }
      case kAppend: {
        RS_ASSIGN_OR_RETURN(const std::size_t v, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t list, Top());
        return AddTo(list, PickleKind::kList, {v}, "APPEND");
      }
      case kAppends: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        RS_ASSIGN_OR_RETURN(const std::size_t list, Top());
        return AddTo(list, PickleKind::kList, items, "APPENDS");
      }
      case kSetItem: {
        RS_ASSIGN_OR_RETURN(const std::size_t v, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t k, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t dict, Top());
        return AddTo(dict, PickleKind::kDict, {k, v}, "SETITEM");
      }
      case kSetItems: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        RS_ASSIGN_OR_RETURN(const std::size_t dict, Top());
        return AddTo(dict, PickleKind::kDict, items, "SETITEMS");
      }
      case kAddItems: {
        RS_ASSIGN_OR_RETURN(auto items, PopMark());
        RS_ASSIGN_OR_RETURN(const std::size_t set, Top());
        return AddTo(set, PickleKind::kSet, items, "ADDITEMS");
      }
      case kBinPut:
        RS_RETURN_IF_ERROR(Need(1));
        return Memo(ReadLE(1));
      case kLongBinPut:
        RS_RETURN_IF_ERROR(Need(4));
        return Memo(ReadLE(4));
      case kMemoize:
        return Memo(memo_.size());
      case kBinGet:
        RS_RETURN_IF_ERROR(Need(1));
        return Get(ReadLE(1));
      case kLongBinGet:
        RS_RETURN_IF_ERROR(Need(4));
        return Get(ReadLE(4));
      case kGlobal: {
        RS_ASSIGN_OR_RETURN(const std::string module, ReadLine());
        RS_ASSIGN_OR_RETURN(const std::string name, ReadLine());
        return PushGlobal(module, name);
      }
      case kStackGlobal: {
        RS_ASSIGN_OR_RETURN(const std::size_t name, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t module, Pop());
        if (N(name).kind != PickleKind::kString || N(module).kind != PickleKind::kString) {
          return Err("STACK_GLOBAL of a " + Describe(module) + " and a " + Describe(name) + " (expected two strings)");
        }
        return PushGlobal(N(module).s, N(name).s);
      }
      case kReduce: {
        RS_ASSIGN_OR_RETURN(const std::size_t args, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t callable, Pop());
        return Call(callable, args, kPickleNoNode, "REDUCE");
      }
      case kNewObj: {
        RS_ASSIGN_OR_RETURN(const std::size_t args, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t cls, Pop());
        return Call(cls, args, kPickleNoNode, "NEWOBJ");
      }
      case kNewObjEx: {
        RS_ASSIGN_OR_RETURN(const std::size_t kwargs, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t args, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t cls, Pop());
        if (N(kwargs).kind != PickleKind::kDict)
          return Err("NEWOBJ_EX with a " + Describe(kwargs) + " for keyword arguments");
        return Call(cls, args, kwargs, "NEWOBJ_EX");
      }
      case kBuild: {
        RS_ASSIGN_OR_RETURN(const std::size_t state, Pop());
        RS_ASSIGN_OR_RETURN(const std::size_t obj, Top());
        if (N(obj).kind != PickleKind::kObject)
          return Err("BUILD on a " + Describe(obj) + " (expected an object record)");
        N(obj).state = state;
        return Status::Ok();
      }
      case kBinPersId: {
        if (!o_.allow_persistent_ids) return Err("persistent id (BINPERSID) is not allowed here (refused)");
        RS_ASSIGN_OR_RETURN(const std::size_t id, Pop());
        std::size_t n = 0;
        RS_RETURN_IF_ERROR(Push(PickleKind::kPersistentId, &n));
        N(n).args = id;
        return Status::Ok();
      }
      case kPersId:
        return Err("text persistent id (PERSID) is not supported (refused)");
      case kExt1:
      case kExt2:
      case kExt4:
        return Err("extension registry opcode " + OpName(op) + " (EXT1/EXT2/EXT4) is not supported (refused)");
      case kNextBuffer:
      case kReadonlyBuffer:
        return Err("out-of-band buffer opcode " + OpName(op) + " is not supported (refused)");
      case kInst:
      case kObj:
        return Err("protocol-0/1 object opcode " + OpName(op) + " (INST/OBJ) is not supported (refused)");
      case kInt:
      case kLong:
      case kFloat:
      case kString:
      case kUnicode:
      case kGet:
      case kPut:
        return Err("protocol-0 text opcode " + OpName(op) + " is not supported (this reader takes protocols 2 to 5)");
      default:
        return Err("unknown opcode " + OpName(op));
    }
  }

  std::span<const std::byte> data_;
  const PickleOptions& o_;
  const std::string& what_;
  std::vector<PickleNode>& nodes_;
  std::size_t pos_ = 0;
  std::size_t op_at_ = 0;
  std::vector<std::size_t> stack_;
  std::vector<std::size_t> marks_;
  std::unordered_map<std::uint64_t, std::size_t> memo_;
  bool stopped_ = false;
  std::size_t result_ = kPickleNoNode;
};

// Pickled strings come from files and need not be UTF-8, which a JSON value must be: the bytes
// that are not are written as "\xNN" (a dump would throw on them).
std::string JsonText(const std::string& s) { return IsValidUtf8(s) ? s : SafeText(s); }

Status ToJsonRec(const PickleTree& t, std::size_t i, int depth, int max_depth, std::int64_t& budget,
                 nlohmann::json& out) {
  if (depth > max_depth)
    return InvalidArgument("value nested deeper than " + std::to_string(max_depth) + " levels (or cyclic)");
  if (--budget < 0) return InvalidArgument("value has too many parts to show");
  const PickleNode& n = t.node(i);
  auto list = [&](const std::vector<std::size_t>& items, nlohmann::json& dst) -> Status {
    dst = nlohmann::json::array();
    for (const std::size_t c : items) {
      nlohmann::json v;
      RS_RETURN_IF_ERROR(ToJsonRec(t, c, depth + 1, max_depth, budget, v));
      dst.push_back(std::move(v));
    }
    return Status::Ok();
  };
  switch (n.kind) {
    case PickleKind::kNone:
      out = nullptr;
      return Status::Ok();
    case PickleKind::kBool:
      out = n.b;
      return Status::Ok();
    case PickleKind::kInt:
      out = n.i;
      return Status::Ok();
    case PickleKind::kFloat:
      out = n.f;
      return Status::Ok();
    case PickleKind::kString:
      out = JsonText(n.s);
      return Status::Ok();
    case PickleKind::kBytes:
      out = {{"bytes", n.s.size()}};
      return Status::Ok();
    case PickleKind::kTuple:
    case PickleKind::kList:
    case PickleKind::kSet:
      return list(n.items, out);
    case PickleKind::kDict: {
      bool string_keys = true;
      for (std::size_t k = 0; k < n.items.size(); k += 2)
        string_keys = string_keys && t.node(n.items[k]).kind == PickleKind::kString;
      if (!string_keys) {
        out = nlohmann::json::array();
        for (std::size_t k = 0; k + 1 < n.items.size(); k += 2) {
          nlohmann::json key, value;
          RS_RETURN_IF_ERROR(ToJsonRec(t, n.items[k], depth + 1, max_depth, budget, key));
          RS_RETURN_IF_ERROR(ToJsonRec(t, n.items[k + 1], depth + 1, max_depth, budget, value));
          out.push_back(nlohmann::json::array({std::move(key), std::move(value)}));
        }
        return Status::Ok();
      }
      out = nlohmann::json::object();
      for (std::size_t k = 0; k + 1 < n.items.size(); k += 2) {
        nlohmann::json value;
        RS_RETURN_IF_ERROR(ToJsonRec(t, n.items[k + 1], depth + 1, max_depth, budget, value));
        out[JsonText(t.node(n.items[k]).s)] = std::move(value);
      }
      return Status::Ok();
    }
    case PickleKind::kGlobal:
      out = JsonText(n.module + "." + n.s);
      return Status::Ok();
    case PickleKind::kObject: {
      out = {{"class", JsonText(n.module + "." + n.s)}};
      if (n.args != kPickleNoNode) RS_RETURN_IF_ERROR(ToJsonRec(t, n.args, depth + 1, max_depth, budget, out["args"]));
      if (n.kwargs != kPickleNoNode)
        RS_RETURN_IF_ERROR(ToJsonRec(t, n.kwargs, depth + 1, max_depth, budget, out["kwargs"]));
      if (n.state != kPickleNoNode)
        RS_RETURN_IF_ERROR(ToJsonRec(t, n.state, depth + 1, max_depth, budget, out["state"]));
      return Status::Ok();
    }
    case PickleKind::kPersistentId: {
      nlohmann::json id;
      RS_RETURN_IF_ERROR(ToJsonRec(t, n.args, depth + 1, max_depth, budget, id));
      out = {{"persistent_id", std::move(id)}};
      return Status::Ok();
    }
  }
  return Status::Ok();
}

}  // namespace

std::string_view PickleKindName(PickleKind k) {
  switch (k) {
    case PickleKind::kNone:
      return "none";
    case PickleKind::kBool:
      return "bool";
    case PickleKind::kInt:
      return "int";
    case PickleKind::kFloat:
      return "float";
    case PickleKind::kString:
      return "str";
    case PickleKind::kBytes:
      return "bytes";
    case PickleKind::kTuple:
      return "tuple";
    case PickleKind::kList:
      return "list";
    case PickleKind::kDict:
      return "dict";
    case PickleKind::kSet:
      return "set";
    case PickleKind::kGlobal:
      return "global";
    case PickleKind::kObject:
      return "object";
    case PickleKind::kPersistentId:
      return "persistent id";
  }
  return "?";
}

std::string PickleTree::Describe(std::size_t i) const {
  const PickleNode& n = nodes_[i];
  std::string s(PickleKindName(n.kind));
  if (n.kind == PickleKind::kGlobal || n.kind == PickleKind::kObject) s += " '" + n.module + "." + n.s + "'";
  return s;
}

Result<PickleTree> Unpickle(std::span<const std::byte> data, const PickleOptions& options, const std::string& what) {
  PickleTree tree;
  Machine m(data, options, what, tree.nodes_);
  RS_ASSIGN_OR_RETURN(tree.root_, m.Run());
  return tree;
}

Result<nlohmann::json> PickleToJson(const PickleTree& tree, std::size_t node, int max_depth, std::int64_t max_nodes) {
  nlohmann::json out;
  std::int64_t budget = max_nodes;
  RS_RETURN_IF_ERROR(ToJsonRec(tree, node, 0, max_depth, budget, out));
  return out;
}

}  // namespace rs
