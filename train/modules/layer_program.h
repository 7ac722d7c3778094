// The layer program: the order of a model's modules and the collectives between them, written
// once for every backend. A model is an embedding, then per layer two pre-norm residual blocks
// (h += body(norm(h)): the mixer, then the MLP), then the output. Which modules a block's body
// is made of, and whether its output is a partial sum over the tensor-parallel group, follow from
// the config and the tensors' gradient classes (a row-parallel output projection leaves each tp
// rank a partial sum). train/modules/model.cc runs the program on the CPU; a backend implements its
// modules and is checked against it (train/modules/backend.h), so what a backend can run is computed
// from what it registers.
#pragma once

#include <array>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "core/model.h"

namespace rs::train {

// A module: a named piece of the model with a forward and a backward pass, which a backend
// implements (or not). `what` says it in words, for refusals and `reshard models`.
struct ModuleInfo {
  std::string_view name;
  std::string_view what;
};

// Every module of train/, in program order (the CPU backend implements each).
std::span<const ModuleInfo> KnownModules();
// The words of a known module; `name` itself for another (a test's toy module).
std::string_view ModuleWhat(std::string_view name);

// One pre-norm residual block, h += body(norm(h)).
struct ResidualBlock {
  enum class Part : std::uint8_t { kMixer, kMlp };
  Part part = Part::kMixer;
  std::string norm;               // "rms_norm" or "rms_norm_zero_centered"
  std::string body;               // the mixer or the MLP: "softmax_attention", "moe", "dense_mlp" ...
  std::vector<std::string> uses;  // modules the body runs besides itself: "qk_norm", a router ...
  // The body's output is a partial sum on each tensor-parallel rank (its output projection is
  // row-parallel: cut along its input dim), all-reduced over tp before the residual add; in the
  // backward pass the gradient of the block's input is likewise summed. False where the body
  // completes its own output (the MoE block sums over its expert-tensor group inside).
  bool sum_over_tp = false;
};

struct LayerProgram {
  std::string model;  // the config's name, for messages
  // The token lookup: each tp rank contributes the rows of the vocabulary it holds, summed over tp.
  std::string embedding = "embedding";
  // Per layer, the mixer block then the MLP block.
  std::vector<std::array<ResidualBlock, 2>> layers;
  // The final norm, and the output projection with the vocab-parallel cross-entropy (its row
  // maxima and sums reduced over tp, the loss summed over the data group).
  std::string final_norm = "rms_norm";
  std::string output = "output";

  // Every module the program needs, each once, in program order.
  std::vector<std::string> Modules() const;
  // One line per distinct layer shape: "layers 0-1: rms_norm > softmax_attention[qk_norm] > sum tp | ..."
  std::string ToString() const;
};

// The program of a config (which must validate).
LayerProgram BuildLayerProgram(const ModelConfig& config);

}  // namespace rs::train
