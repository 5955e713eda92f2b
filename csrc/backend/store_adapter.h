// c10d::Store seen as the torch-free KeyValueStore of the lower layers.
#pragma once

#include <torch/csrc/distributed/c10d/Store.hpp>

#include "common/kv_store.h"

namespace cgx::backend {

class StoreAdapter final : public KeyValueStore {
 public:
  explicit StoreAdapter(c10::intrusive_ptr<c10d::Store> store) : store_(std::move(store)) {}
  void set(const std::string& key, const std::vector<uint8_t>& value) override;
  std::vector<uint8_t> get(const std::string& key) override;

 private:
  c10::intrusive_ptr<c10d::Store> store_;
};

}  // namespace cgx::backend
