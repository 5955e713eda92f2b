#include "topology/host_map.h"

#include <map>

namespace cgx::topology {

HostMap::HostMap(std::vector<std::string> host_names) {
  std::map<std::string, int> index;
  host_of_rank_.reserve(host_names.size());
  for (const auto& name : host_names) {
    auto [it, inserted] = index.emplace(name, num_hosts_);
    if (inserted) ++num_hosts_;
    host_of_rank_.push_back(it->second);
  }
}

HostMap HostMap::exchange(KeyValueStore& store, int rank, int size, const std::string& my_host) {
  store.set("host/" + std::to_string(rank), std::vector<uint8_t>(my_host.begin(), my_host.end()));
  std::vector<std::string> names;
  names.reserve(size);
  for (int r = 0; r < size; ++r) {
    auto bytes = store.get("host/" + std::to_string(r));
    names.emplace_back(bytes.begin(), bytes.end());
  }
  return HostMap(std::move(names));
}

std::vector<int> HostMap::ranks_on_host_of(int rank) const { return ranks_on_host(host_of(rank)); }

std::vector<int> HostMap::ranks_on_host(int host) const {
  std::vector<int> ranks;
  for (int r = 0; r < size(); ++r)
    if (host_of(r) == host) ranks.push_back(r);
  return ranks;
}

bool HostMap::balanced() const {
  for (int h = 1; h < num_hosts_; ++h)
    if (ranks_on_host(h).size() != ranks_on_host(0).size()) return false;
  return true;
}

}  // namespace cgx::topology
