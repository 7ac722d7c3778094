// The project's own MoE model (train/MODEL.md): every router kind, shared experts, dense first
// layers. It has no Hugging Face form of its own; a checkpoint whose config a Mixtral can
// express exports as Mixtral.
#include "models/family.h"

namespace rs {

const ModelFamily& MoeFamily() {
  static const ModelFamily f{
      .name = "moe",
      .description = "the project's own MoE transformer (train/MODEL.md)",
      .hf_model_types = {},
      .hf_architectures = {},
      .read_hf_config = nullptr,
      .write_hf_config = nullptr,
      .hf_names = {},
      .titan_names = {},
      .hf_variants = {},
      .hf_export_as = "mixtral",
      .toy_config = [] { return ModelConfig{}; },  // the tiny-moe preset
      .can = {.hf_import = false, .hf_export = true, .megatron_import = true, .megatron_export = true},
  };
  return f;
}

}  // namespace rs
