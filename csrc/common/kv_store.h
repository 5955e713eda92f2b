// The rendezvous store as the torch-free layers see it. The backend adapts c10d::Store.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace cgx {

class KeyValueStore {
 public:
  virtual ~KeyValueStore() = default;
  virtual void set(const std::string& key, const std::vector<uint8_t>& value) = 0;
  // Blocks until the key exists (bounded by the store's own timeout), then returns it.
  virtual std::vector<uint8_t> get(const std::string& key) = 0;
};

}  // namespace cgx
