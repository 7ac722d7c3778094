// A writer of Python pickles for the files PyTorch reads that we write: the `.metadata` of a
// Distributed Checkpoint and the `data.pkl` of a torch.save archive (formats/torch/DCP.md §8). It
// emits protocol-2 opcodes only (what torch.save's own data.pkl uses; every Python 3 unpickler
// and our restricted reader take them) and no memo: each value is written where it is used, so
// the output depends on nothing but the calls. The caller builds values bottom-up on the
// unpickler's stack, as the opcodes do:
//
//   PickleWriter p;                       // PROTO 2
//   p.Global("torch", "Size");            // push the class
//   p.Mark(); p.Int(4); p.Int(8); p.Tuple();   // push (4, 8)
//   p.Tuple1(); p.Reduce();               // torch.Size((4, 8))
//   p.Stop();                             // `bytes()` is the pickle
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace rs {

class PickleWriter {
 public:
  PickleWriter();  // writes PROTO 2

  void None();
  void Bool(bool v);
  void Int(std::int64_t v);            // BININT1 / BININT2 / BININT, or LONG1 beyond 32 bits
  void Float(double v);                // BINFLOAT (big-endian IEEE 754)
  void String(std::string_view utf8);  // BINUNICODE (the caller passes valid UTF-8)
  void Global(std::string_view module, std::string_view name);
  void Mark();
  void Tuple();  // the items since the last Mark
  void Tuple0();
  void Tuple1();
  void Tuple2();
  void EmptyList();
  void Appends();  // the items since the last Mark, appended to the list below the mark
  void EmptyDict();
  void SetItems();   // key, value pairs since the last Mark, into the dict below the mark
  void Reduce();     // callable, args -> callable(*args)
  void NewObj();     // cls, args -> cls.__new__(cls, *args)
  void Build();      // obj, state -> obj with state set
  void BinPersId();  // the value on the stack becomes a persistent id (torch.save's storages)
  void Stop();

  const std::vector<std::byte>& bytes() const { return out_; }
  std::vector<std::byte> Take() { return std::move(out_); }

 private:
  void Op(std::uint8_t op);
  void Le(std::uint64_t v, int n);
  std::vector<std::byte> out_;
};

}  // namespace rs
