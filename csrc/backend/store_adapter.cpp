#include "backend/store_adapter.h"

namespace cgx::backend {

void StoreAdapter::set(const std::string& key, const std::vector<uint8_t>& value) {
  store_->set(key, value);
}

std::vector<uint8_t> StoreAdapter::get(const std::string& key) { return store_->get(key); }

}  // namespace cgx::backend
