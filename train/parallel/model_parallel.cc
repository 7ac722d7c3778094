#include "train/parallel/model_parallel.h"

namespace rs::train {

ModelParallel& SingleProcess() {
  static ModelParallel single;
  return single;
}

}  // namespace rs::train
